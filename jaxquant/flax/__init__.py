"""Flax linen modules with quantized contractions."""

from jaxquant.flax.dense import Dense
from jaxquant.flax.quantization import OVERWRITE_WITH_GRADIENT, QUANTIZE_RNG

__all__ = ["Dense", "OVERWRITE_WITH_GRADIENT", "QUANTIZE_RNG"]
