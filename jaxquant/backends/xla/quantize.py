"""Per-tensor FP8 quantize (current and delayed scaling) as plain XLA ops that fuse with their
neighbours, bit-exact with `jaxquant.ops.reference`.

The reference's quantize is a chain of bit manipulations written for clarity; this is the same
function in the form XLA fuses best:
  amax      = max |x| over the tensor (the reference's NaN-propagating max over the bits of |x|),
              a reduction XLA fuses into the fusion that produces x;
  scale     = the spec's `scale_from_amax` (current) or the state's scale (delayed): scalars,
              through the spec's exact division;
  q         = convert(clamp(x * scale, -fmax, fmax)) with NaN mapped to the spec's NaN code: an
              elementwise chain XLA fuses into the producer of x (or its consumer); the
              columnwise copy is the same bytes transposed (per-tensor scales commute with the
              transpose), by the transpose op or by XLA (`JAXQUANT_XLA_COLUMNWISE`).
The clamp makes the convert saturating, and XLA's float32 -> FP8 convert rounds to nearest
even once (tested bit for bit against the reference on CPU and GPU, special values included),
so `q` equals the reference's `cast_sat`. Under a mesh the amax reduction is partitioned by XLA
(a global max), as on the reference path.
"""

from __future__ import annotations

from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxquant.formats import format_of
from jaxquant.formats.base import tensor_amax
from jaxquant.numerics import scale_from_amax, spec_for_dtype
from jaxquant.numerics.division import ieee_div
from jaxquant.numerics.minifloat import MinifloatSpec
from jaxquant.quantizers import HIGH_PRECISION_DTYPES, Quantizer
from jaxquant.state import DelayedScalingState, quantize_scale
from jaxquant.tensors import ScaledTensor
from jaxquant.settings import env_choice

PATH_NAME = "xla-fused"

# How the columnwise (transposed) copy is made, `JAXQUANT_XLA_COLUMNWISE`:
#   transpose-op: the rowwise bytes through `jaxquant.ops.transpose` (the FFI byte-transpose
#                 kernel where built), so XLA fuses only the rowwise quantize into the producer;
#   fused:        `q.T` left to XLA, which emits quantize and transpose from one fusion.
# H100, bench/e2e.py d2048 step (bench/RESULTS.md): transpose-op 68.3 ms, fused 63.9 ms against
# the FFI kernel's 67.4 / 55.2 ms in the same runs; an XLA transpose of the materialized bytes
# measured worse still (77.9 vs 66.6 ms) and was dropped.
COLUMNWISE_MODES = ("transpose-op", "fused")
DEFAULT_COLUMNWISE = "transpose-op"


def columnwise_mode() -> str:
  return env_choice("JAXQUANT_XLA_COLUMNWISE", COLUMNWISE_MODES, DEFAULT_COLUMNWISE)

# Where the automatic choice takes this path over the FFI kernel, and why: {platform: {quantizer
# type: reason}}. Empty: measured in the training step of bench/e2e.py on an H100 (d_model 2048
# LM, bench/RESULTS.md "End-to-end training step"), the XLA-fused quantize was no faster than
# the FFI kernels (current scaling 68.3 vs 67.4 ms, delayed 68.7 vs 66.6 ms per step): XLA keeps
# the amax reduction and the scale-and-convert in fusions of their own rather than inside the
# producers, so it moves as many bytes as the kernels, in more launches. It stays selectable
# (`JAXQUANT_BACKEND=xla`) for platforms and XLA versions where that changes.
_AUTO: dict[str, dict[type, str]] = {}


def unsupported(x2d, quantizer: Quantizer, *, rowwise: bool, columnwise: bool) -> Optional[str]:
  """None when this path serves the quantize, else why not."""
  del rowwise, columnwise  # both directions come from the same fusion
  if not format_of(quantizer).xla_fused(quantizer):
    return (f"no XLA-fused form for {type(quantizer).__name__} (only per-tensor FP8: "
            "Float8CurrentScalingQuantizer, Float8DelayedScalingQuantizer)")
  if x2d.ndim != 2:
    return f"expected a 2-D matrix, got shape {tuple(x2d.shape)}"
  if np.dtype(x2d.dtype) not in HIGH_PRECISION_DTYPES:
    return f"reads bfloat16/float16/float32, not {np.dtype(x2d.dtype).name}"
  return None


def auto_reason(quantizer: Quantizer, platform: str) -> Optional[str]:
  """Why the automatic choice takes this path for `quantizer` on `platform`, or None when it
  prefers the FFI kernel there."""
  return _AUTO.get(platform, {}).get(type(quantizer))


def cast_sat(v: jax.Array, spec: MinifloatSpec) -> jax.Array:
  """The spec's RNE saturating cast of float32 `v` (NaN -> the format's NaN code) as fusible
  XLA ops: clamp to +-fmax, convert, and a select for NaN (whose sign and payload XLA's
  convert may keep)."""
  clamped = jnp.clip(v, -spec.fmax, spec.fmax)
  nan = lax.bitcast_convert_type(jnp.uint8(spec.nan_code), spec.dtype)
  return jnp.where(jnp.isnan(v), nan, clamped.astype(spec.dtype))


def _scale(x2d, quantizer, state) -> tuple[jax.Array, jax.Array]:
  """(scale, amax) of per-tensor FP8: from this tensor's amax, or the delayed state's scale."""
  amax = tensor_amax(x2d)
  if format_of(quantizer).stateful(quantizer):  # delayed scaling
    if not isinstance(state, DelayedScalingState):
      raise ValueError("state: Float8DelayedScalingQuantizer needs its DelayedScalingState "
                       f"(jaxquant.init_state(quantizer)); got {type(state).__name__}")
    # A state with no scale yet takes it from this amax (first_scale="current"); XLA then has
    # to finish the reduction before the quantize, as for current scaling.
    return quantize_scale(state.scale.reshape(()), amax, quantizer), amax
  scale = scale_from_amax(amax, spec_for_dtype(quantizer.dtype).fmax,
                          pow2_scale=quantizer.pow2_scale, amax_epsilon=quantizer.amax_epsilon)
  return scale, amax


def quantize_single(x2d, quantizer: Quantizer, *, rowwise: bool, columnwise: bool,
                    orig_dtype: Any, row_key_words=None, col_key_words=None,
                    state=None) -> tuple[Optional[ScaledTensor], Optional[ScaledTensor]]:
  """Same contract as `jaxquant.ops.reference.quantize_single` (rowwise `[rows, cols]`,
  columnwise `[cols, rows]`), for per-tensor FP8."""
  del row_key_words, col_key_words  # per-tensor FP8 rounds to nearest
  reason = unsupported(x2d, quantizer, rowwise=rowwise, columnwise=columnwise)
  if reason is not None:
    raise ValueError(f"the XLA-fused quantize cannot serve {quantizer}: {reason}")
  scale, amax = _scale(x2d, quantizer, state)
  data = cast_sat(x2d.astype(jnp.float32) * scale, spec_for_dtype(quantizer.dtype))
  scale_inv = ieee_div(jnp.float32(1.0), scale)
  make = lambda d: ScaledTensor(d, scale_inv, amax, quantizer, orig_dtype, False)
  col = None
  if columnwise:
    col = make(data.T)
  return (make(data) if rowwise else None, col)
