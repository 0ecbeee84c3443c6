"""Flax NNX: modules with a quantized contraction, and `quantize_model` to swap them into an
unmodified NNX model (see `jaxquant.nnx.swap`); `Embed`, `nnx.Embed` with its table gradient
summed in float32."""

from jaxquant.nnx.einsum import Einsum
from jaxquant.nnx.embed import Embed
from jaxquant.nnx.linear import Linear
from jaxquant.nnx.linear_general import LinearGeneral
from jaxquant.nnx.swap import Swap, quantize_model
from jaxquant.nnx.training import GRAD_WRT, OverwriteWithGradient, apply_gradients, diff_state

__all__ = ["Linear", "LinearGeneral", "Einsum", "Embed", "quantize_model", "Swap",
           "OverwriteWithGradient", "GRAD_WRT", "diff_state", "apply_gradients"]
