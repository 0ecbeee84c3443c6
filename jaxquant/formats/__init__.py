"""Formats: one `Format` object per quantizer class, holding the format's reference math and
every fact the layers ask about it (`jaxquant.formats.base` says how to add a format).

`format_of(quantizer)` is the format of any quantizer (a Hybrid's delegates to its halves);
`registered()` lists them; `tests/test_format_completeness.py` checks that each is served, or
rejected with a reason, by every layer.
"""

from jaxquant.formats.base import (Format, QuantizeContext, dequantize_scaled, format_of,
                                   register, registered, unregister)
# Importing a format module registers its format; the Hybrid's delegates to the others.
from jaxquant.formats import float8_block, float8_tensor, identity, mxfp8, nvfp4  # noqa: F401
from jaxquant.formats import hybrid  # noqa: F401

__all__ = ["Format", "QuantizeContext", "dequantize_scaled", "format_of", "register",
           "registered", "unregister"]
