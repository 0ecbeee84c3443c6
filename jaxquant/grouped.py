"""Grouped (mixture-of-experts) quantization: tokens sorted by group, one weight per group.

`quantize` quantizes tokens `x[T, C]` group by group (each group exactly as if alone) in one
program, `quantize_experts` quantizes `w[G, rows, cols]`, and `gemm` runs the ragged GEMMs
(`jax.lax.ragged_dot` semantics). `jaxquant.grouped_dense` builds the quantized grouped linear
layer from them and `jaxquant.flax.GroupedDense` is its module. Storages:
`GroupedScaledTensor` / `GroupedQuantizedTensor`; token layouts: `TokenLayout`.
"""

from jaxquant.grouped.layout import TokenLayout, clip_sizes
from jaxquant.grouped.tensors import GroupedQuantizedTensor, GroupedScaledTensor
from jaxquant.grouped.formats import token_block
from jaxquant.grouped.ops import check_group_sizes, gemm, quantize, quantize_experts, to_tokens
from jaxquant.grouped.state import init_state, update_state

__all__ = ["TokenLayout", "clip_sizes", "GroupedScaledTensor", "GroupedQuantizedTensor",
           "token_block", "check_group_sizes", "gemm", "quantize", "quantize_experts",
           "to_tokens", "init_state", "update_state"]
