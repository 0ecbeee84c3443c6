"""The quantized dense contraction: a `jax.custom_vjp` over the TN storage convention.

For `x[M, K]` and a Flax kernel `W[K, N]` (docs/design.md §3 "Storage convention"):
  forward  y[M, N]  = x_row[M, K]  . W_row[N, K]^T     (W_row = quantized W^T)
  dgrad    dx[M, K] = dy_row[M, N] . W_col[K, N]^T     (W_col = quantized W)
  wgrad    dW[K, N] = x_col[K, M]  . dy_col[N, M]^T    (x_col = quantized x^T)
x and W are quantized before the custom_vjp (`jaxquant.layers.operands`): their copies carry
`checkpoint_name`s, so `remat_policy()` keeps the quantized weights and a rematerialized
forward does not quantize them again; a weight quantized once by `prepare_weight` can serve
every micro-batch of a gradient-accumulation step; and contractions of one input share its
quantization inside `shared_inputs.share_input_quantization()`. The forward saves only the
quantized columnwise operands, and only those a backward GEMM will use: no dgrad operand when x
needs no gradient, no wgrad operand when W needs none (nor are those copies made). Delayed-
scaling states are differentiable inputs whose "gradient" is their updated value (Flax's
`_overwrite_with_gradient` convention).

Sharding (`sharding=DenseSharding(x=..., kernel=...)`, see `jaxquant.sharding`): x, y, dy, dx, dW
and every storage are constrained to the specs `plan_dense` derives, so the partitioned ops stay
local. Where both specs are known, a K-sharded GEMM (row-parallel forward, column-parallel dgrad,
data-parallel wgrad) is `jaxquant.layers.collective_gemm.reduced_gemm`: local products reduced once
in `DenseSharding.reduce_dtype` (default: the GEMM's output dtype), an FSDP weight gradient
reduce-scattered over the FSDP axes; otherwise the partitioned op's float32 psum. An FSDP kernel is
quantized shard by shard and its quantized storage all-gathered over the FSDP axes (the residual
keeps the local shard and the backward gathers it again), or gathered in high precision first where
a shard would split a block; `jaxquant.explain` reports which.

Parameter dtype (float32 parameters, bfloat16 compute: Flax's default): the kernel may arrive in
its parameter dtype rather than `x`'s. A weight copy the recipe quantizes is quantized from that
dtype directly (the quantize kernels read float32; no separate convert pass over the weights,
as TransformerEngine treats fp32 master weights), and the weight gradient is produced in it by
the wgrad GEMM (float32 output). A direction an `IdentityQuantizer()` keeps in high precision is
cast to `x`'s dtype (the compute dtype), as is the kernel of an unquantized contraction, so
those GEMMs are the ones of a promoted kernel.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_derivatives import CustomVJPPrimal

from jaxquant.layers import collective_gemm, operands, shared_inputs
from jaxquant.layers.shard_major import shard_major
from jaxquant.layers.split_output import SplitOutput
from jaxquant import explain as _explain
from jaxquant import ops
from jaxquant import sharding as _sharding
from jaxquant.formats import format_of
from jaxquant.quantizers import IdentityQuantizer, Quantizer
from jaxquant.recipes import Recipe
from jaxquant.roles import QuantizerRole
from jaxquant.state import init_state
from jaxquant.tensors import QuantizedTensor

# The checkpoint names of the copies the backward reads (x^T for wgrad, W for dgrad).
RESIDUAL_NAMES = (operands.INPUT_NAMES[1], operands.WEIGHT_NAMES[1])
TENSOR_TYPES = ("input", "weight", "grad_output")


@dataclasses.dataclass(frozen=True)
class DenseQuantizers:
  """The three quantizers of one dense contraction, and the roles they were chosen for."""

  input: Quantizer
  weight: Quantizer
  grad_output: Quantizer
  roles: tuple[Optional[QuantizerRole], ...] = (None, None, None)

  def __post_init__(self):
    for tensor_type in TENSOR_TYPES:
      value = getattr(self, tensor_type)
      if not isinstance(value, Quantizer):
        raise TypeError(f"DenseQuantizers.{tensor_type}: expected a jaxquant Quantizer, got "
                        f"{type(value).__name__}")

  @classmethod
  def from_recipe(cls, recipe: Recipe, module_type: str, name: str,
                  path: str = "") -> "DenseQuantizers":
    """Ask `recipe` for the quantizer of each role `(module_type, tensor_type, name)`."""
    roles = tuple(QuantizerRole(module_type, t, name, path) for t in TENSOR_TYPES)
    return cls(*(recipe.quantizer(role) for role in roles), roles=roles)

  @classmethod
  def identity(cls) -> "DenseQuantizers":
    return cls(IdentityQuantizer(), IdentityQuantizer(), IdentityQuantizer())

  def quantizer(self, tensor_type: str) -> Quantizer:
    return getattr(self, tensor_type)

  def init_states(self) -> tuple[Any, Any, Any]:
    """Initial delayed-scaling states (None for stateless quantizers)."""
    return tuple(init_state(self.quantizer(t)) for t in TENSOR_TYPES)

  @property
  def stateful(self) -> bool:
    return any(self.quantizer(t).stateful for t in TENSOR_TYPES)

  @property
  def unquantized(self) -> bool:
    """Every tensor passes through unchanged: three `IdentityQuantizer()`s without a cast."""
    return all(format_of(q).high_precision and q.dtype is None
               for q in (self.input, self.weight, self.grad_output))


def runs_unquantized(quantizers: Optional[DenseQuantizers],
                     sharding: Optional[_sharding.DenseSharding] = None, *,
                     what: str = "dot_general") -> bool:
  """Whether a contraction runs as the plain high-precision one: JAX's own `dot_general` /
  `einsum` (the unswapped module's code), differentiated by JAX.

  True without quantizers, and for `quantizers.unquantized` without a sharding plan: nothing
  is quantized, and the TN layout (operands transposed and flattened, `x . W^T`, a custom
  backward) would be another program than the original's, for which XLA:CPU picks kernels that
  sum the same products in another order (an operand-swapped `jnp.einsum`'s forward, the input
  and weight gradients of multi-axis or batched contractions). Running the original's own
  contraction makes an all-Identity recipe the unquantized model bit for bit, values and
  gradients; callers with a Flax original (the linen and NNX modules) run its code when this
  returns True, `dense` its plain `dot_general`. `jaxquant.explain` records that case: the
  quantizer that served each role and the contraction (`what`), on the "high-precision" path.
  Under a sharding plan the Identity contraction keeps the plan's collectives (`reduce_dtype`,
  FSDP gathers) and runs through `dense`'s custom backward, as does a cast
  (`IdentityQuantizer(dtype)`)."""
  if quantizers is None:
    return True
  if not quantizers.unquantized or sharding is not None:
    return False
  why = "all-Identity: JAX's own contraction and autodiff"
  for tensor_type, role in zip(TENSOR_TYPES, quantizers.roles):
    _explain.record(_explain.Decision(
        "quantize", role, f"rowwise+columnwise: {quantizers.quantizer(tensor_type)}",
        "high-precision", why))
  role = quantizers.roles[0]
  label = what if role is None else f"{role.module_type}/{role.path or role.name}"
  _explain.record(_explain.Decision("gemm", label, what, "high-precision", why))
  return True


def compute_dtype_weight(quantizer: Quantizer, kernel_dtype, compute_dtype) -> Quantizer:
  """The weight quantizer for a kernel kept in `kernel_dtype` (its parameter dtype) under
  `compute_dtype`: every `IdentityQuantizer()` leaf (which keeps its input's dtype) becomes
  `IdentityQuantizer(compute_dtype)`, so a direction kept in high precision reaches its GEMM in
  the compute dtype, as a promoted kernel would; quantized leaves read the kernel as it is.
  Unchanged when the two dtypes agree."""
  if np.dtype(kernel_dtype) == np.dtype(compute_dtype):
    return quantizer

  def cast(leaf):
    if format_of(leaf).high_precision and leaf.dtype is None:
      return IdentityQuantizer(compute_dtype)
    return leaf

  halves = format_of(quantizer).halves(quantizer)
  if halves is not None:
    return dataclasses.replace(quantizer, rowwise=cast(halves[0]), columnwise=cast(halves[1]))
  return cast(quantizer)


def copies_swap_with_transpose(quantizer: Quantizer) -> bool:
  """Whether a `[K, N]` kernel can be quantized as it is stored and its two copies swapped
  instead of transposing it first (a full read and write of the weights each step): the
  format's `copies_swap_with_transpose`."""
  return format_of(quantizer).copies_swap_with_transpose(quantizer)


@dataclasses.dataclass(frozen=True)
class _Config:
  quantizers: DenseQuantizers
  precision: Any
  x_dtype: Any
  kernel_dtype: Any
  bias_dtype: Any  # None without bias
  batch_shape: tuple[int, ...]  # leading axes of x, flattened into the GEMM rows
  contract_shape: tuple[int, ...]  # trailing axes of x, flattened into the contraction
  out_shape: tuple[int, ...]  # trailing axes of the kernel and the output
  plan: Optional[_sharding.DensePlan] = None  # specs under a mesh (None: unsharded/unknown)
  # What replaces the output and quantizes the output gradient (the fused activation of an MLP,
  # jaxquant.layers.fused_activation.ActivationEpilogue), or the output's parts
  # (jaxquant.layers.split_output.SplitOutput, whose cotangents the backward joins), or None.
  epilogue: Any = None

  def constrain(self, value, spec):
    """`value` constrained to `spec` of the plan (unchanged without a plan or a spec)."""
    if self.plan is None or value is None or spec is None:
      return value
    return jax.lax.with_sharding_constraint(value, _sharding.named(spec, self.plan.mesh))

  def constrain_storage(self, qtensor, quantizer, spec):
    """A `QuantizedTensor` constrained to the storage specs of a matrix sharded as `spec`."""
    if self.plan is None or qtensor is None or spec is None:
      return qtensor
    specs = _sharding.storage_specs(quantizer, spec, rowwise=qtensor.rowwise is not None,
                                    columnwise=qtensor.columnwise is not None)
    return _sharding.constrain(qtensor, specs, self.plan.mesh)

  @property
  def weight_spec(self):
    """How the weight is quantized: sharded, unless it is gathered in high precision first."""
    plan = self.plan
    return plan.weight_gathered if plan.weight_gather == "high-precision" else plan.weight

  def gathered_weight(self, qtensor):
    """The weight storage the GEMMs read: FSDP axes gathered (quantized bytes move)."""
    if self.plan is None or self.plan.weight_gather != "quantized":
      return qtensor
    specs = _sharding.storage_specs(self.quantizers.weight, self.plan.weight_gathered,
                                    rowwise=qtensor.rowwise is not None,
                                    columnwise=qtensor.columnwise is not None)
    return _sharding.gather_storage(qtensor, specs, self.plan.mesh)

  def gemm_label(self, kind: str) -> str:
    role = self.quantizers.roles[0]
    if role is None:
      return kind
    return f"{role.module_type}/{role.path or role.name}/{kind}"


def _keys(key):
  if key is None:
    return None, None, None
  return tuple(jax.random.fold_in(key, i) for i in range(3))


def _high_precision(operand) -> bool:
  return format_of(operand.quantizer).high_precision


def _value(primal):
  return None if primal is None else primal.value


def _maker(config: _Config, tensor_type: str) -> operands.Make:
  """How `config`'s dense quantizes its input or weight: the role's quantizer, the plan's
  sharding constraints around it, and the state it leaves."""
  q = config.quantizers
  quantizer, role = q.quantizer(tensor_type), q.roles[TENSOR_TYPES.index(tensor_type)]
  plan = config.plan
  spec = None if plan is None else (plan.x2d if tensor_type == "input" else config.weight_spec)

  def make(value2d, state, key, columnwise):
    value2d = config.constrain(value2d, spec)
    qtensor, new_state = ops.quantize_and_update(value2d, quantizer, rowwise=True,
                                                 columnwise=columnwise, key=key, state=state,
                                                 role=role)
    return config.constrain_storage(qtensor, quantizer, spec), new_state

  return make


def _input_operand(config: _Config, x, kernel, key, state,
                   x_quantized: Optional[QuantizedTensor] = None) -> operands.Operand:
  """x's storage: written by a fused producer (`x_quantized`: `jaxquant.layers.fused_norm` /
  `fused_activation`), made here (the columnwise copy only if the kernel is differentiated),
  or shared with earlier contractions of the same x (`jaxquant.layers.shared_inputs`)."""
  q = config.quantizers
  if x_quantized is not None:
    qtensor = config.constrain_storage(x_quantized, q.input, config.plan and config.plan.x2d)
    update = lambda t, s: ops.update_state(q.input, s, t, role=q.roles[0])
    return operands.given_operand(qtensor, update, state, names=operands.INPUT_NAMES)
  k = math.prod(config.contract_shape)
  make = lambda probe: operands.quantize_operand(
      _maker(config, "input"), x.reshape(-1, k), names=operands.INPUT_NAMES, probe=probe,
      state=state, key=key)
  if key is not None or not shared_inputs.active():
    return make(kernel)
  plan = config.plan
  share_key = (q.input, tuple(x.shape), config.contract_shape,
               None if plan is None else (plan.x2d, plan.mesh))
  operand, reused = shared_inputs.shared_operand(x, share_key, state, lambda: make(None))
  if reused:
    _explain.record(_explain.Decision(
        "quantize", q.roles[0], f"rowwise+columnwise: {q.input}", "shared",
        "the same input, quantized the same way by an earlier contraction in this scope"))
  return operand


def _swapped_maker(config: _Config) -> operands.Make:
  """How a kernel `[K, N]` is quantized as it is stored (`copies_swap_with_transpose`): its
  columnwise copy `[N, K]` is the forward operand, its rowwise copy dgrad's (the same bytes as
  quantizing W^T, without materializing W^T, a full read and write of the weights)."""
  q = config.quantizers
  role = q.roles[TENSOR_TYPES.index("weight")]

  def make(kn, state, key, backward):
    stored, new_state = ops.quantize_and_update(kn, q.weight, rowwise=backward,
                                                columnwise=True, key=key, state=state, role=role)
    return QuantizedTensor(stored.columnwise, stored.rowwise, q.weight), new_state

  return make


def _weight_operand(config: _Config, kernel, key, state, probe) -> operands.Operand:
  """W's storage, from the kernel in its parameter dtype: quantized as stored with the copies
  swapped where the format allows it (unsharded), else W^T quantized."""
  k, n = math.prod(config.contract_shape), math.prod(config.out_shape)
  if config.plan is None and copies_swap_with_transpose(config.quantizers.weight):
    make, value = _swapped_maker(config), kernel.reshape(k, n)
  else:
    make, value = _maker(config, "weight"), kernel.reshape(k, n).T
  return operands.quantize_operand(make, value, names=operands.WEIGHT_NAMES, probe=probe,
                                   state=state, key=key)


def _forward(config: _Config, x, bias, qx: operands.Operand, qw: operands.Operand):
  q = config.quantizers
  plan = config.plan
  n = math.prod(config.out_shape)
  bias = None if bias is None else bias.reshape(n)
  x_row = qx.rowwise.restore()
  w_row = config.gathered_weight(QuantizedTensor(qw.rowwise.restore(), None, q.weight)).rowwise
  if plan is not None and plan.known and plan.x_k_axes and (
      plan.x_k_axes == plan.gathered(plan.k_axes)):  # row-parallel: K sharded
    y = collective_gemm.reduced_gemm(
        x_row, w_row, mesh=plan.mesh, rows=plan.row_axes, cols=plan.gathered(plan.n_axes),
        k=plan.x_k_axes, out_dtype=x.dtype, reduce_dtype=plan.reduce_dtype, bias=bias,
        role=config.gemm_label("fprop"), precision=config.precision)
  elif config.epilogue is not None and config.epilogue.in_gemm:  # (act(h), h) from the GEMM
    if plan is not None:
      raise ValueError("epilogue: the activation in the GEMM's epilogue runs on unsharded "
                       "dense layers only (sharding=None)")
    a, h = config.epilogue.gemm(x_row, w_row, bias=bias, out_dtype=x.dtype,
                                role=config.gemm_label("fprop"), precision=config.precision)
    return tuple(v.reshape(*config.batch_shape, *config.out_shape) for v in (a, h))
  else:
    y = ops.gemm(x_row, w_row, out_dtype=x.dtype, bias=bias,
                 role=config.gemm_label("fprop"), precision=config.precision)
  y = config.constrain(y, plan and plan.y2d)
  return y.reshape(*config.batch_shape, *config.out_shape)


def _outputs(config: _Config, y):
  """(what the layer returns, the epilogue's residual h or None) of `_forward`'s `y`."""
  if config.epilogue is None:
    return y, None
  if isinstance(config.epilogue, SplitOutput):  # the parts; the backward needs no residual
    return config.epilogue.outputs(y, len(config.out_shape)), None
  if config.epilogue.in_gemm:
    return y, y[1]
  return config.epilogue.outputs(y), y


def _record_plan(config: _Config) -> None:
  """Tell `jaxquant.explain` how the sharded dense moves its operands."""
  plan, roles = config.plan, config.quantizers.roles
  if plan.fsdp_axes:
    moved = {"quantized": "quantized storage all-gathered (the local shard is quantized with "
                          "global scales)",
             "high-precision": "high-precision weight all-gathered, then quantized"}
    _explain.record(_explain.Decision(
        "fsdp-gather", roles[1], f"kernel over {plan.fsdp_axes}: {moved[plan.weight_gather]}",
        plan.weight_gather, plan.reason))
  if plan.rows_note:
    _explain.record(_explain.Decision("sharding", roles[0], f"x rows -> {plan.x2d}", "reshard",
                                      plan.rows_note))


def _primal(config, x, kernel, bias, key, states, qx, qw):
  return _outputs(config, _forward(config, x, bias, qx, qw))[0]


def _fwd(config, x, kernel, bias, key, states, qx, qw):
  need_dgrad, need_wgrad = x.perturbed, kernel.perturbed
  x, bias, key, states, qx, qw = _unwrap((x, bias, key, states, qx, qw))
  out, h = _outputs(config, _forward(config, x, bias, qx, qw))
  new_states = (qx.state, qw.state, states[2])
  x_col = qx.columnwise if need_wgrad else None
  w_col = qw.columnwise if need_dgrad else None
  return out, (x_col, w_col, key, new_states, h)


def _unwrap(tree):
  return jax.tree_util.tree_map(_value, tree, is_leaf=lambda p: isinstance(p, CustomVJPPrimal))


def _bwd(config, residuals, dy):
  x_col, w_col, key, states, y = residuals
  x_col = None if x_col is None else x_col.restore()
  w_col = None if w_col is None else w_col.restore()
  q = config.quantizers
  _, _, key_g = _keys(key)
  roles = q.roles
  plan = config.plan
  epilogue, quantized = config.epilogue, None
  if isinstance(epilogue, SplitOutput):  # the parts' cotangents: quantized where they lie,
    quantized = _split_gradient(config, dy, states[2], w_col is not None, x_col is not None)
    if quantized is None:  # or joined, then quantized as a plain output gradient
      dy = epilogue.join(dy, config.batch_shape + config.out_shape, len(config.out_shape),
                         config.x_dtype)
  elif epilogue is not None:  # dy is the epilogue's cotangent; it quantizes dy itself
    quantized = epilogue.gradient(
        dy, y, q.grad_output, states[2], rowwise=w_col is not None, columnwise=x_col is not None,
        dbias=config.bias_dtype is not None, key=key_g, role=roles[2])
  if quantized is not None:
    dqy, dbias = quantized
    dbias = None if dbias is None else dbias.reshape(config.out_shape).astype(config.bias_dtype)
  else:
    dy_nd = dy
    dy = config.constrain(dy.reshape(-1, math.prod(config.out_shape)), plan and plan.y2d)
    dqy = ops.quantize(dy, q.grad_output, rowwise=w_col is not None,
                       columnwise=x_col is not None, key=key_g, state=states[2], role=roles[2])
    dbias = None
    if config.bias_dtype is not None:
      # The same reduction autodiff of `y + bias` performs, so Identity matches nn.Dense exactly.
      batch_axes = tuple(range(len(config.batch_shape)))
      dbias = jax.lax.reduce(dy_nd, jnp.zeros((), dy_nd.dtype), jax.lax.add, batch_axes)
      dbias = dbias.astype(config.bias_dtype)
  dqy = config.constrain_storage(dqy, q.grad_output, plan and plan.y2d)
  dx = dkernel = None
  if w_col is not None:
    w_col = config.gathered_weight(jaxquant_tensor(w_col, q.weight)).columnwise
    if plan is not None and plan.known and plan.gathered(plan.n_axes):  # column-parallel
      dx = collective_gemm.reduced_gemm(
          dqy.rowwise, w_col, mesh=plan.mesh, rows=plan.row_axes,
          cols=plan.gathered(plan.k_axes), k=plan.gathered(plan.n_axes),
          out_dtype=config.x_dtype, reduce_dtype=plan.reduce_dtype,
          role=config.gemm_label("dgrad"), precision=config.precision)
    else:
      dx = ops.gemm(dqy.rowwise, w_col, out_dtype=config.x_dtype,
                    role=config.gemm_label("dgrad"), precision=config.precision)
    dx = config.constrain(dx, plan and plan.x2d)
    dx = dx.reshape(*config.batch_shape, *config.contract_shape)
  if x_col is not None:
    # JAX's transpose rule of dot_general computes (dy^T x)^T; the same operand order (XLA
    # folds the transpose into the dot) keeps an Identity wgrad bit-identical to nn.Dense's.
    swap = _high_precision(x_col) and _high_precision(dqy.columnwise)
    if plan is not None and plan.known and plan.row_axes:  # data-parallel: K = rows sharded
      dkernel = _data_parallel_wgrad(config, x_col, dqy.columnwise, swap)
    elif swap:
      dkernel = ops.gemm(dqy.columnwise, x_col, out_dtype=config.kernel_dtype,
                         role=config.gemm_label("wgrad"), precision=config.precision).T
    else:
      dkernel = ops.gemm(x_col, dqy.columnwise, out_dtype=config.kernel_dtype,
                         role=config.gemm_label("wgrad"), precision=config.precision)
    dkernel = config.constrain(dkernel, plan and plan.kernel2d)
    dkernel = dkernel.reshape(*config.contract_shape, *config.out_shape)
  new_states = (states[0], states[1],
                ops.update_state(q.grad_output, states[2], dqy, role=roles[2]))
  # No cotangent for the quantized operands: the kernel and x gradients above are theirs.
  return dx, dkernel, dbias, None, new_states, None, None


def _split_gradient(config: _Config, dy, state, rowwise: bool, columnwise: bool):
  """(dy quantized, bias gradient or None) from a `SplitOutput`'s parts where its parts quantize
  serves, else None (the parts are joined first)."""
  return config.epilogue.gradient(
      dy, config.batch_shape + config.out_shape, len(config.out_shape), config.x_dtype,
      config.quantizers.grad_output, state, rowwise=rowwise, columnwise=columnwise,
      dbias=config.bias_dtype is not None, sharded=config.plan is not None,
      role=config.quantizers.roles[2])


def _data_parallel_wgrad(config: _Config, x_col, dy_col, swap: bool):
  """dW[K, N] summed over the data shards: reduce-scattered over the FSDP axes (dW arrives
  sharded like the kernel), all-reduced over the others, in the plan's reduce dtype."""
  plan = config.plan
  scatter_k = tuple(a for a in plan.k_axes if a in plan.fsdp_axes)
  scatter_n = tuple(a for a in plan.n_axes if a in plan.fsdp_axes)
  # Partial sums in the compute dtype by default (x's), as for a kernel promoted to it: a
  # float32 parameter's gradient moves the bytes of the bf16 model's, then widens.
  reduce_dtype = plan.reduce_dtype if plan.reduce_dtype is not None else config.x_dtype
  common = dict(mesh=plan.mesh, k=plan.row_axes, out_dtype=config.kernel_dtype,
                reduce_dtype=reduce_dtype, role=config.gemm_label("wgrad"),
                precision=config.precision)
  if swap:
    return collective_gemm.reduced_gemm(
        dy_col, x_col, rows=plan.gathered(plan.n_axes), cols=plan.x_k_axes,
        scatter_rows=scatter_n, scatter_cols=scatter_k, **common).T
  return collective_gemm.reduced_gemm(
      x_col, dy_col, rows=plan.x_k_axes, cols=plan.gathered(plan.n_axes),
      scatter_rows=scatter_k, scatter_cols=scatter_n, **common)


def remat_policy(base: Optional[Any] = None):
  """A `jax.checkpoint` / `flax.linen.remat` policy that keeps each dense's quantized weight
  (both copies), so the recomputed forward of a rematerialized block reuses them: each weight
  is quantized once per step. They cost 2 bytes per parameter (FP8) of saved memory.

  Args:
    base: another policy whose saved values are kept as well (e.g.
      `jax.checkpoint_policies.dots_with_no_batch_dims_saveable`); None: only the weights.
  """
  names = jax.checkpoint_policies.save_only_these_names(*operands.WEIGHT_NAMES)
  return names if base is None else jax.checkpoint_policies.save_from_both_policies(base, names)


def jaxquant_tensor(columnwise, quantizer) -> QuantizedTensor:
  """A columnwise-only `QuantizedTensor` around a saved residual."""
  return QuantizedTensor(None, columnwise, quantizer)


_dense_nd = jax.custom_vjp(_primal, nondiff_argnums=(0,))
_dense_nd.defvjp(_fwd, _bwd, symbolic_zeros=True)


def dense(x: jax.Array, kernel: jax.Array, bias: Optional[jax.Array] = None,
          quantizers: Optional[DenseQuantizers] = None, *, key: Optional[jax.Array] = None,
          states: Optional[tuple] = None, contracting_dims: int = 1,
          precision: Any = None,
          sharding: Optional[_sharding.DenseSharding] = None,
          weight: Optional[operands.Operand] = None,
          x_quantized: Optional[QuantizedTensor] = None, epilogue: Any = None) -> jax.Array:
  """Quantized `x @ kernel + bias` with a custom backward pass.

  Args:
    x: `[..., K1..Kc]` activations (bfloat16/float16/float32), in the compute dtype.
    kernel: `[K1..Kc, N1..Nn]` weights in `x`'s dtype or in their parameter dtype (float32
      parameters under bf16 compute): quantized copies are read from that dtype directly and
      the kernel's gradient comes in it; Identity directions and an unquantized contraction
      use the kernel cast to `x`'s dtype.
    bias: optional `[N1..Nn]`.
    quantizers: the `DenseQuantizers` for input, weight and grad_output (None, or three
      `IdentityQuantizer()`s without `sharding`: no quantization, a plain `dot_general` exactly
      like `flax.linen.Dense`, differentiated by JAX; see `runs_unquantized`).
    key: PRNG key, required when a quantizer uses stochastic rounding; the input, weight and
      grad_output quantizers get `jax.random.fold_in(key, 0 | 1 | 2)`.
    states: `(input, weight, grad_output)` delayed-scaling states from
      `quantizers.init_states()`; their gradient is their updated value.
    contracting_dims: how many trailing axes of `x` (leading axes of `kernel`) are contracted.
    precision: `jax.lax.Precision` for high-precision (Identity) GEMMs.
    sharding: `jaxquant.sharding.DenseSharding` with the mesh-axis specs of `x` and `kernel`
      (None: no constraints, XLA propagation decides). A spec whose shards would split a
      scaling block raises `ValueError`; FSDP kernel axes (those that also shard x's rows) are
      gathered after quantization where exact (see `jaxquant.sharding.plan_dense`).
    weight: the kernel already quantized by `prepare_weight` (reused across gradient
      accumulation's micro-batches); None: quantized here. Either way the weight is quantized
      outside this function's custom_vjp, its copies named `operands.WEIGHT_NAMES` for remat
      policies (`remat_policy`), and the kernel's gradient is the contraction's.
    x_quantized: x already quantized by `quantizers.input`, both directions (a fused producer
      wrote it: `jaxquant.layers.fused_norm`); `x` then gives only the shape, the dtype and the
      path of x's gradient. It becomes the input operand as it is (the input state's update
      reads its amax).
    epilogue: `jaxquant.layers.fused_activation.ActivationEpilogue`: the layer returns what
      the epilogue makes of its output (`(a, h)`; with `in_gemm` the GEMM's epilogue computes
      `a = gelu(h)`, unsharded layers only), and the epilogue quantizes the output gradient
      (fused with the activation's derivative, or after JAX's). Or
      `jaxquant.layers.split_output.SplitOutput()`: the output's first feature axis (of two
      or more) as a tuple of parts, whose gradients reach this contraction's backward apart.

  Returns:
    `[..., N1..Nn]` in `x`'s dtype (with an epilogue: the epilogue's outputs).
  """
  if contracting_dims < 1 or contracting_dims > min(x.ndim, kernel.ndim):
    raise ValueError(f"contracting_dims={contracting_dims} must be between 1 and "
                     f"min(x.ndim, kernel.ndim)={min(x.ndim, kernel.ndim)}")
  contract_shape = x.shape[x.ndim - contracting_dims:]
  if tuple(kernel.shape[:contracting_dims]) != tuple(contract_shape):
    raise ValueError(f"kernel: leading axes {kernel.shape[:contracting_dims]} must equal x's "
                     f"contracted axes {contract_shape}")
  batch_shape = x.shape[:x.ndim - contracting_dims]
  out_features = kernel.shape[contracting_dims:]
  if bias is not None and tuple(bias.shape) != tuple(out_features):
    raise ValueError(f"bias: expected shape {tuple(out_features)}, got {tuple(bias.shape)}")
  if sharding is not None and not isinstance(sharding, _sharding.DenseSharding):
    raise TypeError(f"sharding: expected a jaxquant.sharding.DenseSharding or None, got "
                    f"{type(sharding).__name__}")
  if quantizers is not None and not isinstance(quantizers, DenseQuantizers):
    raise TypeError(f"quantizers: expected DenseQuantizers or None, got "
                    f"{type(quantizers).__name__}")
  split = epilogue if isinstance(epilogue, SplitOutput) else None
  if split is not None and len(out_features) < 2:
    raise ValueError(f"epilogue: SplitOutput splits the first of several output axes; the "
                     f"kernel has one, {tuple(out_features)}")
  if x_quantized is not None or (epilogue is not None and split is None):
    _check_fusion(quantizers, x_quantized, x, contracting_dims)
  relayout = (None if quantizers is None  # XLA contracts the axes as they are
              else shard_major(sharding, kernel.shape, contracting_dims))
  if relayout is not None:  # a sharded inner output axis: contract in shard-major order
    if epilogue is not None and split is None:
      raise ValueError(f"epilogue: the kernel's sharded output axis ({sharding.kernel}) is not "
                       "the leading one; a fused activation epilogue needs it to be")
    relayout.check_blocks(quantizers, sharding.mesh or _sharding.current_mesh())
    _explain.record(_explain.Decision(
        "sharding", quantizers.roles[1],
        f"kernel output axes {tuple(out_features)} over {sharding.kernel}",
        "shard-major", "the sharded output axis is not the leading one: the GEMM reads the "
        "output features shard by shard (local reshapes, no data moved)"))
    y = dense(x, relayout.kernel(kernel, contracting_dims), relayout.bias(bias), quantizers,
              key=key, states=states, contracting_dims=contracting_dims, precision=precision,
              sharding=relayout.sharding, weight=weight, x_quantized=x_quantized)
    y = relayout.output(y)
    # (autodiff joins the parts' gradients)
    return y if split is None else split.outputs(y, len(out_features))
  if runs_unquantized(quantizers, sharding):
    kernel = kernel.astype(x.dtype)  # a parameter-dtype kernel: Flax's promotion
    y = jax.lax.dot_general(x, kernel, ((tuple(range(x.ndim - contracting_dims, x.ndim)),
                                         tuple(range(contracting_dims))), ((), ())),
                            precision=precision)
    if bias is not None:
      y = y + bias.reshape((1,) * len(batch_shape) + tuple(out_features))
    return y if split is None else split.outputs(y, len(out_features))
  if states is None:
    if quantizers.stateful:
      raise ValueError("states: the quantizers are stateful (delayed scaling); pass "
                       "states=quantizers.init_states() (kept by the Flax modules)")
    states = (None, None, None)
  plan = None
  if sharding is not None:
    plan = _sharding.plan_dense(sharding, x.shape, kernel.shape, contracting_dims,
                                quantizers.weight, ("rowwise", "columnwise"))
  if plan is not None:  # reject block-splitting activation shards now, by name
    rows, k, n = math.prod(batch_shape), math.prod(contract_shape), math.prod(out_features)
    _sharding.check_blocks_fit(quantizers.input, (rows, k), plan.x2d, plan.mesh, name="x")
    _sharding.check_blocks_fit(quantizers.grad_output, (rows, n), plan.y2d, plan.mesh,
                               name="grad_output")
  quantizers = dataclasses.replace(
      quantizers, weight=compute_dtype_weight(quantizers.weight, kernel.dtype, x.dtype))
  config = _Config(quantizers, precision, x.dtype, kernel.dtype,
                   None if bias is None else bias.dtype, tuple(batch_shape),
                   tuple(contract_shape), tuple(out_features), plan, epilogue)
  if plan is not None:
    _record_plan(config)
  key_x, key_w, _ = _keys(key)
  qx = _input_operand(config, x, kernel, key_x, states[0], x_quantized)
  if weight is None:
    weight = _weight_operand(config, kernel, key_w, states[1], probe=x)
  elif not isinstance(weight, operands.Operand) or weight.quantizer != quantizers.weight:
    raise TypeError(f"weight: expected the jaxquant.prepare_weight operand of this kernel "
                    f"under {quantizers.weight}, got {type(weight).__name__}"
                    + (f" under {weight.quantizer}" if isinstance(weight, operands.Operand)
                       else ""))
  return _dense_nd(config, x, kernel, bias, key, tuple(states), qx, weight)


def _check_fusion(quantizers, x_quantized, x, contracting_dims) -> None:
  """A pre-quantized input or an epilogue needs quantizers, and x_quantized must be x's."""
  if quantizers is None:
    raise ValueError("x_quantized / epilogue: the fused producers quantize; pass quantizers")
  if x_quantized is None:
    return
  if (not isinstance(x_quantized, QuantizedTensor) or x_quantized.rowwise is None
      or x_quantized.columnwise is None):
    raise TypeError("x_quantized: expected a QuantizedTensor with both copies (rowwise and "
                    f"columnwise), got {type(x_quantized).__name__}"
                    + (f" with rowwise={x_quantized.rowwise is not None}, columnwise="
                       f"{x_quantized.columnwise is not None}"
                       if isinstance(x_quantized, QuantizedTensor) else ""))
  if x_quantized.quantizer != quantizers.input:
    raise ValueError(f"x_quantized: quantized by {x_quantized.quantizer}, but the input role's "
                     f"quantizer is {quantizers.input}")
  k = math.prod(x.shape[x.ndim - contracting_dims:])
  rows = math.prod(x.shape[:x.ndim - contracting_dims])
  if tuple(x_quantized.rowwise.shape) != (rows, k):
    raise ValueError(f"x_quantized: rowwise copy {tuple(x_quantized.rowwise.shape)}, expected "
                     f"{(rows, k)} for x {tuple(x.shape)}")


def prepare_weight(x: jax.Array, kernel: jax.Array, quantizers: DenseQuantizers, *,
                   state: Any = None, key: Optional[jax.Array] = None,
                   contracting_dims: int = 1,
                   sharding: Optional[_sharding.DenseSharding] = None) -> operands.Operand:
  """The quantized weight `dense(x, kernel, ..., weight=...)` can reuse: both copies (forward
  and dgrad), and the weight quantizer's state after this quantization.

  Gradient accumulation quantizes each weight once per optimizer step with it, as
  TransformerEngine caches the weights on the first micro-batch: the weight does not change
  between micro-batches. `jaxquant.flax.quantize_weights` does it for a whole Flax model.

  Args:
    x: an input of the contraction (its shape places the sharding plan; values unused).
    kernel, quantizers, contracting_dims, sharding: as `dense`.
    state: the weight quantizer's delayed-scaling state (`quantizers.init_states()[1]`).
    key: the dense's PRNG key (the weight's is `fold_in(key, 1)`, as in `dense`).
  """
  if not isinstance(quantizers, DenseQuantizers):
    raise TypeError(f"quantizers: expected DenseQuantizers, got {type(quantizers).__name__}")
  if quantizers.weight.stateful and state is None:
    raise ValueError(f"state: {quantizers.weight} is stateful; pass the weight's state "
                     "(quantizers.init_states()[1])")
  relayout = shard_major(sharding, kernel.shape, contracting_dims)
  if relayout is not None:  # as `dense` re-lays it
    kernel, sharding = relayout.kernel(kernel, contracting_dims), relayout.sharding
  batch_shape = x.shape[:x.ndim - contracting_dims]
  contract_shape = tuple(kernel.shape[:contracting_dims])
  plan = None
  if sharding is not None:
    plan = _sharding.plan_dense(sharding, x.shape, kernel.shape, contracting_dims,
                                quantizers.weight, ("rowwise", "columnwise"))
  quantizers = dataclasses.replace(  # as `dense` does: read the kernel in its parameter dtype
      quantizers, weight=compute_dtype_weight(quantizers.weight, kernel.dtype, x.dtype))
  config = _Config(quantizers, None, x.dtype, kernel.dtype, None, tuple(batch_shape),
                   contract_shape, tuple(kernel.shape[contracting_dims:]), plan)
  return _weight_operand(config, kernel, _keys(key)[1], state, probe=None)
