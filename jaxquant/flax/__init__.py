"""Flax linen modules with quantized contractions, and helpers to train them.

Modules: `Dense`, `DenseGeneral` (same attributes and parameter trees as their `flax.linen`
namesakes, plus `recipe`), `LayerNormDense`, `LayerNormMLP`, `GroupedDense` (mixture-of-experts
experts); `Embed` (`nn.Embed` with its table gradient summed in float32, not bfloat16);
`quantize_dense(recipe)` swaps the `nn.Dense`, `nn.DenseGeneral` and `nn.Einsum`
layers of an unmodified model.
`apply_gradients` is the optax step that keeps the delayed-scaling state of the
`"_overwrite_with_gradient"` collection right; `quantize_weights` quantizes every weight once
for several passes (gradient accumulation).
"""

from jaxquant.flax.dense import Dense
from jaxquant.flax.dense_general import DenseGeneral
from jaxquant.flax.embed import Embed
from jaxquant.flax.grouped import GroupedDense
from jaxquant.flax.interception import quantize_dense
from jaxquant.flax.layernorm import (ACTIVATIONS, GATED_ACTIVATIONS, LayerNormDense,
                                     LayerNormMLP)
from jaxquant.flax.quantization import OVERWRITE_WITH_GRADIENT, QUANTIZE_RNG, WEIGHT_CACHE
from jaxquant.flax.training import apply_gradients, init_optimizer, quantize_weights

__all__ = ["Dense", "DenseGeneral", "Embed", "GroupedDense", "LayerNormDense", "LayerNormMLP",
           "quantize_dense", "apply_gradients", "init_optimizer", "ACTIVATIONS",
           "GATED_ACTIVATIONS", "OVERWRITE_WITH_GRADIENT", "QUANTIZE_RNG", "WEIGHT_CACHE",
           "quantize_weights"]
