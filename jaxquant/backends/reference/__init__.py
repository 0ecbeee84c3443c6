"""The reference backend: the spec of DESIGN.md section 3 in pure `jax.numpy`.

`ops` holds the single-tensor quantize / dequantize / GEMM, `grouped` the ragged GEMMs of the
mixture-of-experts ops. Both run on every platform and are what the kernels are tested against.
"""
