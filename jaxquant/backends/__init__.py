"""The implementations behind `jaxquant.ops`: one sub-package per backend.

* `reference`: pure `jax.numpy`, runs on every platform; it is the numerical specification.
* `ffi`: the CUDA (and CPU) kernels of the compiled extension, called through the XLA FFI and
  partitioned with `custom_partitioning`.
* `xla`: the spec's math written so XLA fuses it into its neighbours (per-tensor FP8 quantize).

`jaxquant.ops.dispatch` chooses between them per op and case; `platform` says what the ops are
lowered for.
"""
