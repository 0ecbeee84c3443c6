"""Partitioning the FFI targets: `custom_partitioning` with Shardy sharding rules.

XLA cannot look inside an FFI custom call, so without help it would replicate (all-gather) every
sharded operand of one. Each target is therefore wrapped in `jax.experimental.custom_partitioning`
with a `Layout`: for every operand and result dimension, the logical axis it follows (`m`, `k`,
`n`, or None for a small replicated input such as a PRNG key) and the scaling block length along
it. From the layout come

* the Shardy `sharding_rule` (block-scale dimensions are compound factors of their data axis,
  `m (kq kr) -> m (kq kr), m kq` with `kr` the block), so propagation shards scales with data;
* the partitioner: each logical axis takes the mesh axes of the first operand that shards it
  (an axis already used is dropped), a shard boundary that would split a block raises the
  `ValueError` of `jaxquant.sharding` (rejected, never silently replicated), and the per-shard
  function runs the same target on local shapes, then
  - `pmax` of the designated outputs over the mesh axes of the logical axes they reduce (the
    per-tensor amax over everything, a per-row amax over the axes that shard the columns),
  - with stochastic-rounding key words moved to the shard's global origin: the draws are a hash
    of `row * C1 + k0` and `col * C2 + k1` (`jaxquant.numerics.random_bits`), so adding
    `row0 * C1` to `k0` and `col0 * C2` to `k1` gives the kernel global (row, col) indices with
    no change to the kernels.

`gemm` partitions a GEMM: local products, one `psum` over the mesh axes that shard K (float32,
before the output cast), the bias added once after it.

Every wrapper is also a `custom_vmap` (a vmapped call maps the partitioned call sequentially, as
the FFI calls' `vmap_method="sequential"` did), because `custom_partitioning` has no batching rule.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.custom_batching import custom_vmap
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxquant import sharding as _sharding
from jaxquant.backends.ffi import targets

Dims = _sharding.Dims

# random_bits' multipliers of the row and column index (ffi/jaxquant_numerics.h, sr_*).
ROW_MULTIPLIER, COL_MULTIPLIER = 0x9E3779B9, 0x85EBCA6B

AXIS_NAMES = {"m": "rows", "k": "cols", "n": "rows of b"}


@dataclasses.dataclass(frozen=True)
class Layout:
  """How a target's operands and results follow logical axes.

  Attributes:
    operands, results: per array, one `(axis, block)` per dimension (`()` for a scalar).
    reduce: `(result index, axes)`: the result is `pmax`-reduced over the mesh axes of `axes`.
    keys: `(operand index, row axis, col axis)`: uint32[2] stochastic-rounding key words moved
      to the shard's origin along those axes.
    blocks: extra `(axis, block)` constraints (e.g. the Hadamard transform's 16-long chunks).
    names: `(axis, description)` pairs used in errors.
    what: the operation, for errors.
    aliases: `(operand index, result index)`: the result is written into the operand's buffer
      (an update in place, `jax.ffi.ffi_call`'s `input_output_aliases`).
    sharded: for a target that reduces operand 0 over all of it inside the call (its per-tensor
      amax, then a scale or a state taken from it: `jaxquant_quantize_fp8_delayed_gated`,
      `_update`), what the partitioned call runs instead where operand 0 is sharded, since one
      shard's reduction would be local: `sharded(args, local_results, attrs, mesh_axes)` ->
      the results, their reductions already global (`reduce` is not applied again).
    whole: logical axes the call needs whole on every device: an operand sharded along one is
      gathered first (a GEMM's contraction under a nonlinear epilogue), not rejected.
  """

  operands: tuple[Dims, ...]
  results: tuple[Dims, ...]
  reduce: tuple[tuple[int, tuple[str, ...]], ...] = ()
  keys: tuple[tuple[int, str, str], ...] = ()
  blocks: tuple[tuple[str, int], ...] = ()
  names: tuple[tuple[str, str], ...] = (("m", "rows of x"), ("k", "cols of x"))
  what: str = ""
  aliases: tuple[tuple[int, int], ...] = ()
  sharded: Optional[Callable] = None
  whole: tuple[str, ...] = ()


def _all_dims(layout: Layout):
  for dims in layout.operands + layout.results:
    yield from dims


def _lengths(layout: Layout, operand_shapes, result_shapes) -> dict[str, int]:
  """Length of every logical axis, read off a data dimension (block 1)."""
  lengths = {}
  for dims, shape in zip(layout.operands + layout.results,
                         tuple(operand_shapes) + tuple(result_shapes)):
    for (axis, block), size in zip(dims, shape):
      if axis is not None and block == 1:
        lengths.setdefault(axis, int(size))
  return lengths


def _blocks(layout: Layout) -> dict[str, int]:
  """The lcm of every block length along each logical axis."""
  out: dict[str, int] = {}
  for axis, block in list(_all_dims(layout)) + list(layout.blocks):
    if axis is not None:
      out[axis] = math.lcm(out.get(axis, 1), block)
  return out


def sharding_rule(layout: Layout, operand_shapes, result_shapes):
  """(rule string, factor sizes, reduction factors) of a layout for these shapes."""
  lengths, blocks = _lengths(layout, operand_shapes, result_shapes), _blocks(layout)
  sizes: dict[str, int] = {}
  standalone: set[str] = set()
  unique = iter(range(1 << 30))

  def token(axis: Optional[str], block: int) -> str:
    if axis is None:
      name = f"z{next(unique)}"
      standalone.add(name)
      return name
    lcm, length = blocks.get(axis, 1), lengths[axis]
    if lcm == 1 or length % lcm or length == lcm:  # (one block: never sharded either)
      name = axis if block == 1 else f"{axis}b{block}"  # scales not tied to data: replicated
      standalone.add(name)
      return name
    quotient, inner = f"{axis}q", lcm // block
    if inner == 1:
      standalone.add(quotient)
      return quotient
    sizes[f"{axis}r{inner}"] = inner
    sizes.setdefault(quotient, length // lcm)
    return f"({quotient} {axis}r{inner})"

  def array(dims: Dims) -> str:
    return " ".join(token(axis, block) for axis, block in dims)

  operands = ", ".join(array(d) for d in layout.operands)
  results = ", ".join(array(d) for d in layout.results)
  rule = f"{operands} -> {results}"
  sizes = {name: size for name, size in sizes.items() if name not in standalone}
  factors = lambda text: text.replace("(", " ").replace(")", " ").replace(",", " ").split()
  in_results = set(factors(results))
  # Factors only the operands have are reductions (keys' factors excepted); Shardy wants them in
  # order of first appearance.
  reduction = tuple(dict.fromkeys(f for f in factors(operands)
                                  if f not in in_results and not f.startswith("z")))
  return rule, sizes, reduction


def _decode(layout: Layout, arg_shapes, mesh) -> list[P]:
  """The operands' shardings as mesh-axis specs.

  Shardy may shard a dimension over part of a mesh axis when whole blocks do not divide over
  the full axis (e.g. 256 rows in 128-blocks over a 4-device axis become 2 shards); no spec
  names that, and it would silently change the user's layout, so it is reported instead."""
  from jax._src import sharding_impls  # custom_partitioning's own decoder
  specs = []
  for index, (dims, arg) in enumerate(zip(layout.operands, arg_shapes)):
    sharding = arg.sharding
    if isinstance(sharding, NamedSharding):
      specs.append(sharding.spec)
      continue
    hlo = sharding._to_xla_hlo_sharding(len(dims))  # pylint: disable=protected-access
    try:
      specs.append(sharding_impls.parse_flatten_op_sharding(hlo, mesh)[0])
    except Exception as err:  # noqa: BLE001 - any undecodable sharding is reported the same way
      tiles = list(hlo.tile_assignment_dimensions())[:len(dims)] if hlo.is_tiled() else []
      names, blocks = dict(layout.names), _blocks(layout)
      parts = [f"the {names.get(axis, axis)} ({size}, blocks of {blocks.get(axis, 1)}) in "
               f"{count} shards" for (axis, _), size, count in zip(dims, arg.shape, tiles)
               if axis is not None and count > 1]
      raise ValueError(
          f"{layout.what}: operand {index} {tuple(arg.shape)} arrives sharded as {hlo}, which "
          f"uses part of a mesh axis ({'; '.join(parts) or 'no whole mesh axis'}): the mesh "
          f"axis that shards it does not divide the whole scaling blocks along that "
          f"dimension, so a shard boundary would split a block. Shard that axis over mesh "
          f"axes whose size divides its number of blocks, or do not shard it") from err
  return specs


def _assign(layout: Layout, specs: Sequence[P], order: Sequence[str]) -> dict[str, tuple]:
  """Mesh axes of each logical axis, from the operands' specs (first sharded data dimension
  wins, in `order`; a mesh axis is used once)."""
  found: dict[str, list] = {}
  for dims, spec in zip(layout.operands, specs):
    entries = tuple(spec) + (None,) * (len(dims) - len(tuple(spec)))
    for (axis, block), entry in zip(dims, entries):
      if axis is not None and block == 1:
        found.setdefault(axis, []).append(_sharding.axes_tuple(entry))
  assign, used = {}, set()
  for axis in order:
    choice = ()
    for candidate in found.get(axis, []):
      candidate = tuple(a for a in candidate if a not in used)
      if candidate:
        choice = candidate
        break
    if axis in layout.whole:
      choice = ()
    assign[axis] = choice
    used.update(choice)
  return assign


def _check(layout: Layout, assign, lengths, mesh) -> None:
  blocks, names = _blocks(layout), dict(layout.names)
  for axis, axes in assign.items():
    shards = _sharding.axis_size(mesh, axes)
    block = blocks.get(axis, 1)
    length = lengths.get(axis, 0)
    if shards > 1 and (length % shards or (length // shards) % block):
      raise _sharding.block_error(f"{layout.what}: the {names.get(axis, axis)}", length,
                                  _sharding.spec_entry(axes), shards, block, layout.what)


def _local_shape(dims: Dims, shape, assign, mesh) -> tuple[int, ...]:
  return tuple(int(size) // (_sharding.axis_size(mesh, assign.get(axis, ())) if axis else 1)
               for (axis, _), size in zip(dims, shape))


def shard_origin(axes: tuple, mesh, local_length: int) -> jax.Array:
  """uint32 global index of this shard's first element along an axis sharded over `axes`."""
  index = jnp.uint32(0)
  for name in axes:
    index = index * jnp.uint32(mesh.shape[name]) + lax.axis_index(name).astype(jnp.uint32)
  return index * jnp.uint32(local_length)


def offset_key(words: jax.Array, row0: jax.Array, col0: jax.Array) -> jax.Array:
  """Key words whose draws at local (r, c) equal the original's at (row0 + r, col0 + c)."""
  words = words.astype(jnp.uint32)
  return jnp.stack([words[0] + row0 * jnp.uint32(ROW_MULTIPLIER),
                    words[1] + col0 * jnp.uint32(COL_MULTIPLIER)])


def pmax_nan(x: jax.Array, axes: tuple) -> jax.Array:
  """`lax.pmax` of non-negative float32 (amax) values, NaN-propagating: the max of their bits."""
  bits = lax.bitcast_convert_type(x, jnp.uint32)
  return lax.bitcast_convert_type(lax.pmax(bits, axes), jnp.float32)


def _vmappable(fn: Callable) -> Callable:
  """`fn` with a batching rule that maps it sequentially over the batch axis."""
  wrapped = custom_vmap(fn)

  @wrapped.def_vmap
  def _rule(axis_size, in_batched, *args):
    del axis_size
    batched = [a for a, b in zip(args, in_batched) if b]

    def one(values):
      it = iter(values)
      return wrapped(*[next(it) if b else a for a, b in zip(args, in_batched)])

    outs = lax.map(one, batched)
    return outs, jax.tree.map(lambda _: True, outs)

  return wrapped


# ------------------------------------------- FFI calls ----------------------------------------

def _freeze(attrs: dict) -> tuple:
  return tuple(sorted((k, v.item() if isinstance(v, np.generic) else v, type(v).__name__)
                      for k, v in attrs.items()))


def _thaw(frozen: tuple) -> dict:
  kinds = {"bool_": np.bool_, "int32": np.int32, "int64": np.int64, "float32": np.float32}
  return {k: kinds[t](v) if t in kinds else v for k, v, t in frozen}


@functools.lru_cache(maxsize=None)
def _partitioned_call(target: str, layout: Layout, operand_shapes: tuple, results: tuple,
                      frozen_attrs: tuple) -> Callable:
  attrs = _thaw(frozen_attrs)
  result_structs = [jax.ShapeDtypeStruct(s, d) for s, d in results]
  result_shapes = [s for s, _ in results]
  order = tuple(dict.fromkeys(a for a, _ in _all_dims(layout) if a is not None))

  aliases = dict(layout.aliases)

  def single(*args):
    return tuple(targets.call(target, result_structs, *args, aliases=aliases, **attrs))

  def partition(mesh, arg_shapes, result_shape):
    del result_shape
    assign = _assign(layout, _decode(layout, arg_shapes, mesh), order)
    lengths = _lengths(layout, operand_shapes, result_shapes)
    _check(layout, assign, lengths, mesh)
    arg_shardings = tuple(NamedSharding(mesh, _sharding.dims_spec(d, assign))
                          for d in layout.operands)
    result_shardings = tuple(NamedSharding(mesh, _sharding.dims_spec(d, assign))
                             for d in layout.results)
    local = [jax.ShapeDtypeStruct(_local_shape(d, s, assign, mesh), t)
             for d, (s, t) in zip(layout.results, results)]

    def lower(*args):
      args = list(args)
      for index, row_axis, col_axis in layout.keys:
        row0 = shard_origin(assign[row_axis], mesh,
                            lengths[row_axis] // _sharding.axis_size(mesh, assign[row_axis]))
        col0 = shard_origin(assign[col_axis], mesh,
                            lengths[col_axis] // _sharding.axis_size(mesh, assign[col_axis]))
        args[index] = offset_key(args[index], row0, col0)
      x_axes = tuple(a for axis, _ in layout.operands[0] if axis for a in assign.get(axis, ()))
      if layout.sharded is not None and x_axes:
        return tuple(layout.sharded(args, local, attrs, x_axes))
      outs = targets.call(target, local, *args, aliases=aliases, **attrs)
      for index, axes in layout.reduce:
        mesh_axes = tuple(a for axis in axes for a in assign.get(axis, ()))
        if mesh_axes:
          outs[index] = pmax_nan(outs[index], mesh_axes)
      return tuple(outs)

    return mesh, lower, result_shardings, arg_shardings

  rule, sizes, reduction = sharding_rule(layout, operand_shapes, result_shapes)
  fn = custom_partitioning(single)
  fn.def_partition(partition=partition, sharding_rule=rule, decode_shardings=False, **sizes)
  return _vmappable(fn)


def call(target: str, results: Sequence[jax.ShapeDtypeStruct], *args, layout: Layout,
         **attrs) -> list:
  """`jaxquant.backends.ffi.calls.call`, partitioned by `layout` when the program is sharded."""
  if len(layout.operands) != len(args) or len(layout.results) != len(results):
    raise ValueError(f"{target}: layout describes {len(layout.operands)} operands and "
                     f"{len(layout.results)} results; got {len(args)} and {len(results)}")
  fn = _partitioned_call(target, layout, tuple(tuple(a.shape) for a in args),
                         tuple((tuple(r.shape), np.dtype(r.dtype)) for r in results),
                         _freeze(attrs))
  return list(fn(*args))


# --------------------------------------------- GEMM -------------------------------------------

def _operand_dims(operand, rows: str) -> tuple[Dims, ...]:
  """Layouts of a GEMM operand's leaves (rows along `rows`, the contraction along `k`)."""
  dims = _sharding.leaf_dims(operand.quantizer, rows, "k").leaves()
  n_leaves = len(jax.tree_util.tree_leaves(operand))
  if n_leaves != len(dims):
    raise ValueError(f"GEMM operand with {operand.quantizer}: expected {len(dims)} arrays "
                     f"(data, scales, amax as the format stores them), got {n_leaves}")
  return dims


@functools.lru_cache(maxsize=None)
def _partitioned_gemm(kernel: Callable, a_tree, b_tree, layout: Layout, operand_shapes: tuple,
                      out_shape: tuple, out_dtype: np.dtype, has_bias: bool) -> Callable:
  n_a, n_b = a_tree.num_leaves, b_tree.num_leaves

  def unflatten(leaves):
    a = jax.tree_util.tree_unflatten(a_tree, leaves[:n_a])
    b = jax.tree_util.tree_unflatten(b_tree, leaves[n_a:n_a + n_b])
    return a, b, (leaves[n_a + n_b] if has_bias else None)

  def single(*leaves):
    a, b, bias = unflatten(leaves)
    return kernel(a, b, bias, out_dtype)

  def partition(mesh, arg_shapes, result_shape):
    del result_shape
    assign = _assign(layout, _decode(layout, arg_shapes, mesh), ("m", "k", "n"))
    _check(layout, assign, _lengths(layout, operand_shapes, (out_shape,)), mesh)
    arg_shardings = tuple(NamedSharding(mesh, _sharding.dims_spec(d, assign))
                          for d in layout.operands)
    out_sharding = NamedSharding(mesh, P(_sharding.spec_entry(assign["m"]),
                                         _sharding.spec_entry(assign["n"])))
    k_axes = assign["k"]

    def lower(*leaves):
      a, b, bias = unflatten(leaves)
      if not k_axes:
        return kernel(a, b, bias, out_dtype)
      out = lax.psum(kernel(a, b, None, np.dtype(jnp.float32)), k_axes)
      if bias is not None:
        out = out + bias.astype(jnp.float32)
      return out.astype(out_dtype)

    return mesh, lower, out_sharding, arg_shardings

  rule, sizes, reduction = sharding_rule(layout, operand_shapes, (out_shape,))
  fn = custom_partitioning(single)
  fn.def_partition(partition=partition, sharding_rule=rule, decode_shardings=False, **sizes)
  return _vmappable(fn)


def gemm(kernel: Callable, a, b, bias: Optional[jax.Array], out_dtype) -> jax.Array:
  """`kernel(a, b, bias, out_dtype)` (a TN GEMM of two `ScaledTensor`s on local shards),
  partitioned: rows of `a` and of `b` stay local, a sharded K is reduced by one float32 `psum`
  before the output cast, and the bias is added once, after it.

  Args:
    kernel: the single-device GEMM; must accept `bias=None` and a float32 `out_dtype`.
    a, b: `ScaledTensor`s `[M, K]` and `[N, K]`.
    bias: optional `[N]`.
    out_dtype: the output dtype.
  """
  a_leaves, a_tree = jax.tree_util.tree_flatten(a)
  b_leaves, b_tree = jax.tree_util.tree_flatten(b)
  operands = _operand_dims(a, "m") + _operand_dims(b, "n")
  leaves = a_leaves + b_leaves
  if bias is not None:
    operands += ((("n", 1),),)
    leaves.append(bias)
  layout = Layout(operands, ((("m", 1), ("n", 1)),),
                  names=(("m", "rows of a"), ("n", "rows of b"), ("k", "contraction axis")),
                  what=f"GEMM {type(a.quantizer).__name__} x {type(b.quantizer).__name__}")
  out_shape = (a.shape[0], b.shape[0])
  fn = _partitioned_gemm(kernel, a_tree, b_tree, layout, tuple(tuple(x.shape) for x in leaves),
                         out_shape, np.dtype(out_dtype), bias is not None)
  return fn(*leaves)
