"""K-sharded GEMMs of the sharded dense: local products, one reduction in a chosen dtype.

A GEMM `C[M, N] = A[M, K] B[N, K]^T` whose contraction K is sharded over mesh axes (a
row-parallel forward, a column-parallel layer's input gradient, a data-parallel weight
gradient) runs as `jax.shard_map`: each device multiplies its shards (any path of
`jaxquant.ops.gemm`, rounding its partial product to `reduce_dtype`) and the partial sums meet
in one collective:

* `reduce_dtype` is the GEMM's output dtype by default, what XLA does for an unquantized bf16
  model (so a quantized model moves the same bytes as the bf16 one); `float32` keeps the partial
  sums in float32 and rounds once after the reduction (a mesh then equals one device to float32
  reduction order).
* Axes listed in `scatter_rows` / `scatter_cols` are reduce-scattered along C's rows / columns
  (`psum_scatter`): an FSDP weight gradient arrives sharded like the weight with no all-reduce
  of the full gradient; the remaining K axes are `psum`med.
* A bias is added once, after the reduction, in float32.

`jaxquant.dense` takes this path whenever its `DensePlan` knows both operands' specs and they
agree on K; otherwise the partitioned FFI call or XLA's partitioner reduces (in float32).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from jaxquant import explain as _explain
from jaxquant import ops
from jaxquant import sharding as _sharding
from jaxquant.tensors import ScaledTensor

Operand = Union[ScaledTensor, jax.Array]


def operand_specs(operand: Operand, rows: Sequence[str], k: Sequence[str]):
  """The in_specs pytree of a GEMM operand `[rows, K]`: every leaf of a `ScaledTensor` follows
  its data axis (block scales included), a per-tensor scale is replicated."""
  rows_entry, k_entry = _sharding.spec_entry(rows), _sharding.spec_entry(k)
  if not isinstance(operand, ScaledTensor):
    return P(rows_entry, k_entry)
  dims = _sharding.leaf_dims(operand.quantizer, "r", "c")
  axes = {"r": tuple(rows), "c": tuple(k)}
  leaves = [_sharding.dims_spec(d, axes) for d in dims.leaves()]
  treedef = jax.tree_util.tree_structure(operand)
  if treedef.num_leaves != len(leaves):
    raise ValueError(f"GEMM operand with {operand.quantizer}: expected {len(leaves)} arrays "
                     f"(data, scales, amax as the format stores them), got "
                     f"{treedef.num_leaves}")
  return jax.tree_util.tree_unflatten(treedef, leaves)


def result_spec(rows: Sequence[str], cols: Sequence[str], scatter_rows: Sequence[str] = (),
                scatter_cols: Sequence[str] = ()) -> P:
  """The spec of the result of `reduced_gemm` with these arguments."""
  return P(_sharding.spec_entry(tuple(rows) + tuple(scatter_rows)),
           _sharding.spec_entry(tuple(cols) + tuple(scatter_cols)))


def reduced_gemm(a: Operand, b: Operand, *, mesh: Any, rows: Sequence[str],
                 cols: Sequence[str], k: Sequence[str], out_dtype,
                 reduce_dtype: Optional[Any] = None, scatter_rows: Sequence[str] = (),
                 scatter_cols: Sequence[str] = (), bias: Optional[jax.Array] = None,
                 role: Any = None, precision: Any = None) -> jax.Array:
  """`a b^T (+ bias)` with K sharded over the mesh axes `k`; the result is `result_spec(rows,
  cols, scatter_rows, scatter_cols)`.

  Args:
    a, b: `[M, K]` and `[N, K]` operands (`ScaledTensor`s or arrays) whose rows are sharded over
      `rows` / `cols` and whose K is sharded over `k` (every leaf as `operand_specs` says).
    mesh: the mesh (or abstract mesh) the axes belong to.
    out_dtype: the result dtype.
    reduce_dtype: the dtype the partial sums are rounded to and reduced in (None: `out_dtype`).
    scatter_rows, scatter_cols: axes of `k` over which the sum is reduce-scattered along the
      result's rows / columns (appended, minor, to `rows` / `cols` in the result's spec).
    bias: optional `[N]`, sharded over `cols`; not allowed with `scatter_cols`.
    role: the GEMM's label for `jaxquant.explain`.
    precision: as `jaxquant.ops.gemm`.
  """
  k, rows, cols = tuple(k), tuple(rows), tuple(cols)
  scatter_rows, scatter_cols = tuple(scatter_rows), tuple(scatter_cols)
  if not set(scatter_rows + scatter_cols) <= set(k):
    raise ValueError(f"scatter axes {scatter_rows + scatter_cols} must shard K {k}")
  if bias is not None and scatter_cols:
    raise ValueError("bias: a column-scattered result cannot take a bias here")
  out_dtype = np.dtype(out_dtype)
  reduce_dtype = out_dtype if reduce_dtype is None else np.dtype(reduce_dtype)
  summed = tuple(a_ for a_ in k if a_ not in scatter_rows + scatter_cols)
  _explain.record(_explain.Decision(
      "reduce", role, f"partial sums over {k} in {reduce_dtype.name}",
      "+".join(p for p, axes in (("reduce-scatter", scatter_rows + scatter_cols),
                                 ("all-reduce", summed)) if axes)))

  def local(a, b, bias):
    out = ops.gemm(a, b, out_dtype=reduce_dtype, role=role, precision=precision)
    if scatter_rows:
      out = lax.psum_scatter(out, scatter_rows, scatter_dimension=0, tiled=True)
    if scatter_cols:
      out = lax.psum_scatter(out, scatter_cols, scatter_dimension=1, tiled=True)
    if summed:
      out = lax.psum(out, summed)
    if bias is not None:
      out = out.astype(jnp.float32) + bias.astype(jnp.float32)
    return out.astype(out_dtype)

  in_specs = (operand_specs(a, rows, k), operand_specs(b, cols, k),
              None if bias is None else P(_sharding.spec_entry(cols)))
  fn = jax.shard_map(local, mesh=mesh, in_specs=in_specs,
                     out_specs=result_spec(rows, cols, scatter_rows, scatter_cols),
                     check_vma=False)
  return fn(a, b, bias)
