"""The fused producers inside `LayerNormDense` and `LayerNormMLP`.

Where the dense layer's input format has fused kernels (`jaxquant.ops.fused.fusion_unsupported`
is None: per-tensor FP8, MXFP8, Float8Block), the normalization kernel writes the quantized
input of `LayerNormDense`'s contraction / `LayerNormMLP`'s `fc1`, and in `LayerNormMLP` the
activation kernel writes `fc2`'s quantized input and the activation-gradient kernel `fc1`'s
quantized output gradient (`jaxquant.layers.fused_norm`, `fused_activation`). Each fusion is
decided on its own and `jaxquant.explain` records every one that does not happen, with why
("layernorm, then quantize"): an unquantized or Identity recipe, a format without fused
kernels, an activation without one (a callable, "gelu_exact", more than two gates), a sharding
that splits the normalized axis or the MLP's features.

By default (`fuse_producers=None`) the modules do not fuse: the CUDA kernels measured slower
than XLA's producer followed by the quantize kernel, and the CPU handlers are slower still
(decision 20 of docs/design.md); `fuse_producers=True` takes them (as the tests do), False never
fuses. Apart from those, a gelu `LayerNormMLP` with per-tensor FP8 `fc1` operands applies the
gelu in `fc1`'s GEMM epilogue on CUDA (`fuse_gemm_activation`, `gelu_kernel_plan`; decision
60), where the forward activation is not fused into `fc2`'s quantize otherwise; one with a
Float8Block 1x128 `fc2` input can apply it in `fc2`'s whole-tile quantize kernel when asked
(`fuse_gemm_activation=True`; decision 62).

Parameters and delayed-scaling variables are exactly the unfused modules' (same names, shapes,
initializers, scopes), so a checkpoint and a recipe change move freely between both paths; the
normalization's and activation's values follow the fused spec (`jaxquant.numerics`) instead
of Flax's arithmetic, within a few float32 ulps of it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional, Sequence, Union

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxquant.explain import Decision, record
from jaxquant.flax.dense_general import _flat_init
from jaxquant.flax.quantization import (logical_init, module_key, module_path,
                                        module_quantizers, module_sharding, module_states,
                                        module_weight, resolve_recipe)
from jaxquant.layers.dense import DenseQuantizers, dense, prepare_weight
from jaxquant.layers.operands import Operand
from jaxquant.layers.fused_activation import (ActivationConfig, ActivationEpilogue,
                                              activation_quantized, activation_routed,
                                              activation_routed_hp)
from jaxquant.layers.fused_norm import NormConfig, norm_quantized, out_dtypes
from jaxquant.numerics import activations as _act
from jaxquant.formats import format_of
from jaxquant.ops.fused import (auto_fusion_reason, auto_gemm_epilogue_reason,
                                auto_quantize_gelu_reason, fusion_unsupported)
from jaxquant.quantizers import Float8BlockQuantizer

# Gated shorthands with a fused kernel: the activation of the first half (the second is linear).
FUSED_GATED = _act.GATED


def fused_activation(activations: Union[str, Callable, Sequence]) -> tuple[Optional[tuple],
                                                                            str]:
  """((activation, gated), "") when `LayerNormMLP.activations` has fused kernels, else
  (None, why not)."""
  if isinstance(activations, str) or callable(activations):
    activations = (activations,)
  activations = tuple(activations)
  if len(activations) == 1 and isinstance(activations[0], str):
    name = activations[0]
    if name in FUSED_GATED:
      return (FUSED_GATED[name], True), ""
    if _act.ALIASES.get(name, name) in _act.ACTIVATIONS:
      return (_act.canonical(name), False), ""
    return None, f"activation {name!r} has no fused kernel ({_act.ACTIVATIONS} do)"
  if (len(activations) == 2 and isinstance(activations[0], str) and activations[1] == "linear"
      and _act.ALIASES.get(activations[0], activations[0]) in _act.ACTIVATIONS):
    return (_act.canonical(activations[0]), True), ""
  return None, (f"activations {activations!r} have no fused kernel (one of {_act.ACTIVATIONS}, "
                "or a gated (name, 'linear') pair, does)")


def _unfused(role, what: str, reason: str) -> None:
  record(Decision("producer", role, f"{what}, then quantize", "unfused",
                                    reason))


def _spec_entry(spec, index: int):
  if spec is None:
    return None
  entries = tuple(spec)
  return entries[index] if -len(entries) <= index < len(entries) else None


def platform_reason(fuse_producers: Optional[bool], kind: str = "norm") -> Optional[str]:
  """Why a module's `fuse_producers` setting keeps its `kind` producer ("norm" or
  "activation") unfused here, or None. None (the default): as `auto_fusion_reason` says
  (unfused for now); True: wherever the formats allow (CPU handlers, or the reference
  composition); False: never."""
  if fuse_producers is False:
    return "fuse_producers=False"
  return None if fuse_producers else auto_fusion_reason(kind)


def _rowwise_family(quantizer) -> str:
  """The GEMM family of the copy a forward GEMM reads (a hybrid's rowwise half)."""
  halves = format_of(quantizer).halves(quantizer)
  leaf = quantizer if halves is None else halves[0]
  return format_of(leaf).gemm_family(leaf)


def _gelu_kernel_inputs_reason(module: nn.Module, quantizers: Optional[DenseQuantizers],
                               kernel: str) -> Optional[str]:
  """Why `kernel` cannot apply the module's activation beside `quantizers`' GEMM whatever the
  format: not an ungated gelu, or nothing quantized (None: it could)."""
  act, _ = fused_activation(module.activations)
  if act != ("gelu", False):
    return (f"{kernel} applies gelu (the tanh approximation) only; activations="
            f"{module.activations!r}")
  if quantizers is None or quantizers.unquantized:
    return "nothing is quantized"
  return None


def _gemm_epilogue_candidate(module: nn.Module, q1: Optional[DenseQuantizers]) -> Optional[str]:
  """None when fc1's GEMM could apply the module's activation in its epilogue (a gelu,
  ungated, with per-tensor FP8 fc1 operands), else why not."""
  reason = _gelu_kernel_inputs_reason(module, q1, "the GEMM's epilogue")
  if reason is not None:
    return reason
  families = {t: _rowwise_family(q1.quantizer(t)) for t in ("input", "weight")}
  if set(families.values()) != {"fp8"}:
    return f"the gelu epilogue is cuBLASLt's per-tensor FP8 GEMM's; fc1 reads {families}"
  return None


def _quantize_gelu_candidate(module: nn.Module, q2: Optional[DenseQuantizers]) -> Optional[str]:
  """None when fc2's input quantize could apply the module's activation (a gelu, ungated, with
  a Float8Block 1x128 fc2 input: its whole-tile kernel's approximate gelu), else why not."""
  reason = _gelu_kernel_inputs_reason(module, q2, "the quantize kernel")
  if reason is not None:
    return reason
  quantizer = q2.input
  if not isinstance(quantizer, Float8BlockQuantizer) or tuple(quantizer.block) != (1, 128):
    return (f"the gelu in fc2's input quantize is Float8Block's 1x128 whole-tile kernel's; fc2 "
            f"reads {type(quantizer).__name__}")
  return None


# What `explain` calls each place of the gelu.
_GELU_KERNELS = {"gemm": "gelu in fc1's GEMM epilogue", "quantize": "gelu in fc2's input quantize"}


def _say_gelu_kernel(module: nn.Module, q1: DenseQuantizers, q2: Optional[DenseQuantizers],
                     reason: str) -> None:
  """Tell `explain` why the gelu runs in neither fused kernel, where the module asked for one
  (`fuse_gemm_activation=True`) or one was a candidate."""
  if module.fuse_gemm_activation or _gemm_epilogue_candidate(module, q1) is None:
    record(Decision("producer", q1.roles[0], _GELU_KERNELS["gemm"], "unfused", reason))
  elif _quantize_gelu_candidate(module, q2) is None:
    record(Decision("producer", q2.roles[0], _GELU_KERNELS["quantize"], "unfused", reason))


def gelu_kernel_plan(module: nn.Module, q1: Optional[DenseQuantizers],
                     q2: Optional[DenseQuantizers], sharding1, sharded: bool,
                     fuse_forward: bool) -> tuple[Optional[str], Optional[str]]:
  """Where a `LayerNormMLP`'s gelu runs beside its quantized GEMMs: `("gemm", None)` in `fc1`'s
  GEMM epilogue (`jaxquant.ops.gemm_gelu`: per-tensor FP8 fc1 operands), `("quantize", None)`
  in `fc2`'s Float8Block input quantize (the whole-tile kernel's approximate gelu, decision
  62), or `(None, why not)`. `module.fuse_gemm_activation`: None (default) as
  `auto_gemm_epilogue_reason` / `auto_quantize_gelu_reason` say (CUDA), True wherever the
  formats allow, False never. `sharding1`: fc1's; `sharded`: either layer's."""
  setting = module.fuse_gemm_activation
  if setting is False:
    return None, "fuse_gemm_activation=False"
  gemm_reason = _gemm_epilogue_candidate(module, q1)
  kind = "gemm" if gemm_reason is None else "quantize"
  if kind == "quantize" and _quantize_gelu_candidate(module, q2) is not None:
    return None, gemm_reason
  if kind == "gemm" and sharding1 is not None:
    return None, "fc1 is sharded (logical axes): its GEMM and gelu run apart"
  if kind == "quantize" and sharded:
    return None, ("the MLP is sharded (logical axes): the quantize kernel's gelu takes whole "
                  "rows of features")
  if fuse_forward:
    return None, "the forward activation is fused into fc2's quantize (fuse_producers)"
  if not setting:
    reason = auto_gemm_epilogue_reason() if kind == "gemm" else auto_quantize_gelu_reason()
    if reason is not None:
      return None, reason
  return kind, None


def whole_tile_reason(h_shape: tuple, dtype) -> Optional[str]:
  """None when the quantize kernel's gelu serves fc1's output `h` (bfloat16, rows and features
  multiples of 128: the whole-tile kernel), else why not."""
  rows = int(np.prod(h_shape[:-1], dtype=np.int64))
  if np.dtype(dtype) != np.dtype(jnp.bfloat16):
    return f"the quantize kernel's gelu reads bfloat16, not {np.dtype(dtype).name}"
  if rows % 128 or h_shape[-1] % 128:
    return (f"the quantize kernel's gelu takes whole 128 x 128 tiles; fc1's output is "
            f"{rows} x {h_shape[-1]}")
  return None


def norm_fusion_reason(quantizers: Optional[DenseQuantizers], sharding) -> Optional[str]:
  """None when the normalization before a contraction with `quantizers` runs fused."""
  if quantizers is None:
    return "no recipe: nothing is quantized"
  if quantizers.unquantized:
    return "all-Identity recipe: nothing is quantized"
  reason = fusion_unsupported(quantizers.input)
  if reason is not None:
    return reason
  if sharding is not None and _spec_entry(sharding.x, -1) is not None:
    return (f"the normalized axis is sharded ({sharding.x}); the fused kernel needs whole rows")
  return None


@dataclasses.dataclass(frozen=True)
class NormSpec:
  """A module's normalization, for the fused path."""

  norm_type: str
  epsilon: float
  zero_centered_gamma: bool
  dtype: Any  # the module's `dtype`


def fused_norm_input(spec: NormSpec, inputs: jax.Array, scale, bias, kernel, dense_bias,
                     quantizers: DenseQuantizers, states, write_y: bool):
  """(ln_out, qx, ln_out in the norm's dtype or None) of the fused normalization."""
  params = [p.dtype for p in (scale, bias) if p is not None]
  kernels = [p.dtype for p in (kernel, dense_bias) if p is not None]
  out_dtype, dense_dtype = out_dtypes(inputs.dtype, params, kernels, spec.dtype)
  config = NormConfig(spec.norm_type, spec.epsilon, spec.zero_centered_gamma, out_dtype,
                      dense_dtype, quantizers.input, write_y, quantizers.roles[0])
  ln_out, qx = norm_quantized(inputs, scale, bias, None if states is None else states[0], config)
  if write_y:
    return ln_out.astype(dense_dtype), qx, ln_out
  return ln_out, qx, None


def layernorm_dense(module: nn.Module, inputs: jax.Array, spec: NormSpec, scale, bias, kernel,
                    dense_bias, *, write_y: bool, epilogue: Any = None):
  """`LayerNormDense`'s quantized contraction with the fused normalization, or None when it
  does not apply (the caller normalizes and contracts as before); `(y, ln_out or None)`.
  `epilogue`: `jaxquant.dense`'s (a `SplitOutput`)."""
  quantizers = module_quantizers(module)
  if quantizers is None or quantizers.unquantized:
    return None  # nothing is quantized: Flax's norm and contraction
  sharding = module_sharding(module, kernel.shape, kernel.dtype)
  reason = norm_fusion_reason(quantizers, sharding) or platform_reason(module.fuse_producers)
  if reason is not None:
    _unfused(quantizers.roles[0], spec.norm_type, reason)
    return None
  states, key = module_states(module, quantizers), module_key(module, quantizers)
  x, qx, ln_out = fused_norm_input(spec, inputs, scale, bias, kernel, dense_bias, quantizers,
                                   states, write_y)
  # The kernel stays in param_dtype (a quantized weight is read from it, as Dense's).
  _, _, dense_bias = nn.dtypes.promote_dtype(x, kernel, dense_bias, dtype=spec.dtype)
  weight = module_weight(module, lambda: prepare_weight(
      x, kernel, quantizers, state=None if states is None else states[1], key=key,
      sharding=sharding))
  y = dense(x, kernel, dense_bias, quantizers, key=key, states=states,
            precision=module.precision, sharding=sharding, x_quantized=qx, weight=weight,
            epilogue=epilogue)
  return y, ln_out


# ------------------------------------------- LayerNormMLP -------------------------------------

@dataclasses.dataclass(frozen=True)
class Parts:
  """A dense layer's parameters and quantization, resolved in its own scope."""

  kernel: jax.Array
  bias: Optional[jax.Array]
  quantizers: Optional[DenseQuantizers]
  states: Any
  key: Any
  sharding: Any


class DenseParts(nn.Module):
  """Declares exactly what `jaxquant.flax.Dense` (one feature axis) or a gated `fc1`
  `jaxquant.flax.DenseGeneral((n, N))` declares, under the same name, and returns it (`Parts`)
  instead of contracting: `LayerNormMLP`'s fused path contracts itself.

  Attributes mirror `Dense` / `DenseGeneral`'s (`features` is a tuple: `(N,)` or `(n, N)`).
  """

  features: tuple
  use_bias: bool = True
  dtype: Optional[Any] = None
  param_dtype: Any = jnp.float32
  precision: Any = None
  kernel_init: Any = nn.initializers.lecun_normal()
  bias_init: Any = nn.initializers.zeros_init()
  recipe: Any = None
  kernel_axes: tuple = ()
  input_axes: tuple = ()
  reduce_dtype: Optional[Any] = None

  @nn.compact
  def __call__(self, in_features: int) -> Parts:
    features = tuple(self.features)
    kernel_axes = tuple(self.kernel_axes)
    if len(features) == 1:  # Dense
      kernel = self.param("kernel", logical_init(self.kernel_init, kernel_axes),
                          (in_features,) + features, self.param_dtype)
      bias_axes, bias_init = kernel_axes[-1:], self.bias_init
    else:  # DenseGeneral(features), axis=-1, no batch dims
      kernel = self.param("kernel", logical_init(_flat_init(self.kernel_init, 0, 1,
                                                            len(features)), kernel_axes),
                          (in_features,) + features, self.param_dtype)
      bias_axes = kernel_axes[len(kernel_axes) - len(features):]
      bias_init = _flat_init(self.bias_init, 0, None, len(features))
    bias = None
    if self.use_bias:
      bias = self.param("bias", logical_init(bias_init, bias_axes), features, self.param_dtype)
    quantizers = module_quantizers(self)
    if quantizers is None:
      return Parts(kernel, bias, None, None, None, None)
    sharding = module_sharding(self, kernel.shape, kernel.dtype)
    return Parts(kernel, bias, quantizers, module_states(self, quantizers),
                 module_key(self, quantizers), sharding)

  def quantized_weight(self, x: jax.Array, parts: Parts) -> Optional[Operand]:
    """The layer's quantized weight from the `"jaxquant_weights"` collection, or prepared and
    stored there while it is being filled (`jaxquant.flax.quantize_weights`), as `Dense` does;
    None: the contraction quantizes it. Call after `__call__` (`parts` is what it returned)."""
    if parts.quantizers is None:
      return None
    return module_weight(self, lambda: prepare_weight(
        x, parts.kernel, parts.quantizers,
        state=None if parts.states is None else parts.states[1], key=parts.key,
        sharding=parts.sharding))


def mlp_quantizers(module: nn.Module) -> Optional[tuple[DenseQuantizers, DenseQuantizers]]:
  """`(fc1, fc2)` quantizers of a `LayerNormMLP` when something in it could run fused (a recipe
  quantizes, and fc1's input, fc1's output gradient or fc2's input has fused kernels), else None
  (the module runs its unfused body)."""
  recipe = resolve_recipe(module)
  if recipe is None:
    return None
  path = module_path(module)
  q1, q2 = (DenseQuantizers.from_recipe(recipe, "linear", name, f"{path}/{name}")
            for name in (module.fc1_name, module.fc2_name))
  if q1.unquantized and q2.unquantized:
    return None
  candidates = (q1.input, q1.grad_output, q2.input)
  reason = platform_reason(module.fuse_producers)
  if reason is None and all(fusion_unsupported(q) is not None for q in candidates):
    reason = fusion_unsupported(q1.input)
  _, gelu_reason = gelu_kernel_plan(module, q1, q2, None, False, False)
  if reason is not None and gelu_reason is not None:
    _unfused(q1.roles[0], module.norm_type, reason)
    _say_gelu_kernel(module, q1, q2, gelu_reason)
    return None
  return q1, q2


def mlp_fusion_plan(module: nn.Module, part1: Parts, part2: Parts
                    ) -> tuple[bool, bool, bool, Optional[str]]:
  """(fuse the norm, the forward activation, the backward activation; where the gelu runs
  beside a GEMM: "gemm", "quantize" or None, `gelu_kernel_plan`) of a `LayerNormMLP`,
  recording why for each one that is not."""
  q1, q2 = part1.quantizers, part2.quantizers
  act, act_reason = fused_activation(module.activations)
  sharded = part1.sharding is not None or part2.sharding is not None
  sharded_reason = ("a sharded LayerNormMLP's activation runs unfused (the fused activation "
                    "kernels take whole rows of features)")

  def reason(quantizer):  # of the activation, forward or backward
    if quantizer is None:
      return "nothing is quantized"
    return (fusion_unsupported(quantizer) or act_reason or (sharded_reason if sharded else None)
            or platform_reason(module.fuse_producers, "activation"))

  norm_reason = norm_fusion_reason(q1, part1.sharding) or platform_reason(module.fuse_producers)
  forward_reason = reason(None if q2 is None else q2.input)
  backward_reason = reason(None if q1 is None else q1.grad_output)
  gelu_kernel, gelu_reason = gelu_kernel_plan(module, q1, q2, part1.sharding, sharded,
                                              forward_reason is None)
  name = act[0] if act else "activation"
  for role, what, why in ((q1.roles[0], module.norm_type, norm_reason),
                          (q2.roles[0], name, forward_reason),
                          (q1.roles[2], f"{name} gradient", backward_reason)):
    if why is not None:
      _unfused(role, what, why)
  if gelu_reason is not None and forward_reason is not None:
    _say_gelu_kernel(module, q1, q2, gelu_reason)
  return (norm_reason is None, forward_reason is None, backward_reason is None, gelu_kernel)


def layernorm_mlp(module: nn.Module, inputs: jax.Array, spec: NormSpec, scale, bias,
                  part1: Parts, part2: Parts, fuse: tuple[bool, bool, bool], *,
                  functions: tuple, write_y: bool, apply_norm: Callable,
                  weights: Optional[tuple[Callable, Callable]] = None):
  """`LayerNormMLP`'s body with the fusions `fuse` (from `mlp_fusion_plan`): `(y, ln_out)`.
  Without any fusion it is the unfused body (`Dense` / `DenseGeneral` contractions).
  `weights`: the two `DenseParts.quantized_weight` methods (the weight cache of `fc1`, `fc2`)."""
  fuse_norm, fuse_forward, fuse_backward, gelu_kernel = fuse
  act = fused_activation(module.activations)[0]
  gated = part1.kernel.ndim == 3
  q1, q2 = part1.quantizers, part2.quantizers
  if fuse_norm:
    x, qx, ln_out = fused_norm_input(spec, inputs, scale, bias, part1.kernel, part1.bias, q1,
                                     part1.states, write_y)
  else:
    ln_out = apply_norm(inputs)
    x, qx = ln_out, None
  # Kernels stay in param_dtype (quantized weights are read from it, as Dense's).
  x, _, bias1 = nn.dtypes.promote_dtype(x, part1.kernel, part1.bias, dtype=module.dtype)
  if gelu_kernel == "quantize":  # known only now: fc1's output shape and dtype
    reason = whole_tile_reason(x.shape[:-1] + part1.kernel.shape[-1:], x.dtype)
    if reason is not None:
      record(Decision("producer", q2.roles[0], _GELU_KERNELS["quantize"], "unfused", reason))
      gelu_kernel = None
  epilogue = None
  if gelu_kernel == "gemm":  # a = gelu(h) from fc1's GEMM; its gradient as fuse_backward says
    epilogue = ActivationEpilogue(*act, in_gemm=True, fused_gradient=fuse_backward)
  elif gelu_kernel == "quantize":  # a = gelu(h) in fc2's input quantize
    epilogue = ActivationEpilogue(*act, in_quantize=True, fused_gradient=fuse_backward)
  elif fuse_backward:
    epilogue = ActivationEpilogue(*act)
  weight1 = None if weights is None else weights[0](x, part1)
  fc1 = dense(x, part1.kernel, bias1, q1, key=part1.key, states=part1.states,
              precision=module.precision, sharding=part1.sharding, x_quantized=qx,
              epilogue=epilogue, weight=weight1)
  qa = None
  if gelu_kernel == "gemm":
    a = fc1[0]
  elif gelu_kernel == "quantize":
    config = ActivationConfig(act[0], act[1], q2.input, q2.roles[0], approximate=True)
    state2 = None if part2.states is None else part2.states[0]
    a, qa = activation_routed(fc1[0], fc1[1], state2, config)
  elif fuse_forward:
    config = ActivationConfig(act[0], act[1], q2.input, q2.roles[0])
    state2 = None if part2.states is None else part2.states[0]
    if fuse_backward:
      a, qa = activation_routed(fc1[0], fc1[1], state2, config)
    else:
      a, qa = activation_quantized(fc1, state2, config)
  elif fuse_backward:
    a = activation_routed_hp(fc1[0], fc1[1], act[0], act[1])
  elif gated:
    a = functions[0](fc1[..., 0, :])
    for i, f in enumerate(functions[1:], start=1):
      a = a * f(fc1[..., i, :])
  else:
    a = functions[0](fc1)
  a, _, bias2 = nn.dtypes.promote_dtype(a, part2.kernel, part2.bias, dtype=module.dtype)
  weight2 = None if weights is None else weights[1](a, part2)
  y = dense(a, part2.kernel, bias2, q2, key=part2.key, states=part2.states,
            precision=module.precision, sharding=part2.sharding, x_quantized=qa, weight=weight2)
  return y, ln_out


__all__ = ["DenseParts", "NormSpec", "Parts", "fused_activation", "gelu_kernel_plan",
           "layernorm_dense", "layernorm_mlp", "mlp_fusion_plan", "mlp_quantizers",
           "norm_fusion_reason", "platform_reason", "whole_tile_reason"]
