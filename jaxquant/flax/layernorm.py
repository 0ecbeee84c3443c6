"""`LayerNormDense` and `LayerNormMLP`: a normalization followed by quantized dense layers.

As in TransformerEngine, the norm and the dense layers form one module so a recipe sees the
whole block; each contraction still goes through `jaxquant.dense` with roles
`("linear", tensor_type, name)`: the module's own name for `LayerNormDense`, `fc1`/`fc2` (or
the configured names) for `LayerNormMLP`. Where the recipe's formats have fused kernels, the
normalization writes the first dense layer's quantized input, and in `LayerNormMLP` the
activation writes `fc2`'s and its gradient `fc1`'s quantized output gradient
(`jaxquant.flax.fusion`; `jaxquant.explain` says which ran and why not where one did not).
"""

from __future__ import annotations

import functools
import operator
from typing import Any, Callable, Optional, Sequence, Union

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxquant.flax.dense import Dense
from jaxquant.flax.dense_general import DenseGeneral, _as_tuple, _flat_init
from jaxquant.flax import fusion
from jaxquant.flax.norm import apply_norm, check_norm_type, norm_parameters
from jaxquant.flax.quantization import logical_init, quantized_contraction
from jaxquant.layers.split_output import SplitOutput
from jaxquant.recipes import Recipe

default_kernel_init = nn.initializers.lecun_normal()


def _quick_gelu(x):
  return x * jax.nn.sigmoid(1.702 * x)


def _squared_relu(x):
  return jnp.square(jax.nn.relu(x))


#: Activation names accepted by `LayerNormMLP.activations`.
ACTIVATIONS: dict[str, Callable[[jax.Array], jax.Array]] = {
    "gelu": jax.nn.gelu,  # tanh approximation, as Flax and TransformerEngine
    "gelu_exact": functools.partial(jax.nn.gelu, approximate=False),
    "quick_gelu": _quick_gelu,
    "relu": jax.nn.relu,
    "squared_relu": _squared_relu,
    "silu": jax.nn.silu,
    "swish": jax.nn.silu,
    "sigmoid": jax.nn.sigmoid,
    "tanh": jnp.tanh,
    "linear": lambda x: x,
}

#: Gated shorthands: `fc1` produces one slice per entry, and their activations are multiplied.
GATED_ACTIVATIONS: dict[str, tuple[str, ...]] = {
    "swiglu": ("silu", "linear"),
    "geglu": ("gelu", "linear"),
    "reglu": ("relu", "linear"),
    "qgeglu": ("quick_gelu", "linear"),
}


def activation_functions(activations: Union[str, Callable, Sequence[Union[str, Callable]]]
                         ) -> tuple[Callable, ...]:
  """Resolve `LayerNormMLP.activations` to functions (one per slice of `fc1`'s output)."""
  if isinstance(activations, str) or callable(activations):
    activations = (activations,)
  activations = tuple(activations)
  if len(activations) == 1 and isinstance(activations[0], str):
    activations = GATED_ACTIVATIONS.get(activations[0], activations)
  if not activations:
    raise ValueError("activations: expected at least one activation, got ()")
  functions = []
  for act in activations:
    if callable(act):
      functions.append(act)
    elif act in ACTIVATIONS:
      functions.append(ACTIVATIONS[act])
    else:
      raise ValueError(f"activations: unknown activation {act!r}; expected a callable, one of "
                       f"{sorted(ACTIVATIONS)}, or a gated shorthand {sorted(GATED_ACTIVATIONS)}")
  return tuple(functions)


def _norm_parameter_options(module: nn.Module) -> dict:
  return dict(use_scale=module.use_scale, use_bias=module.use_norm_bias,
              zero_centered_gamma=module.zero_centered_gamma, scale_init=module.scale_init,
              bias_init=module.norm_bias_init, param_dtype=module.param_dtype)


def _norm_spec(module: nn.Module) -> fusion.NormSpec:
  return fusion.NormSpec(module.norm_type, module.epsilon, module.zero_centered_gamma,
                         module.dtype)


