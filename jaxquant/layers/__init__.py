"""The quantized layers as functions built on `jaxquant.ops`.

`dense` and `grouped_dense` are `jax.custom_vjp`s: the forward quantizes the directions it needs
and saves only the quantized columnwise operands; the backward quantizes `dy` and runs dgrad and
wgrad (docs/design.md §2.3 "The quantized contraction: `dense`"). `einsum` maps an
activation-weight einsum onto `dense`; `collective_gemm` reduces K-sharded GEMMs under a mesh.
The Flax and NNX modules are thin wrappers around these.
"""
