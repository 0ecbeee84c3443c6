"""The grouped (mixture-of-experts) kernels of the FFI backend.

`ops` is what `jaxquant.grouped` dispatches through; `support` says which kernel serves a case
and, when none does, why (the reason `explain` prints); `quantize` quantizes tokens and expert
weights; `gemm` runs the ragged GEMMs in one launch.
"""