def _apply_norm(module: nn.Module, x: jax.Array, scale, bias) -> jax.Array:
  """The unfused normalization (Flax's arithmetic)."""
  return apply_norm(x, scale, bias, norm_type=module.norm_type, epsilon=module.epsilon,
                    zero_centered_gamma=module.zero_centered_gamma, dtype=module.dtype)


class LayerNormDense(nn.Module):
  """LayerNorm (or RMSNorm) followed by a quantized dense layer over the last axis.

  Parameters: `scale` and `ln_bias` (the norm), `kernel [in, *features]` and `bias [*features]`
  (the dense layer). The contraction's roles are named after this module.

  Example::

    qkv = jaxquant.flax.LayerNormDense(3 * hidden, name="qkv")(x)

  Attributes:
    features: int or tuple of output features.
    norm_type: "layernorm" or "rmsnorm".
    epsilon: added to the variance.
    use_scale: whether the norm has a learned scale (`scale`).
    use_norm_bias: whether the norm has a learned bias (`ln_bias`).
    zero_centered_gamma: store the norm scale as `gamma - 1` (initialized to 0).
    scale_init: initializer of `scale` (None: ones, or zeros with `zero_centered_gamma`).
    norm_bias_init: initializer of `ln_bias`.
    use_bias: whether the dense layer adds a bias.
    kernel_init: initializer of the kernel (called on the flattened `[in, prod(features)]`).
    bias_init: initializer of the dense bias.
    return_layernorm_output: also return the normalized input: `(y, ln_out)`.
    dtype: computation dtype (None: inferred from inputs and params).
    param_dtype: dtype of the parameters.
    precision: precision of high-precision (Identity) contractions.
    recipe: quantization recipe; None: the innermost `jaxquant.autocast`, or no quantization.
    kernel_axes, input_axes, reduce_dtype: sharding under a mesh, as `jaxquant.flax.Dense`'s
      (`kernel_axes` names `(in, *features)`; the bias takes the feature names).
    fuse_producers: let the normalization kernel write the quantized input where the input
      format has fused kernels (`jaxquant.flax.fusion`): None (default): not yet (decision 20
      of docs/design.md), True: wherever the format allows, False never.
    split_output: return the first feature axis's entries as a tuple of arrays (a packed
      projection's q, k and v: `features=(3, heads, head_dim)`), their values the output's
      slices; their gradients reach the contraction apart, not joined by XLA outside it
      (`jaxquant.layers.split_output`).
  """

  features: Union[int, Sequence[int]]
  norm_type: str = "layernorm"
  epsilon: float = 1e-6
  use_scale: bool = True
  use_norm_bias: bool = True
  zero_centered_gamma: bool = False
  scale_init: Optional[Any] = None
  norm_bias_init: Any = nn.initializers.zeros_init()
  use_bias: bool = True
  kernel_init: Any = default_kernel_init
  bias_init: Any = nn.initializers.zeros_init()
  return_layernorm_output: bool = False
  dtype: Optional[Any] = None
  param_dtype: Any = jnp.float32
  precision: Any = None
  recipe: Optional[Recipe] = None
  kernel_axes: tuple = ()
  input_axes: tuple = ()
  reduce_dtype: Optional[Any] = None
  fuse_producers: Optional[bool] = None
  split_output: bool = False

  @nn.compact
  def __call__(self, inputs: jax.Array):
    check_norm_type(self.norm_type)
    features = _as_tuple(self.features, "features")
    epilogue = None
    if self.split_output:
      if len(features) < 2:
        raise ValueError(f"split_output: features={features} has one axis; split_output "
                         "returns the first of several (e.g. (3, heads, head_dim))")
      epilogue = SplitOutput()
    kernel_axes = tuple(self.kernel_axes)
    if kernel_axes and len(kernel_axes) != 1 + len(features):
      raise ValueError(f"kernel_axes={kernel_axes}: expected {1 + len(features)} names "
                       "(in, *features)")
    scale, ln_bias = norm_parameters(self, inputs.shape[-1], **_norm_parameter_options(self))
    kernel = self.param("kernel", logical_init(_flat_init(self.kernel_init, 0, 1, len(features)),
                                               kernel_axes),
                        (inputs.shape[-1],) + features, self.param_dtype)
    bias = None
    if self.use_bias:
      bias = self.param("bias", logical_init(_flat_init(self.bias_init, 0, None, len(features)),
                                             kernel_axes[1:]), features, self.param_dtype)
    fused = None
    if self.fuse_producers is not False:
      fused = fusion.layernorm_dense(self, inputs, _norm_spec(self), scale, ln_bias, kernel,
                                     bias, write_y=self.return_layernorm_output,
                                     epilogue=epilogue)
    if fused is not None:  # the norm kernel wrote the quantized input (jaxquant.flax.fusion)
      y, ln_out = fused
      return (y, ln_out) if self.return_layernorm_output else y
    ln_out = _apply_norm(self, inputs, scale, ln_bias)
    x, _, bias = nn.dtypes.promote_dtype(ln_out, kernel, bias, dtype=self.dtype)
    y = quantized_contraction(self, x, kernel, bias, precision=self.precision,  # as Dense's
                              epilogue=epilogue)
    return (y, ln_out) if self.return_layernorm_output else y


