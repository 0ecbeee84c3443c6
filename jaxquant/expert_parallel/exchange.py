"""`dispatch` and `combine`: routed rows to their experts' devices and back, by the exchange
that `choose` picks (recorded for `jaxquant.explain`).

Paths (the `path` of the `"ep-exchange"` decision):
  "ragged-all-to-all"  `jax.lax.ragged_all_to_all` of the real rows only (`ragged.py`), the
                       default where it is dropless and the platform compiles it (CUDA);
  "all-to-all"         fixed-size per-pair buffers (`fixed.py`): with a capacity factor, where
                       the ragged exchange is not compiled (XLA:CPU), or when asked for;
                       dropless it moves, quantizes and multiplies `ep` times the real rows;
  "local"              no expert axis: each token shard groups its own rows for every
                       (replicated) expert, nothing is sent.
Both exchanges give the same rows in the same order (each receiver's rows grouped by local
expert, senders in order, then zero rows that belong to no group) and the same `group_sizes`;
only the fixed one drops assignments past its capacity.
"""

from __future__ import annotations

from typing import Union

import jax
from jax.sharding import Mesh

from jaxquant.explain import Decision, record
from jaxquant.expert_parallel import fixed, ragged
from jaxquant.expert_parallel.layout import ExpertSharding

# Platforms (jaxquant's names) whose XLA compiles `ragged-all-to-all` and where it has run here.
RAGGED_PLATFORMS = ("cuda",)

# Platforms where "auto" takes the ragged exchange over the dropless fixed-size one: where it was
# measured faster. None today. On 4x H100 (jax 0.11.2, bench/RESULTS.md, the `--moe 8,2`
# model at ep=4) XLA runs `ragged-all-to-all` as a one-shot copy kernel plus cross-GPU
# barriers (`RaggedAllToAllKernelImpl`, `MultiGpuBarrierKernelImpl`: 59 ms of a 101 ms FP8
# step), and the fixed-size exchange (NCCL all-to-all of `ep x` the rows) stepped at 60 ms;
# XLA's decomposer flag (73 ms) and its NCCL send/recv fallback (deadlocked) did not beat it.
RAGGED_AUTO_PLATFORMS: tuple[str, ...] = ()
RAGGED_AUTO_REASON = ("measured slower than the fixed-size exchange on 4x H100 (XLA's "
                      "ragged-all-to-all runs a one-shot copy kernel with cross-GPU barriers): "
                      "exchange='ragged' selects it")

Dispatched = Union[fixed.Dispatched, ragged.RaggedDispatched]


def mesh_platform(mesh) -> str:
  """"cpu", "cuda", ... of the mesh's devices (the default backend's for an abstract mesh that
  names none)."""
  if isinstance(mesh, Mesh):
    platform = mesh.devices.flat[0].platform
  else:
    device = getattr(mesh, "abstract_device", None)
    platform = getattr(device, "platform", None) or jax.default_backend()
  return "cuda" if platform == "gpu" else platform


def choose(layout: ExpertSharding, platform: str) -> tuple[str, str]:
  """`(path, reason)`: the exchange `layout` takes on `platform`, and why not the ragged one
  when it is not taken ("" when it is, or when there is nothing to exchange)."""
  if layout.ep == 1:
    return "local", ""
  if layout.exchange == "ragged":
    return "ragged-all-to-all", ""
  if layout.exchange == "fixed":
    return "all-to-all", "exchange='fixed' asked for"
  if layout.capacity_factor is not None:
    return "all-to-all", (f"capacity_factor={layout.capacity_factor}: fixed-size buffers that "
                          "drop assignments past the capacity (the ragged exchange is dropless)")
  if platform in RAGGED_AUTO_PLATFORMS:
    return "ragged-all-to-all", ""
  if platform == "cpu":
    why = "XLA:CPU does not compile ragged_all_to_all"
  elif platform in RAGGED_PLATFORMS:
    why = f"the ragged exchange was {RAGGED_AUTO_REASON}"
  else:
    why = (f"the ragged exchange runs on {', '.join(RAGGED_PLATFORMS)} only (not tried on "
           f"{platform})")
  return "all-to-all", (f"{why}; dropless fixed-size buffers move and compute {layout.ep}x "
                        "the real rows")


def _record(layout: ExpertSharding, assignments: int, path: str, reason: str) -> None:
  rows = layout.ep * layout.capacity(assignments)
  detail = (f"{layout.experts} experts over {layout.expert_axis or '-'}={layout.ep} "
            f"({layout.local_experts} per device), {assignments} assignments per token shard; "
            f"{rows} receive rows per device")
  record(Decision("ep-exchange", "expert dispatch+combine", detail, path, reason))


def dispatch(x: jax.Array, chosen: jax.Array, layout: ExpertSharding):
  """Send every token-expert assignment to its expert's device.

  Args:
    x: `[T, D]` tokens, sharded over `layout.token_axes`.
    chosen: `[T, k]` int expert index (in `[0, E)`) of each token's k choices, sharded alike.
    layout: the `ExpertSharding`.

  Returns:
    `(rows, group_sizes, dispatched)`: `rows[shards * ep * capacity, D]` (each shard's rows
    sorted by its local experts, then zero rows of no group; capacity = the shard's `T * k /
    shards` assignments when dropless), `group_sizes[shards * E_loc]` (each shard's rows per
    local expert) and the bookkeeping for `combine`; all sharded over the token axes.
  """
  tokens, top_k = chosen.shape
  shards = layout.shards
  if tokens % shards:
    raise ValueError(f"dispatch: {tokens} tokens do not divide over the {shards} token shards "
                     f"of {layout.token_axes}")
  assignments = (tokens // shards) * top_k
  path, reason = choose(layout, mesh_platform(layout.mesh))
  _record(layout, assignments, path, reason)
  spec = layout.token_spec
  if path == "ragged-all-to-all":
    local = lambda x, c: ragged.local_dispatch(x, c, layout=layout)
    bookkeeping = ragged.RaggedDispatched(spec, spec, spec)
  else:
    capacity = layout.capacity(assignments)
    local = lambda x, c: fixed.local_dispatch(x, c, layout=layout, capacity=capacity)
    bookkeeping = fixed.Dispatched(spec, spec, spec)
  fn = jax.shard_map(local, mesh=layout.mesh, in_specs=(spec, spec),
                     out_specs=(spec, spec, bookkeeping), check_vma=False)
  return fn(x, chosen)


def combine(y: jax.Array, weights: jax.Array, dispatched: Dispatched,
            layout: ExpertSharding) -> jax.Array:
  """The inverse of `dispatch` (by the exchange it took), then each token's outputs summed with
  its router weights.

  Args:
    y: `[shards * ep * capacity, N]` expert outputs, in `dispatch`'s row order.
    weights: `[T, k]` router weights of the choices.
    dispatched: from `dispatch`.
    layout: the same `ExpertSharding`.

  Returns:
    `[T, N]` in `y`'s dtype, sharded over the token axes (a dropped assignment adds nothing).
  """
  spec = layout.token_spec
  if isinstance(dispatched, ragged.RaggedDispatched):
    local = lambda y, w, d: ragged.local_combine(y, w, d, layout=layout)
    bookkeeping = ragged.RaggedDispatched(spec, spec, spec)
  else:
    local = lambda y, w, d: fixed.local_combine(y, w, d, layout=layout)
    bookkeeping = fixed.Dispatched(spec, spec, spec)
  fn = jax.shard_map(local, mesh=layout.mesh, in_specs=(spec, spec, bookkeeping),
                     out_specs=spec, check_vma=False)
  return fn(y, weights, dispatched)
