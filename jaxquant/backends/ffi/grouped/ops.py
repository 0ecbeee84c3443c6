"""The grouped FFI kernels' entry points for `jaxquant.grouped`: routes, reasons and the ops."""

from jaxquant.backends.ffi.grouped.gemm import gemm
from jaxquant.backends.ffi.grouped.quantize import (quantize_experts, quantize_token_pair,
                                                    quantize_tokens)
from jaxquant.backends.ffi.grouped.support import (expert_route, gemm_scaling, gemm_unsupported,
                                                   quantize_experts_unsupported, quantize_route,
                                                   quantize_unsupported)

__all__ = ["gemm", "quantize_experts", "quantize_token_pair", "quantize_tokens", "expert_route",
           "gemm_scaling", "gemm_unsupported", "quantize_experts_unsupported", "quantize_route",
           "quantize_unsupported"]
