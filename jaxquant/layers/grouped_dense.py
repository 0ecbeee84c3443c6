"""The quantized grouped (mixture-of-experts) linear layer, a `jax.custom_vjp` like `dense`.

Tokens `x[T, K]` sorted by expert, `group_sizes[G]`, kernels `W[G, K, N]`:
  forward  y[t]     = x_row[t] . W_row[g(t)]^T            (ragged rows; W_row = quantized W_g^T)
  dgrad    dx[t]    = dy_row[t] . W_col[g(t)]^T           (W_col = quantized W_g)
  wgrad    dW[g]    = x_col[:, group g] . dy_col[:, group g]^T   (contraction over g's tokens)
Every group behaves exactly as `jaxquant.dense(x_g, W[g], bias[g], quantizers,
key=fold_in(key, g), states=states[g])` on its rows `x_g`, zero-padded to the token block of its
wgrad operands (which changes nothing but lets the RHT and the block scales run over whole
blocks of one group): same quantized storages bit for bit, GEMMs within float32
accumulation-order error. Rows past `sum(group_sizes)` belong to no group: their outputs and
input gradients are zero.

Semantics the issue left open, decided here:
- per-tensor formats (FP8 current/delayed, NVFP4's second level) keep one amax per group in both
  directions, so one scale per expert for its tokens, its weight and its gradient;
- block formats never let a block straddle two groups: the rowwise copies of `x`/`dy` contract
  over K and stay packed unless their blocks are 2-D; the columnwise (wgrad) copies, whose blocks
  run along tokens, use the padded token layout of `jaxquant.grouping.layout` with one block
  shared by `x_col` and `dy_col` (the larger of the two formats' needs, 16 at least under RHT);
- the RHT's 16-row chunks therefore never mix groups, and a group of any size is accepted (its
  zero padding is transformed with it; `jaxquant.dense` itself requires rows % 16 == 0);
- delayed scaling keeps a state per expert (`jaxquant.grouped.init_state(quantizer, G)`; the
  Flax module keeps `[G]`-shaped variables); an empty group records amax 0;
- shapes are static under `jit` although `group_sizes` is traced: T, K, N, G fix every shape, and
  a padded copy has `b * floor((T + G (b - 1)) / b)` token positions;
- a kernel in its parameter dtype (float32 under bf16 compute) is quantized from that dtype and
  gets its gradient in it, Identity directions are cast to `x`'s dtype, as `jaxquant.dense`
  does (every expert exactly as its own Dense);
- every copy feeds only this layer's grouped GEMMs (`decoded=True`), so where those GEMMs
  decode MXFP8 to bfloat16 (CUDA) its copies are stored raw by their quantize kernels
  (design decision 47): the same GEMM inputs, one pass fewer, and bfloat16 residuals of x's
  and the weights' columnwise copies instead of FP8 ones (twice their bytes).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from jaxquant.backends.ffi.grouped import ops as grouped_kernels
from jaxquant.formats import format_of
from jaxquant.grouping import formats
from jaxquant.layers import grouped_plain
from jaxquant.ops import grouped as grouped_ops
from jaxquant.grouping.layout import TokenLayout, clip_sizes
from jaxquant.grouping.state import init_state as init_group_state
from jaxquant.grouping.state import update_state
from jaxquant.layers.dense import (RESIDUAL_NAMES, TENSOR_TYPES, DenseQuantizers,
                                   compute_dtype_weight)
from jaxquant.grouping.tensors import TransposedExperts
from jaxquant.tensors import QuantizedTensor

MODULE_TYPE = "grouped_linear"


@dataclasses.dataclass(frozen=True)
class _Config:
  quantizers: DenseQuantizers
  precision: Any
  x_dtype: Any
  kernel_dtype: Any
  bias_dtype: Any  # None without bias
  tokens: int
  groups: int
  x_row_block: int  # token blocks of the rowwise copies of x and dy, and of both wgrad copies
  dy_row_block: int
  wgrad_block: int

  def gemm_label(self, kind: str) -> str:
    role = self.quantizers.roles[0]
    if role is None:
      return kind
    return f"{role.module_type}/{role.path or role.name}/{kind}"


def token_blocks(quantizers: DenseQuantizers) -> tuple[int, int, int]:
  """(x rowwise, dy rowwise, wgrad) token-layout blocks the recipe's formats need."""
  x_q, dy_q = quantizers.input, quantizers.grad_output
  x_col, dy_col = x_q.for_direction("columnwise"), dy_q.for_direction("columnwise")
  wgrad = grouped_ops.wgrad_token_block(x_col, dy_col)
  return (formats.token_block(x_q.for_direction("rowwise"), "rowwise"),
          formats.token_block(dy_q.for_direction("rowwise"), "rowwise"), wgrad)


