"""Flax NNX modules with a quantized contraction (see `jaxquant.nnx.linear`)."""

from jaxquant.nnx.linear import (GRAD_WRT, Linear, OverwriteWithGradient, apply_gradients,
                                 diff_state)

__all__ = ["Linear", "OverwriteWithGradient", "GRAD_WRT", "diff_state", "apply_gradients"]
