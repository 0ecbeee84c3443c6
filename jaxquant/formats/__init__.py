"""Reference implementations of every format, registered by quantizer class."""

from jaxquant.formats.base import (Format, QuantizeContext, dequantize_scaled, format_of,
                                   register)
from jaxquant.formats import float8_block, float8_tensor, identity, mxfp8, nvfp4  # registers

__all__ = ["Format", "QuantizeContext", "dequantize_scaled", "format_of", "register"]