def init_states(quantizers: DenseQuantizers, groups: int) -> tuple[Any, Any, Any]:
  """Per-expert delayed-scaling states of (input, weight, grad_output)."""
  return tuple(init_group_state(quantizers.quantizer(t), groups) for t in TENSOR_TYPES)


def _keys(key, groups: int):
  """Per group, the (input, weight, grad_output) keys `jaxquant.dense` derives from the group's
  key `fold_in(key, g)`."""
  if key is None:
    return None, None, None
  group_keys = jax.vmap(lambda g: jax.random.fold_in(key, g))(jnp.arange(groups))
  return tuple(jax.vmap(lambda k, i=i: jax.random.fold_in(k, i))(group_keys) for i in range(3))


def _value(primal):
  return None if primal is None else primal.value


def _forward(config: _Config, x, kernel, bias, sizes, key, states, *, need_dgrad: bool,
             need_wgrad: bool):
  q = config.quantizers
  key_x, key_w, _ = _keys(key, config.groups)
  qx = grouped_ops.quantize(x, sizes, q.input, rowwise=True, columnwise=need_wgrad,
                            row_block=config.x_row_block, col_block=config.wgrad_block,
                            keys=key_x, state=states[0], role=q.roles[0], decoded=True)
  read_transposed = need_dgrad and grouped_kernels.experts_read_transposed(
      q.weight, x.dtype, bias is not None)
  qw, w_fprop = _quantize_weights(kernel, q, need_dgrad, read_transposed, key_w, states[1],
                                  forward_dtype=x.dtype, bias=bias is not None)
  y = grouped_ops.gemm(qx.rowwise, w_fprop, out_dtype=x.dtype, bias=bias,
                       precision=config.precision, role=config.gemm_label("fprop"))
  qw = grouped_ops.write_pending(qw, w_fprop, after=y)  # the dgrad copy over the read w_fprop
  return grouped_ops.to_tokens(y, qx.rowwise), qx, qw


def _quantize_weights(kernel, q: DenseQuantizers, need_dgrad: bool, read_transposed: bool,
                      keys, state, forward_dtype=None, bias: bool = False):
  """The experts' weights: (a `QuantizedTensor` with the forward's copy `[G, N, K]` as `rowwise`
  and dgrad's `[G, K, N]` as `columnwise`, the forward GEMM's operand).

  Where the copies are the same bytes either way (`Format.transposed_quantizer`: one format
  with no RHT and no stochastic rounding, or a Hybrid of two such halves, which quantizes the
  stored kernel with its halves exchanged) the `[G, K, N]` kernel is quantized as it is and its
  two copies swapped, so XLA never materializes the transpose (a full read and write of the
  weights each step, in float32 for float32 parameters) — unless only the transposed layout has
  a kernel (a block format whose blocks would span experts of K rows). Otherwise the
  transposed kernel is quantized. With `read_transposed` (`experts_read_transposed`: the dgrad
  copy is also the forward copy transposed and the forward GEMM reads decoded operands along N,
  16x16 NVFP4 on Hopper) only the dgrad copy is made and the forward reads it as
  `TransposedExperts` (the `rowwise` slot stays empty). Where the forward copy of the stored
  kernel is written raw in the kernel's own layout (asked for where the forward GEMM of
  `forward_dtype`, with or without a `bias`, reads it so: `forward_reads_along_n`; written so
  where `experts_along_n` holds, else `explain` says why; design decision 49) it comes as a
  `TransposedExperts` too, beside the dgrad copy, which may then be pending (a
  `PendingRowwise`, design decision 56): `_forward` writes it over the forward copy once the
  forward GEMM has read that."""
  groups, k, n = kernel.shape
  swapped = format_of(q.weight).transposed_quantizer(q.weight)
  if swapped is not None and (
      _experts_reason(swapped, (groups, k, n), need_dgrad, True) is None
      or _experts_reason(q.weight, (groups, n, k), True, need_dgrad) is not None):
    if read_transposed and _experts_reason(swapped, (groups, k, n), True, False) is None:
      kn = grouped_ops.quantize_experts(kernel, swapped, rowwise=True, columnwise=False,
                                        keys=keys, state=state, role=q.roles[1], decoded=True)
      return QuantizedTensor(None, kn.rowwise, q.weight), TransposedExperts(kn.rowwise)
    along_n = forward_dtype is not None and grouped_kernels.forward_reads_along_n(
        swapped, forward_dtype, bias)
    kn = grouped_ops.quantize_experts(kernel, swapped, rowwise=need_dgrad, columnwise=True,
                                      keys=keys, state=state, role=q.roles[1], decoded=True,
                                      columnwise_along_n=along_n, rowwise_pending=along_n)
    if isinstance(kn.columnwise, TransposedExperts):  # written in the kernel's own layout
      return QuantizedTensor(None, kn.rowwise, q.weight), kn.columnwise
    return QuantizedTensor(kn.columnwise, kn.rowwise, q.weight), kn.columnwise
  qw = grouped_ops.quantize_experts(jnp.swapaxes(kernel, 1, 2), q.weight, rowwise=True,
                                    columnwise=need_dgrad, keys=keys, state=state,
                                    role=q.roles[1], decoded=True)
  return qw, qw.rowwise


