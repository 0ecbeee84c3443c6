"""The grouped (mixture-of-experts) kernels of the FFI backend: what `jaxquant.grouped` calls.

`support` says which kernel serves a case and, when none does, why (the reason `explain`
prints); `quantize` quantizes tokens and expert weights, `gemm` runs the ragged GEMMs in one
launch. This top level is the seam the grouped ops dispatch through.
"""

from jaxquant.backends.ffi.grouped.gemm import gemm
from jaxquant.backends.ffi.grouped.quantize import (quantize_experts, quantize_token_pair,
                                                    quantize_tokens)
from jaxquant.backends.ffi.grouped.support import (expert_route, gemm_scaling, gemm_unsupported,
                                                   quantize_experts_unsupported, quantize_route,
                                                   quantize_unsupported)

__all__ = ["gemm", "quantize_experts", "quantize_token_pair", "quantize_tokens", "expert_route",
           "gemm_scaling", "gemm_unsupported", "quantize_experts_unsupported", "quantize_route",
           "quantize_unsupported"]