class LayerNormMLP(nn.Module):
  """LayerNorm (or RMSNorm), dense `fc1`, activation(s), dense `fc2`; both dense quantized.

  With one activation `fc1` is a `Dense(intermediate_dim)`; with several (a gated unit such as
  `"swiglu"` = `("silu", "linear")`) `fc1` is one `DenseGeneral((n, intermediate_dim))` GEMM
  whose `n` slices go through their activations and are multiplied. `fc2` maps back to the
  input width. Parameters: `scale`, `ln_bias`, `{fc1_name: {kernel, bias}}`,
  `{fc2_name: {kernel, bias}}`; roles are named `fc1_name` and `fc2_name`.

  Example::

    y = jaxquant.flax.LayerNormMLP(4 * hidden, activations="swiglu", name="mlp")(x)

  Attributes:
    intermediate_dim: width of the hidden layer.
    activations: an activation name, a gated shorthand ("swiglu", "geglu", "reglu",
      "qgeglu"), a callable, or a sequence of them (one per `fc1` slice, multiplied).
    fc1_name, fc2_name: names of the two dense submodules (and of their roles).
    norm_type, epsilon, use_scale, use_norm_bias, zero_centered_gamma, scale_init,
      norm_bias_init: the norm, as in `LayerNormDense`.
    use_bias: whether `fc1` and `fc2` add a bias.
    kernel_init, bias_init: initializers of both dense layers.
    return_layernorm_output: also return the normalized input: `(y, ln_out)`.
    dtype, param_dtype, precision: as in `Dense`.
    recipe: quantization recipe for both dense layers; None: the innermost `jaxquant.autocast`.
    input_axes: logical names of the input's axes (`fc1`'s input, as `Dense.input_axes`).
    hidden_axes: logical names of the hidden activation's axes (`fc2`'s input), e.g.
      `("batch", "length", "mlp")` for a tensor-parallel hidden layer.
    kernel_axes_1, kernel_axes_2: logical names `(in, hidden)` of `fc1`'s kernel and
      `(hidden, out)` of `fc2`'s (a gated `fc1` gets an unsharded middle axis).
    reduce_dtype: dtype of the partial-sum reductions of K-sharded GEMMs, as `Dense`'s.
    fuse_producers: let the normalization and activation kernels write the quantized copies
      the dense layers read where the formats have fused kernels (`jaxquant.flax.fusion`):
      None (default): not yet (decision 20 of docs/design.md), True: wherever the formats
      allow, False never.
    fuse_gemm_activation: apply the gelu in a kernel beside the quantized GEMMs: `fc1`'s GEMM
      epilogue, which writes `gelu(h)` and `h` (`jaxquant.ops.gemm_gelu`; per-tensor FP8 `fc1`
      operands, decision 60), or else `fc2`'s input quantize, whose whole-tile kernel computes
      an approximate gelu of `h` (a Float8Block 1x128 `fc2` input, decision 62); a gelu,
      bfloat16 outputs, an unsharded layer, the forward activation not fused by
      `fuse_producers`: None (default) the GEMM epilogue on CUDA (the quantize kernel's gelu
      measured no faster in the step), True wherever either applies, False never.
  """

  intermediate_dim: int = 2048
  activations: Union[str, Callable, Sequence[Union[str, Callable]]] = ("gelu",)
  fc1_name: str = "fc1"
  fc2_name: str = "fc2"
  norm_type: str = "layernorm"
  epsilon: float = 1e-6
  use_scale: bool = True
  use_norm_bias: bool = True
  zero_centered_gamma: bool = False
  scale_init: Optional[Any] = None
  norm_bias_init: Any = nn.initializers.zeros_init()
  use_bias: bool = True
  kernel_init: Any = default_kernel_init
  bias_init: Any = nn.initializers.zeros_init()
  return_layernorm_output: bool = False
  dtype: Optional[Any] = None
  param_dtype: Any = jnp.float32
  precision: Any = None
  recipe: Optional[Recipe] = None
  input_axes: tuple = ()
  hidden_axes: tuple = ()
  kernel_axes_1: tuple = ()
  kernel_axes_2: tuple = ()
  reduce_dtype: Optional[Any] = None
  fuse_producers: Optional[bool] = None
  fuse_gemm_activation: Optional[bool] = None

  @nn.compact
  def __call__(self, inputs: jax.Array):
    check_norm_type(self.norm_type)
    if self.fc1_name == self.fc2_name:
      raise ValueError(f"fc1_name and fc2_name are both {self.fc1_name!r}; the two dense layers "
                       "need distinct names")
    functions = activation_functions(self.activations)
    scale, ln_bias = norm_parameters(self, inputs.shape[-1], **_norm_parameter_options(self))
    common = dict(use_bias=self.use_bias, dtype=self.dtype, param_dtype=self.param_dtype,
                  precision=self.precision, kernel_init=self.kernel_init,
                  bias_init=self.bias_init, recipe=self.recipe, reduce_dtype=self.reduce_dtype)
    axes_1 = tuple(self.kernel_axes_1)
    gated_axes = axes_1[:1] + (None,) + axes_1[1:] if axes_1 else ()
    # the fused producers: jaxquant.flax.fusion
    may_fuse = self.fuse_producers is not False or self.fuse_gemm_activation is not False
    if may_fuse and fusion.mlp_quantizers(self) is not None:
      features_1 = ((len(functions), self.intermediate_dim) if len(functions) > 1
                    else (self.intermediate_dim,))
      fc1 = fusion.DenseParts(features_1, name=self.fc1_name,
                              kernel_axes=gated_axes if len(functions) > 1 else axes_1,
                              input_axes=tuple(self.input_axes), **common)
      fc2 = fusion.DenseParts((inputs.shape[-1],), name=self.fc2_name,
                              kernel_axes=tuple(self.kernel_axes_2),
                              input_axes=tuple(self.hidden_axes), **common)
      part1, part2 = fc1(inputs.shape[-1]), fc2(self.intermediate_dim)
      y, ln_out = fusion.layernorm_mlp(
          self, inputs, _norm_spec(self), scale, ln_bias, part1, part2,
          fusion.mlp_fusion_plan(self, part1, part2), functions=functions,
          write_y=self.return_layernorm_output,
          apply_norm=lambda x: _apply_norm(self, x, scale, ln_bias),
          weights=(fc1.quantized_weight, fc2.quantized_weight))
      return (y, ln_out) if self.return_layernorm_output else y
    ln_out = _apply_norm(self, inputs, scale, ln_bias)
    if len(functions) == 1:
      hidden = functions[0](Dense(self.intermediate_dim, name=self.fc1_name,
                                  kernel_axes=axes_1, input_axes=tuple(self.input_axes),
                                  **common)(ln_out))
    else:
      gates = DenseGeneral((len(functions), self.intermediate_dim), name=self.fc1_name,
                           kernel_axes=gated_axes, input_axes=tuple(self.input_axes),
                           **common)(ln_out)
      hidden = functools.reduce(operator.mul, [f(gates[..., i, :])
                                               for i, f in enumerate(functions)])
    y = Dense(inputs.shape[-1], name=self.fc2_name, kernel_axes=tuple(self.kernel_axes_2),
              input_axes=tuple(self.hidden_axes), **common)(hidden)
    return (y, ln_out) if self.return_layernorm_output else y
