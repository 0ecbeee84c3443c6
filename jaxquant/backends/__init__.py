"""Implementations behind `jaxquant.ops`' dispatch: reference (the spec), ffi (CUDA/CPU kernels
through the XLA FFI) and xla (the spec's math written so XLA fuses it into its neighbours)."""
