"""The reference backend: the spec of docs/design.md §5 "Numerics" in pure `jax.numpy`.

`ops` holds the single-tensor quantize / dequantize / GEMM, `grouped` the ragged GEMMs of the
mixture-of-experts ops. Both run on every platform and are what the kernels are tested against.
"""
