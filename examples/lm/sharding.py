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
  """A mesh over the first `prod(sizes)` devices, axes in the order given."""
  unknown = [name for name in axes if name not in MESH_AXES]
  if unknown:
    raise ValueError(f"--mesh: unknown axis {unknown[0]!r}; expected some of {MESH_AXES}")
  need = math.prod(axes.values())
  devices = jax.devices()
  if need > len(devices):
    raise ValueError(f"--mesh {axes}: needs {need} devices, found {len(devices)} "
                     f"({devices[0].platform})")
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


def put_batches(mesh: Optional[Mesh], tokens: np.ndarray, leading: int = 0):
  """`tokens[..., batch, seq]` on the devices, the batch axis over the batch shards."""
  if mesh is None:
    return jax.numpy.asarray(tokens)
  spec = P(*([None] * leading), batch_axes(mesh), None)
  return jax.device_put(tokens, NamedSharding(mesh, spec))
