"""The FFI backend: the compiled extension's kernels, called through the XLA FFI.

`ops` is what `jaxquant.ops` dispatches through: whether the extension can serve a case
(`*_unsupported`, None when it can) and the ops themselves; `available()` is False when the
extension was not built (or registered nothing), and the ops then take the reference path with
`jaxquant.explain` saying why. The other modules: `registry` (loading and registering the
handlers), `targets` (plain `ffi_call`s), `partitioning` (sharded calls), `calls` (the two
combined, and the amax target), `quantize`, `transpose`, `gemm` (cuBLASLt and in-kernel
dequantization), `grouped/` (the mixture-of-experts kernels) and `debug` (probes for the tests).
"""
