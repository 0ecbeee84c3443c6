"""Grouped quantization per format: each format's grouped reference applied to a token layout
whose groups must not share anything a format computes per tensor.

The math is the format's (`Format.grouped_quantize`, in `jaxquant.formats`): block-local formats
(MXFP8, Float8Block) run their reference unchanged on the padded layout; per-tensor FP8 and NVFP4
take one amax per group (so one scale, or one second-level scale, per group), NVFP4's stochastic
rounding draws each group's bits from that group's key at the token's index *within the group*.
The token-layout block a direction needs (`token_block`) is the format's too: blocks (and RHT
chunks) along the token axis must not straddle two groups. The result is bit-for-bit what
`jaxquant.ops.quantize` gives each group on its own.
"""

from __future__ import annotations

import jax

from jaxquant.formats import format_of
from jaxquant.formats.grouped import GroupedContext
from jaxquant.quantizers import Quantizer

__all__ = ["GroupedContext", "quantize", "token_block"]


def token_block(quantizer: Quantizer, direction: str) -> int:
  """The token-layout block `direction`'s copy needs: the scale block along the token axis
  (rows of a rowwise copy, columns of a columnwise copy), at least 16 under RHT."""
  return format_of(quantizer).token_block(quantizer, direction)


def quantize(mat: jax.Array, quantizer: Quantizer, ctx: GroupedContext):
  """(data, scale_inv, amax) of the layout matrix `mat` (see `GroupedContext`)."""
  return format_of(quantizer).grouped_quantize(mat, quantizer, ctx)
