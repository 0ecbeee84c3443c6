"""The FFI kernels' Python side: loading the extension, and one `ffi_call` wrapper per target.

`jaxquant.ffi_bindings` is the seam the ops dispatch through; this package holds the pieces:
`registry` (which platforms the built extension serves), `quantize` (per-format wrappers that
return the same `ScaledTensor`s as the reference), `transpose`, and `debug` (storage and encoder
probes used by the tests).
"""
