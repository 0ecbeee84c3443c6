"""Scalar and block math of every format, in pure `jax.numpy` (docs/design.md §5 "Numerics").

These functions are the numerical specification: the CUDA kernels and CPU handlers in `ffi/`
implement the same formulas from one C++ header (`ffi/jaxquant_numerics.h`) and are tested
against these bit-for-bit. Everything is float32 arithmetic with explicit, backend-independent
rounding (no reliance on XLA's own float32 -> float8 conversion).
"""

from jaxquant.numerics.minifloat import (E2M1, E4M3, E5M2, MinifloatSpec, decode, encode,
                                         spec_for_dtype)
from jaxquant.numerics.scales import (FLT_MAX, e8m0_decode_exponent, e8m0_from_amax,
                                      exp2i, nvfp4_block_decode_scale, nvfp4_block_encode_scale,
                                      nvfp4_global_encode_scale, scale_from_amax)
from jaxquant.numerics.hadamard import RHT_SIGNS, rht16, rht16_inverse
from jaxquant.numerics.random_bits import stochastic_round_bits
from jaxquant.numerics.division import ieee_div

__all__ = [
    "E2M1", "E4M3", "E5M2", "MinifloatSpec", "decode", "encode", "spec_for_dtype", "FLT_MAX",
    "e8m0_decode_exponent", "e8m0_from_amax", "exp2i", "nvfp4_block_decode_scale",
    "nvfp4_block_encode_scale", "nvfp4_global_encode_scale", "scale_from_amax", "RHT_SIGNS",
    "rht16", "rht16_inverse", "stochastic_round_bits", "ieee_div",
]