def _experts_reason(quantizer, shape, rowwise: bool, columnwise: bool):
  """Why no FFI kernel quantizes expert weights of `shape` in the asked directions (None: one
  does)."""
  for direction, on in (("rowwise", rowwise), ("columnwise", columnwise)):
    reason = on and grouped_kernels.quantize_experts_unsupported(quantizer, shape, direction)
    if reason:
      return reason
  return None


def _primal(config, x, kernel, bias, sizes, key, states):
  y, _, _ = _forward(config, x, kernel, bias, sizes, key, states, need_dgrad=False,
                     need_wgrad=False)
  return y


def _fwd(config, x, kernel, bias, sizes, key, states):
  need_dgrad, need_wgrad = x.perturbed, kernel.perturbed
  x, kernel, bias, sizes, key = (_value(x), _value(kernel), _value(bias), _value(sizes),
                                 _value(key))
  states = jax.tree_util.tree_map(_value, states)
  y, qx, qw = _forward(config, x, kernel, bias, sizes, key, states, need_dgrad=need_dgrad,
                       need_wgrad=need_wgrad)
  q = config.quantizers
  new_states = (update_state(q.input, states[0], qx), update_state(q.weight, states[1], qw),
                states[2])
  x_col = jax.tree_util.tree_map(lambda a: checkpoint_name(a, RESIDUAL_NAMES[0]), qx.columnwise)
  w_col = jax.tree_util.tree_map(lambda a: checkpoint_name(a, RESIDUAL_NAMES[1]), qw.columnwise)
  return y, (x_col, w_col, sizes, key, new_states)


def _bwd(config, residuals, dy):
  x_col, w_col, sizes, key, states = residuals
  q = config.quantizers
  _, _, key_g = _keys(key, config.groups)
  dqy = grouped_ops.quantize(dy, sizes, q.grad_output, rowwise=w_col is not None,
                             columnwise=x_col is not None, row_block=config.dy_row_block,
                             col_block=config.wgrad_block, keys=key_g, state=states[2],
                             role=q.roles[2], decoded=True)
  dx = dkernel = None
  if w_col is not None:
    dx = grouped_ops.gemm(dqy.rowwise, w_col, out_dtype=config.x_dtype,
                          precision=config.precision, role=config.gemm_label("dgrad"))
    dx = grouped_ops.to_tokens(dx, dqy.rowwise)
  if x_col is not None:
    dkernel = grouped_ops.gemm(x_col, dqy.columnwise, out_dtype=config.kernel_dtype,
                               precision=config.precision, role=config.gemm_label("wgrad"))
  dbias = None
  if config.bias_dtype is not None:
    group, _, _ = TokenLayout(config.tokens, config.groups).positions(sizes)
    # float32 sums: a bfloat16 scatter-add (atomic on GPUs, in no fixed order) loses several
    # ulps over a group's tokens.
    dbias = jax.ops.segment_sum(dy.astype(jnp.float32), group, num_segments=config.groups + 1,
                                indices_are_sorted=True)[:config.groups]
    dbias = dbias.astype(config.bias_dtype)
  new_states = (states[0], states[1], update_state(q.grad_output, states[2], dqy))
  return dx, dkernel, dbias, None, None, new_states


_grouped_dense = jax.custom_vjp(_primal, nondiff_argnums=(0,))
_grouped_dense.defvjp(_fwd, _bwd, symbolic_zeros=True)


