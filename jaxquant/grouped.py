"""Grouped (mixture-of-experts) quantization: tokens sorted by group, one weight per group.

`quantize` quantizes tokens `x[T, C]` group by group (each group exactly as if alone) in one
program, `quantize_experts` quantizes `w[G, rows, cols]`, and `gemm` runs the ragged GEMMs
(`jax.lax.ragged_dot` semantics). `jaxquant.grouped_dense` builds the quantized grouped linear
layer from them and `jaxquant.flax.GroupedDense` is its module. Storages:
`GroupedScaledTensor` / `GroupedQuantizedTensor`; token layouts: `TokenLayout`.
"""

from jaxquant.grouping.layout import TokenLayout, clip_sizes
from jaxquant.grouping.tensors import GroupedQuantizedTensor, GroupedScaledTensor
from jaxquant.grouping.formats import token_block
from jaxquant.ops.grouped import check_group_sizes, gemm, quantize, quantize_experts, to_tokens
from jaxquant.grouping.state import init_state, update_state

__all__ = ["TokenLayout", "clip_sizes", "GroupedScaledTensor", "GroupedQuantizedTensor",
           "token_block", "check_group_sizes", "gemm", "quantize", "quantize_experts",
           "to_tokens", "init_state", "update_state"]
