"""The quantized layers as `jax.custom_vjp` functions: `dense` and `grouped_dense`.

Forward quantizes the directions it needs and saves only the quantized columnwise operands;
backward quantizes `dy` and runs dgrad and wgrad (DESIGN.md section 5). The Flax and NNX modules
are thin wrappers around these.
"""