def _plain(x, kernel, group_sizes, bias, precision):
  """No recipe: `jax.lax.ragged_dot` (and its own autodiff; on the bfloat16 CUTLASS kernel where
  it runs, `grouped_plain`), plus the per-group bias. The bias is added in float32 and rounded
  once (the same bits as a bfloat16 add), so its gradient sums each group's rows in float32, as
  the quantized path's `segment_sum` does: a bfloat16 scatter-add of thousands of rows (autodiff
  of a bfloat16 add) lost up to 3% of a sum, in an order that varied between programs."""
  y = grouped_plain.ragged_matmul(x, kernel, group_sizes, precision)
  if bias is not None:
    group, _, _ = TokenLayout(x.shape[0], kernel.shape[0]).positions(group_sizes)
    rows = jnp.concatenate([bias, jnp.zeros_like(bias[:1])]).astype(jnp.float32)[group]
    y = (y.astype(jnp.float32) + rows).astype(y.dtype)
  return y


def grouped_dense(x: jax.Array, kernel: jax.Array, group_sizes: jax.Array,
                  bias: Optional[jax.Array] = None,
                  quantizers: Optional[DenseQuantizers] = None, *,
                  key: Optional[jax.Array] = None, states: Optional[tuple] = None,
                  precision: Any = None) -> jax.Array:
  """Quantized grouped linear layer: `y[t] = x[t] @ kernel[g(t)] + bias[g(t)]`.

  Args:
    x: `[T, K]` tokens sorted by group (bfloat16/float16/float32).
    kernel: `[G, K, N]`, one matrix per group, in its parameter dtype: quantized copies are
      read from it directly (Identity directions and the no-recipe GEMMs cast it to `x`'s
      dtype), and its gradient comes in that dtype (without quantizers: the float32 sums of
      `x_g^T dy_g` rounded once to it, `jaxquant.layers.grouped_plain`).
    group_sizes: integer `[G]` tokens per group, in order (zeros allowed; >= 0, summing to at
      most T; rows past the sum belong to no group and give zeros). Traced under `jit`.
    bias: optional `[G, N]`.
    quantizers: `DenseQuantizers` for the roles `("grouped_linear", input | weight |
      grad_output, name)`; None: no quantization, `jax.lax.ragged_dot` (+ bias), whose GEMMs
      run on the bfloat16 CUTLASS grouped kernel on Hopper (`jaxquant.layers.grouped_plain`).
    key: PRNG key for stochastic rounding; group `g` uses `fold_in(key, g)` as
      `jaxquant.dense` uses its key.
    states: per-expert delayed-scaling states `init_states(quantizers, G)` (leading `[G]` axis);
      their gradient is their updated value.
    precision: `jax.lax.Precision` for high-precision (Identity) GEMMs.

  Returns:
    `[T, N]` in `x`'s dtype.
  """
  if x.ndim != 2:
    raise ValueError(f"x: expected 2-D tokens [tokens, features] sorted by group, got shape "
                     f"{tuple(x.shape)}")
  if kernel.ndim != 3 or kernel.shape[1] != x.shape[1]:
    raise ValueError(f"kernel: expected [groups, {x.shape[1]}, features] for x of shape "
                     f"{tuple(x.shape)}, got {tuple(kernel.shape)}")
  groups, _, features = kernel.shape
  sizes = grouped_ops.check_group_sizes(group_sizes, groups=groups, tokens=x.shape[0])
  if bias is not None and tuple(bias.shape) != (groups, features):
    raise ValueError(f"bias: expected shape ({groups}, {features}), got {tuple(bias.shape)}")
  sizes = clip_sizes(sizes, x.shape[0])
  if quantizers is None:
    return _plain(x, kernel, sizes, bias, precision)
  if not isinstance(quantizers, DenseQuantizers):
    raise TypeError(f"quantizers: expected DenseQuantizers or None, got "
                    f"{type(quantizers).__name__}")
  if states is None:
    if quantizers.stateful:
      raise ValueError("states: the quantizers are stateful (delayed scaling); pass "
                       f"states=jaxquant.grouped_dense_states(quantizers, {groups}) (kept by "
                       "jaxquant.flax.GroupedDense)")
    states = (None, None, None)
  quantizers = dataclasses.replace(
      quantizers, weight=compute_dtype_weight(quantizers.weight, kernel.dtype, x.dtype))
  config = _Config(quantizers, precision, x.dtype, kernel.dtype,
                   None if bias is None else bias.dtype, x.shape[0], groups,
                   *token_blocks(quantizers))
  return _grouped_dense(config, x, kernel, bias, sizes, key, tuple(states))
