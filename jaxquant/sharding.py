"""Sharding of quantized storages and of the quantized Dense (docs/design.md §7 "Partitioning
and sharding").

Storage specs: from the `PartitionSpec` of `x[rows, cols]` to the spec of every leaf of its
`QuantizedTensor`. Rowwise leaves follow `(rows, cols)`; the transposed columnwise copy follows
`(cols, rows)`; a Hybrid's halves each follow their own format; block-scale axes follow their
data axis; per-tensor scales and amax are replicated; a row-scaled amax follows its rows.

Blocks and shards: a shard boundary that would split a scaling block (or an RHT chunk: the format's
`copy_block`) is **rejected** with a `ValueError` naming the axis, the mesh axes and the block
(`check_blocks_fit`; the FFI ops' partitioners raise the same error at compile time). The one
exception is an FSDP weight: when its local shard would split blocks, the weight is gathered in high
precision and quantized whole (`plan_dense`; `jaxquant.explain` says so). Nothing is replicated
silently.

`DenseSharding` tells `jaxquant.dense` the specs of `x` and of the kernel; `plan_dense` derives
every spec the dense needs, and which kernel axes are FSDP axes (mesh axes that shard both the
kernel and the rows of `x`): the kernel is quantized shard by shard and its quantized bytes are
all-gathered over those axes where the format allows it exactly, else it is gathered in high
precision first.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxquant.formats import format_of
from jaxquant.quantizers import Quantizer
from jaxquant.tensors import QuantizedTensor, ScaledTensor

MeshAxes = Any  # None, a mesh axis name, or a tuple of names
Dim = tuple[Optional[str], int]  # (logical axis or None = replicated, block length along it)
Dims = tuple[Dim, ...]


# ------------------------------------------ mesh axes -----------------------------------------

def axes_tuple(entry: MeshAxes) -> tuple[str, ...]:
  """A `PartitionSpec` entry as a tuple of mesh axis names (`()` when unsharded)."""
  if entry is None:
    return ()
  return tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)


def spec_entry(axes: Sequence[str]) -> MeshAxes:
  """The inverse of `axes_tuple`: None, a name, or a tuple of names."""
  axes = tuple(axes)
  return None if not axes else axes[0] if len(axes) == 1 else axes


def axis_size(mesh: Mesh, axes: MeshAxes) -> int:
  return math.prod(mesh.shape[name] for name in axes_tuple(axes))


def current_mesh():
  """The mesh of `jax.set_mesh(...)` (an `AbstractMesh`, usable inside `jit`) or of the legacy
  `with mesh:`; None outside one."""
  from jax._src import mesh as mesh_lib  # the legacy context has no public accessor
  legacy = mesh_lib.thread_resources.env.physical_mesh
  if not legacy.empty:
    return legacy
  mesh = jax.sharding.get_abstract_mesh()
  return mesh if mesh.axis_names else None


# ---------------------------------------- storage layout --------------------------------------

@dataclasses.dataclass(frozen=True)
class LeafDims:
  """For each leaf of a `ScaledTensor`, the logical axis and block length of each dimension
  (None for a leaf the format does not have)."""

  data: Dims
  scale_inv: Optional[Dims]
  amax: Optional[Dims]

  def leaves(self) -> tuple[Dims, ...]:
    return tuple(d for d in (self.data, self.scale_inv, self.amax) if d is not None)


def block_shape(quantizer: Quantizer) -> tuple[int, int]:
  """(rows, cols) of one scaling block of a single-format quantizer (1, 1 when per tensor)."""
  return format_of(quantizer).block_shape(quantizer)


_LAYOUT_DIMS = {  # a leaf layout of the format (`Format.scale_layout` / `amax_layout`) -> dims
    "none": lambda rows, cols, blocks: None,
    "tensor": lambda rows, cols, blocks: (),
    "block": lambda rows, cols, blocks: ((rows, blocks[0]), (cols, blocks[1])),
    "row": lambda rows, cols, blocks: ((rows, 1),),
}


def leaf_dims(quantizer: Quantizer, rows: Optional[str], cols: Optional[str]) -> LeafDims:
  """Layout of a single-format storage `[rows, cols]` whose axes follow logical `rows`/`cols`:
  what the format says its scales and amax hold."""
  fmt = format_of(quantizer)
  blocks = fmt.block_shape(quantizer)
  scale = _LAYOUT_DIMS[fmt.scale_layout(quantizer)](rows, cols, blocks)
  amax = _LAYOUT_DIMS[fmt.amax_layout(quantizer)](rows, cols, blocks)
  return LeafDims(((rows, 1), (cols, 1)), scale, amax)


def dims_spec(dims: Dims, axes: dict) -> P:
  """The `PartitionSpec` of a leaf laid out as `dims`, given mesh axes per logical axis."""
  return P(*(spec_entry(axes.get(name, ())) if name is not None else None
             for name, _ in dims))


# -------------------------------------------- specs -------------------------------------------

def _matrix_spec(spec: Optional[P]) -> tuple[MeshAxes, MeshAxes]:
  """(rows axes, cols axes) of a spec of a `[..., cols]` array flattened to `[rows, cols]`."""
  if spec is None:
    return None, None
  entries = tuple(spec)
  if not entries:
    return None, None
  if len(entries) == 1:
    return None, entries[0]
  names = [n for e in entries[:-1] for n in axes_tuple(e)]
  return spec_entry(names), entries[-1]


def matrix_spec(spec: Optional[P]) -> P:
  """The spec of `x.reshape(-1, x.shape[-1])` for an `x` sharded as `spec`."""
  return P(*_matrix_spec(spec))


def scaled_specs(quantizer: Quantizer, rows: MeshAxes, cols: MeshAxes) -> ScaledTensor:
  """A `ScaledTensor` whose leaves are the specs of a single-format `[rows, cols]` storage."""
  dims = leaf_dims(quantizer, "r", "c")
  axes = {"r": axes_tuple(rows), "c": axes_tuple(cols)}
  spec = lambda d: None if d is None else dims_spec(d, axes)
  return ScaledTensor(spec(dims.data), spec(dims.scale_inv), spec(dims.amax), quantizer)


def storage_specs(quantizer: Quantizer, x_spec: Optional[P], *, rowwise: bool = True,
                  columnwise: bool = True) -> QuantizedTensor:
  """A `QuantizedTensor` whose leaves are the `PartitionSpec`s of `quantize(x, quantizer)`.

  Args:
    quantizer: any quantizer (a Hybrid's halves each follow their own format).
    x_spec: spec of `x` (`[..., cols]`; leading axes are flattened into rows).
    rowwise, columnwise: the directions that will be produced.
  """
  rows, cols = _matrix_spec(x_spec)
  row_q, col_q = quantizer.for_direction("rowwise"), quantizer.for_direction("columnwise")
  return QuantizedTensor(scaled_specs(row_q, rows, cols) if rowwise else None,
                         scaled_specs(col_q, cols, rows) if columnwise else None, quantizer)


def _axis_size(mesh: Mesh, axes: MeshAxes) -> int:
  return axis_size(mesh, axes)


def block_error(what: str, length: int, axes: MeshAxes, shards: int, block: int,
                owner: str) -> ValueError:
  return ValueError(
      f"{what} ({length}) sharded over mesh axes {axes!r} ({shards} shards) would split the "
      f"{block}-long scaling blocks of {owner}: a shard boundary may not cut a block. Use a "
      f"length that is a multiple of {shards} x {block}, or do not shard this axis over "
      f"{axes!r}")


def check_blocks_fit(quantizer: Quantizer, shape: Sequence[int], x_spec: Optional[P],
                     mesh: Mesh, *, name: str = "x",
                     directions: Sequence[str] = ("rowwise", "columnwise"),
                     axis_names: tuple[str, str] = ("rows", "cols")) -> None:
  """Raise `ValueError` if a shard boundary would split a scaling block of a direction.

  Args:
    quantizer: the quantizer (a Hybrid's halves are checked for their own direction).
    shape: shape of `x` (`[..., cols]`).
    x_spec: its spec.
    mesh: the mesh the spec refers to.
    name: how the error names the tensor.
    directions: the directions that will be produced.
    axis_names: how the error names the rows and the cols of `x`.
  """
  rows = math.prod(shape[:-1]) if len(shape) > 1 else 1
  cols = shape[-1]
  row_axes, col_axes = _matrix_spec(x_spec)
  for direction in directions:
    q = quantizer.for_direction(direction)
    if direction == "rowwise":
      r, c, r_axes, c_axes = rows, cols, row_axes, col_axes
      r_what, c_what = axis_names
    else:
      r, c, r_axes, c_axes = cols, rows, col_axes, row_axes
      c_what, r_what = axis_names
    block_rows, block_cols = format_of(q).copy_block(q, direction)
    for length, axes, block, what in ((r, r_axes, block_rows, r_what),
                                      (c, c_axes, block_cols, c_what)):
      shards = axis_size(mesh, axes)
      if shards > 1 and (length % shards or (length // shards) % block):
        raise block_error(f"{name}: the {what} of {name}", length, axes, shards, block,
                          f"its {direction} copy ({q})")


def _constrain_leaf(value, spec, mesh):
  if value is None or spec is None:
    return value
  return jax.lax.with_sharding_constraint(value, named(spec, mesh))


def named(spec: P, mesh: Optional[Mesh]):
  """`NamedSharding(mesh, spec)`, or the bare spec (resolved by the context mesh)."""
  return spec if mesh is None else NamedSharding(mesh, spec)


def constrain(qtensor: QuantizedTensor, specs: QuantizedTensor,
              mesh: Optional[Mesh] = None) -> QuantizedTensor:
  """Apply `storage_specs` to a `QuantizedTensor` (inside `jit`, under a mesh)."""

  def scaled(t: Optional[ScaledTensor], spec: Optional[ScaledTensor]):
    if t is None or spec is None:
      return t
    return dataclasses.replace(
        t, **{f: _constrain_leaf(getattr(t, f), getattr(spec, f), mesh)
              for f in ("data", "scale_inv", "amax")})

  return dataclasses.replace(qtensor, rowwise=scaled(qtensor.rowwise, specs.rowwise),
                             columnwise=scaled(qtensor.columnwise, specs.columnwise))


def _byte_view(value: jax.Array):
  """(uint8 view of a sub-byte or one-byte float array, inverse) or (value, None).

  Collectives move these arrays as bytes: XLA:CPU widens float8 collectives to float16 (twice
  the bytes) and float4 has no collective type at all. Float4 codes are packed two a byte along
  the last axis (which must be even)."""
  import jax.numpy as jnp
  import numpy as np
  dtype = np.dtype(value.dtype)
  if dtype == np.dtype(jnp.float4_e2m1fn):
    if value.ndim == 0 or value.shape[-1] % 2:
      return value, None
    packed = jax.lax.bitcast_convert_type(
        value.reshape(*value.shape[:-1], value.shape[-1] // 2, 2), jnp.uint8)
    return packed, lambda u: jax.lax.bitcast_convert_type(u, dtype).reshape(value.shape)
  if dtype.itemsize == 1 and dtype.kind == "V":  # float8 variants (ml_dtypes) incl. e8m0
    return (jax.lax.bitcast_convert_type(value, jnp.uint8),
            lambda u: jax.lax.bitcast_convert_type(u, dtype))
  return value, None


def gather_storage(qtensor: QuantizedTensor, specs: QuantizedTensor,
                   mesh: Optional[Mesh] = None) -> QuantizedTensor:
  """`constrain`, moving low-precision leaves as bytes (an FP8 all-gather moves 1 byte per
  element, an FP4 one half a byte)."""

  def leaf(value, spec):
    if value is None or spec is None:
      return value
    view, restore = _byte_view(value)
    if restore is None:
      return jax.lax.with_sharding_constraint(value, named(spec, mesh))
    # The barriers keep XLA from folding the byte view away around the collective.
    view = jax.lax.optimization_barrier(view)
    view = jax.lax.with_sharding_constraint(view, named(spec, mesh))
    return restore(jax.lax.optimization_barrier(view))

  def scaled(t: Optional[ScaledTensor], spec: Optional[ScaledTensor]):
    if t is None or spec is None:
      return t
    return dataclasses.replace(t, **{f: leaf(getattr(t, f), getattr(spec, f))
                                     for f in ("data", "scale_inv", "amax")})

  return dataclasses.replace(qtensor, rowwise=scaled(qtensor.rowwise, specs.rowwise),
                             columnwise=scaled(qtensor.columnwise, specs.columnwise))


# ------------------------------------------ the Dense -----------------------------------------

@dataclasses.dataclass(frozen=True)
class DenseSharding:
  """How the operands of `jaxquant.dense` are sharded (mesh-axis `PartitionSpec`s).

  Attributes:
    x: spec of `x[..., K1..Kc]` (None: unknown; XLA propagation decides).
    kernel: spec of `kernel[K1..Kc, N1..Nn]` (None: unknown).
    mesh: the mesh the specs refer to (None: the context mesh of `jax.set_mesh`).
    reduce_dtype: the dtype in which the partial sums of a K-sharded GEMM (row-parallel
      output, column-parallel input gradient, data-parallel weight gradient) are reduced.
      None (default): the GEMM's output dtype, as XLA reduces an unquantized model's, so a
      quantized bf16 model moves the same bytes as the bf16 one. `jnp.float32`: partial sums
      stay float32 until one rounding after the reduction (a mesh equals one device to float32
      reduction order; twice the bytes for a bf16 model).
  """

  x: Optional[P] = None
  kernel: Optional[P] = None
  mesh: Optional[Mesh] = None
  reduce_dtype: Optional[Any] = None

  def __post_init__(self):
    for field in ("x", "kernel"):
      value = getattr(self, field)
      if value is not None and not isinstance(value, P):
        raise TypeError(f"DenseSharding.{field}: expected a PartitionSpec or None, got "
                        f"{value!r}")
    if self.reduce_dtype is not None:
      dtype = check_reduce_dtype(self.reduce_dtype, "DenseSharding.reduce_dtype")
      object.__setattr__(self, "reduce_dtype", dtype)


REDUCE_DTYPES = ("bfloat16", "float16", "float32")


def check_reduce_dtype(value: Any, owner: str):
  """`value` as a numpy dtype, if it is one a reduction can use; else a ValueError naming
  `owner`."""
  try:
    dtype = np.dtype(value)
  except TypeError:
    dtype = None
  if dtype is None or dtype.name not in REDUCE_DTYPES:
    raise ValueError(f"{owner}={value!r}: expected None (the GEMM's output dtype) or one of "
                     f"{REDUCE_DTYPES}")
  return dtype


@dataclasses.dataclass(frozen=True)
class DensePlan:
  """Every spec `jaxquant.dense` constrains, in mesh axes (static, hashable).

  `x2d`/`y2d`: the GEMM rows of x and y; `weight`: `W^T[N, K]` as stored (FSDP-sharded);
  `weight_gathered`: what the GEMMs read (FSDP axes removed); `kernel2d`: `[K, N]` (the
  gradient's spec); `weight_gather`: "none" (no FSDP axis), "quantized" (the quantized bytes
  are all-gathered) or "high-precision" (the weight is gathered before quantizing). A spec is
  None where the `DenseSharding` left it unknown: that value is not constrained (a guess could
  gather a sharded activation).
  """

  mesh: Optional[Mesh]
  x2d: Optional[P]
  y2d: Optional[P]
  kernel2d: Optional[P]
  weight: Optional[P]
  weight_gathered: Optional[P]
  fsdp_axes: tuple[str, ...]
  weight_gather: str
  reason: str = ""
  rows_note: str = ""
  reduce_dtype: Any = None  # DenseSharding.reduce_dtype
  # Mesh axes of size > 1 of the GEMM dimensions (empty where the sharding left them unknown):
  # x's rows and K, the kernel's K and N (FSDP axes included).
  row_axes: tuple[str, ...] = ()
  x_k_axes: tuple[str, ...] = ()
  k_axes: tuple[str, ...] = ()
  n_axes: tuple[str, ...] = ()

  @property
  def known(self) -> bool:
    """Both specs were given: every GEMM's operand specs are known."""
    return self.x2d is not None and self.kernel2d is not None

  def gathered(self, axes: tuple[str, ...]) -> tuple[str, ...]:
    """`axes` without the FSDP axes (what the GEMMs read after the weight gather)."""
    return tuple(a for a in axes if a not in self.fsdp_axes)


def _rows_note(x_shape: Sequence[int], x_spec: P, n_contract: int, mesh: Mesh) -> str:
  """Why flattening x's leading axes into rows cannot keep every shard local ("" if it can).

  A flattened axis is block-sharded only if every leading axis before a sharded one holds one
  element per shard (Shardy's rule for merged dimensions)."""
  entries = tuple(x_spec) + (None,) * (len(x_shape) - len(tuple(x_spec)))
  lead = list(zip(x_shape[:len(x_shape) - n_contract], entries[:len(x_shape) - n_contract]))
  for i, (_, entry) in enumerate(lead):
    if axis_size(mesh, entry) > 1:
      for j, (length, before) in enumerate(lead[:i]):
        local = length // axis_size(mesh, before)
        if local > 1:
          return (f"x axis {i} is sharded over {entry!r} but axis {j} before it holds {local} "
                  "elements per shard, so the flattened GEMM rows are not block-sharded; XLA "
                  "reshards x before quantizing (put the sharded axis first, or shard axis "
                  f"{j} down to one element per shard)")
  return ""


_KERNEL_AXES = ("output features (N)", "input features (K)")  # of W^T[N, K]


def plan_dense(sharding: DenseSharding, x_shape: Sequence[int], kernel_shape: Sequence[int],
               n_contract: int, weight_quantizer: Quantizer,
               weight_directions: Sequence[str]) -> Optional[DensePlan]:
  """The specs of a sharded `jaxquant.dense` (None when nothing is known about the sharding).

  FSDP axes are the mesh axes that shard the kernel and also the rows of `x`. The kernel is
  quantized as sharded and its quantized storage gathered over them ("quantized"), unless a
  local shard would split a scaling block of `weight_quantizer` ("high-precision": the weight
  is gathered first, then quantized whole).
  """
  mesh = sharding.mesh or current_mesh()
  if sharding.x is None and sharding.kernel is None:
    return None
  if mesh is None:
    raise ValueError("DenseSharding: specs were given but no mesh; pass DenseSharding(mesh=...) "
                     "or trace under `with jax.set_mesh(mesh):`")
  n_out = len(kernel_shape) - n_contract
  x_spec = sharding.x if sharding.x is not None else P()
  k_spec = sharding.kernel if sharding.kernel is not None else P()
  k_entries = tuple(k_spec) + (None,) * (len(kernel_shape) - len(tuple(k_spec)))
  k_axes = tuple(n for e in k_entries[:n_contract] for n in axes_tuple(e))
  n_axes = tuple(n for e in k_entries[n_contract:] for n in axes_tuple(e))
  x_entries = tuple(x_spec) + (None,) * (len(x_shape) - len(tuple(x_spec)))
  row_axes = tuple(n for e in x_entries[:len(x_shape) - n_contract] for n in axes_tuple(e))
  x_k_axes = tuple(n for e in x_entries[len(x_shape) - n_contract:] for n in axes_tuple(e))
  shared = tuple(a for a in k_axes + n_axes if a in row_axes)
  # Axes of size 1 shard nothing: no gather, no reduction over them.
  fsdp = tuple(a for a in shared if mesh.shape[a] > 1)
  keep = lambda axes: spec_entry(tuple(a for a in axes if a not in shared))
  weight = P(spec_entry(n_axes), spec_entry(k_axes))
  weight_gathered = P(keep(n_axes), keep(k_axes))
  gather, reason = "none", ""
  wt_shape = (math.prod(kernel_shape[n_contract:]), math.prod(kernel_shape[:n_contract]))
  if fsdp:
    if format_of(weight_quantizer).high_precision:
      gather, reason = "high-precision", "the weight is not quantized (Identity)"
    else:
      try:
        check_blocks_fit(weight_quantizer, wt_shape, weight, mesh, name="kernel",
                         directions=weight_directions, axis_names=_KERNEL_AXES)
        gather = "quantized"
      except ValueError as err:
        gather, reason = "high-precision", str(err)
  check_blocks_fit(weight_quantizer, wt_shape, weight_gathered if gather != "quantized"
                   else weight, mesh, name="kernel", directions=weight_directions,
                   axis_names=_KERNEL_AXES)
  del n_out
  x_known, k_known = sharding.x is not None, sharding.kernel is not None
  return DensePlan(
      mesh=mesh,
      x2d=P(spec_entry(row_axes), spec_entry(x_k_axes)) if x_known else None,
      y2d=P(spec_entry(row_axes), keep(n_axes)) if x_known and k_known else None,
      kernel2d=P(spec_entry(k_axes), spec_entry(n_axes)) if k_known else None,
      weight=weight if k_known else None,
      weight_gathered=weight_gathered if k_known else None, fsdp_axes=fsdp,
      weight_gather=gather, reason=reason,
      rows_note=_rows_note(x_shape, x_spec, n_contract, mesh) if x_known else "",
      reduce_dtype=sharding.reduce_dtype, row_axes=_sharded(row_axes, mesh),
      x_k_axes=_sharded(x_k_axes, mesh), k_axes=_sharded(k_axes, mesh),
      n_axes=_sharded(n_axes, mesh))


def _sharded(axes: tuple[str, ...], mesh) -> tuple[str, ...]:
  """`axes` without those of size 1."""
  return tuple(a for a in axes if mesh.shape[a] > 1)
