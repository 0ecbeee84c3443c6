"""`--mesh`: the device mesh, Flax logical-axis rules, and the shardings of the state and batches.

Mesh axes: `dp` (data parallel: the batch), `fsdp` (the batch, and the parameters' `embed` axis,
gathered before use), `tp` (tensor parallel: attention heads and the MLP's hidden axis, i.e.
column-parallel `qkv`/`fc1` and row-parallel `proj`/`fc2`), `ep` (expert parallel, with
`--moe`: the experts, and the batch as `dp` shards it; tokens reach their experts through
all-to-alls, `lm.moe`). Parameters carry logical names
(`lm.model`), activations entering a Dense are named `act_*`; the rules below map both to
whichever of the three mesh axes exist.
"""

from __future__ import annotations

import contextlib
import math
from typing import Iterator, Optional

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

MESH_AXES = ("dp", "fsdp", "tp", "ep")


def make_mesh(axes: dict[str, int]) -> Mesh:
  """A mesh over the first `prod(sizes)` devices, axes in the order given.

  With several processes the mesh must hold every process's devices, process 0's first, so the
  last axes are the ones within a process: `dp=2,tp=4` on two hosts of four
  GPUs keeps tensor parallelism inside each host and data parallelism across them.
  """
  unknown = [name for name in axes if name not in MESH_AXES]
  if unknown:
    raise ValueError(f"--mesh: unknown axis {unknown[0]!r}; expected some of {MESH_AXES}")
  need = math.prod(axes.values())
  devices = jax.devices()
  if jax.process_count() > 1:  # process 0's devices first, then process 1's, ...
    devices = sorted(devices, key=lambda d: (d.process_index, d.id))
  where = (f"{len(devices)} {devices[0].platform} devices over {jax.process_count()} "
           f"processes" if jax.process_count() > 1 else
           f"{len(devices)} ({devices[0].platform})")
  if need > len(devices):
    raise ValueError(f"--mesh {axes}: needs {need} devices, found {where}")
  if jax.process_count() > 1 and need != len(devices):
    raise ValueError(f"--mesh {axes}: holds {need} devices, but a run of several processes "
                     f"trains on all of them: found {where}; give axes whose sizes multiply "
                     f"to {len(devices)}")
  return Mesh(np.array(devices[:need]).reshape(tuple(axes.values())), tuple(axes))


def logical_rules(mesh: Mesh) -> tuple[tuple[str, object], ...]:
  """Logical axis -> mesh axes, for the axes this mesh has."""
  has = lambda name: name in mesh.axis_names and mesh.shape[name] > 1
  batch = tuple(a for a in ("dp", "fsdp", "ep") if has(a))
  tp = "tp" if has("tp") else None
  fsdp = "fsdp" if has("fsdp") else None
  ep = "ep" if has("ep") else None
  return (("act_batch", batch or None), ("act_len", None), ("act_embed", None),
          ("act_heads", tp), ("act_mlp", tp),
          ("embed", fsdp), ("heads", tp), ("mlp", tp), ("vocab", None), ("layers", None),
          ("expert", ep))


def batch_axes(mesh: Mesh):
  return dict(logical_rules(mesh))["act_batch"]


def check_batch(mesh: Mesh, batch: int) -> None:
  axes = batch_axes(mesh) or ()
  shards = math.prod(mesh.shape[a] for a in axes)
  if batch % shards:
    raise ValueError(f"--batch {batch} must be a multiple of the {shards} batch shards "
                     f"({' x '.join(axes)})")


@contextlib.contextmanager
def active(mesh: Optional[Mesh]) -> Iterator[None]:
  """The mesh and its logical rules, around tracing (no-op without a mesh)."""
  if mesh is None:
    yield
    return
  with jax.set_mesh(mesh), nn.logical_axis_rules(logical_rules(mesh)):
    yield


def state_shardings(abstract_state, mesh: Mesh):
  """NamedShardings of a (boxed) abstract state: logical names through the rules, P() else."""
  specs = nn.get_partition_spec(abstract_state)
  return nn.logical_to_mesh_sharding(specs, mesh, logical_rules(mesh))


def process_rows(mesh: Optional[Mesh], batch: int) -> Optional[np.ndarray]:
  """The rows of a global `[batch, ...]` batch that this process's devices hold (sorted), or
  None for all of them (no mesh, or one process): what this process loads of every batch."""
  if mesh is None or jax.process_count() == 1:
    return None
  shards = NamedSharding(mesh, P(batch_axes(mesh))).addressable_devices_indices_map((batch,))
  rows = set()
  for index in shards.values():
    rows.update(range(*index[0].indices(batch)))
  return np.array(sorted(rows), np.int64)


def put_batches(mesh: Optional[Mesh], tokens: np.ndarray, leading: int = 0):
  """`tokens[..., batch, seq]` on the devices, the batch axis over the batch shards.

  With several processes `tokens` holds this process's rows only (`process_rows`) and the
  global batch is assembled from every process's rows.
  """
  if mesh is None:
    return jax.numpy.asarray(tokens)
  sharding = NamedSharding(mesh, P(*([None] * leading), batch_axes(mesh), None))
  if jax.process_count() > 1:
    return jax.make_array_from_process_local_data(sharding, tokens)
  return jax.device_put(tokens, sharding)
