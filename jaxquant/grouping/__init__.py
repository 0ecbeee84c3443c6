"""Grouped (mixture-of-experts) storage: how tokens sorted by expert are laid out and quantized.

`layout` (token layouts: packed, or each group padded to a block), `tensors` (the
`GroupedScaledTensor` / `GroupedQuantizedTensor` pytrees and their decoding), `formats` (the
reference grouped quantization of each format, the spec the grouped kernels match) and `state`
(per-group delayed scaling). The public grouped ops are `jaxquant.grouped`.
"""
