"""Quantizer roles: which tensor of which module a quantizer is for.

A recipe's factory receives a `QuantizerRole` (or `None` for slots whose consumer is unknown)
and returns the quantizer for that tensor. Roles are plain frozen dataclasses so factories can
dispatch on any field they care about and ignore the rest.
"""

from __future__ import annotations

import dataclasses

MODULE_TYPES = ("linear", "grouped_linear", "dpa")
TENSOR_TYPES = ("input", "weight", "grad_output")


@dataclasses.dataclass(frozen=True)
class QuantizerRole:
  """Names one quantized tensor of a module.

  Attributes:
    module_type: kind of module: "linear" (Dense, DenseGeneral, LayerNormDense, LayerNormMLP),
      "grouped_linear" (GroupedDense), room for "dpa".
    tensor_type: "input", "weight" or "grad_output".
    name: the module's short instance name ("fc1", "qkv", Flax's "Dense_0").
    path: the full module path ("Block_0/mlp/fc1"); informational, not used for equality of
      the short-name dispatch that factories usually do.
  """

  module_type: str = ""
  tensor_type: str = ""
  name: str = ""
  path: str = dataclasses.field(default="", compare=False)

  def __str__(self) -> str:
    return f"{self.module_type}/{self.path or self.name or '?'}/{self.tensor_type}"
