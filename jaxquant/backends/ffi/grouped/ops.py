"""The grouped FFI kernels' entry points for `jaxquant.grouped`: routes, reasons and the ops."""

from jaxquant.backends.ffi.gemm import fp8_accumulation
from jaxquant.backends.ffi.grouped.gemm import gemm
from jaxquant.backends.ffi.grouped.quantize import (pair_served, quantize_experts,
                                                    quantize_token_pair, quantize_tokens,
                                                    write_pending)
from jaxquant.backends.ffi.grouped.support import (DGRAD_COPY_ENV, GEMM_SM90_TARGET,
                                                   along_n_reason, dgrad_copy_choice,
                                                   expert_route, experts_along_n,
                                                   experts_read_transposed,
                                                   forward_reads_along_n,
                                                   fp8_kernel_note, gemm_kernel,
                                                   gemm_kernel_note, gemm_scaling,
                                                   gemm_unsupported, nvfp4_raw_reason,
                                                   quantize_experts_unsupported,
                                                   quantize_route, quantize_unsupported,
                                                   raw_copies_reason,
                                                   sm90_kernel_label, sm90_wgrad_block)

__all__ = ["fp8_accumulation", "gemm", "pair_served", "quantize_experts", "quantize_token_pair",
           "quantize_tokens", "write_pending", "DGRAD_COPY_ENV", "dgrad_copy_choice",
           "along_n_reason", "expert_route", "experts_along_n",
           "experts_read_transposed", "forward_reads_along_n",
           "fp8_kernel_note",
           "gemm_kernel", "gemm_kernel_note", "gemm_scaling", "gemm_unsupported",
           "nvfp4_raw_reason",
           "sm90_kernel_label", "sm90_wgrad_block", "quantize_experts_unsupported",
           "quantize_route", "quantize_unsupported", "raw_copies_reason", "GEMM_SM90_TARGET"]
