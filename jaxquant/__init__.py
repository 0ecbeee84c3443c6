"""jaxquant: low-precision training for JAX/Flax with role-dispatched, per-direction quantization.

Quantizers describe formats; `jaxquant.ops` quantizes and multiplies (reference path everywhere,
FFI kernels where built); recipes map module roles to quantizers; `jaxquant.flax` has the linen
modules and `jaxquant.nnx` the Flax NNX ones. Both are imported on first attribute access
(`jaxquant.flax.Dense`), so `import jaxquant` does not import Flax.
"""

import importlib

from jaxquant import factories, formats, ops
from jaxquant.layers.dense import DenseQuantizers, dense, prepare_weight, remat_policy
from jaxquant.layers.shared_inputs import share_input_quantization
from jaxquant import grouped
from jaxquant.layers.grouped_dense import grouped_dense
from jaxquant.layers.grouped_dense import init_states as grouped_dense_states
from jaxquant.explain import Decision, Report, explain, explain_recording
from jaxquant.quantizers import (Float8BlockQuantizer, Float8CurrentScalingQuantizer,
                                 Float8DelayedScalingQuantizer, HybridQuantizer,
                                 IdentityQuantizer, MXFP8Quantizer, NVFP4Quantizer, Quantizer)
from jaxquant.recipes import (BUILTIN_RECIPES, CustomRecipe, DelayedScaling, Float8BlockScaling,
                              Float8CurrentScaling, MXFP8BlockScaling, NVFP4BlockScaling, Recipe,
                              autocast, current_recipe)
from jaxquant import recipes
from jaxquant.roles import QuantizerRole
from jaxquant.state import DelayedScalingState, delayed_scaling_update, init_state, update_state
from jaxquant.tensors import QuantizedTensor, ScaledTensor

__version__ = "0.1.0"

# Submodules that depend on Flax: imported on first use (`jq.flax.Dense(...)` after a plain
# `import jaxquant as jq`), not by `import jaxquant`.
_LAZY_SUBMODULES = ("flax", "nnx")


def __getattr__(name: str):
  if name in _LAZY_SUBMODULES:
    return importlib.import_module(f"{__name__}.{name}")  # also sets it as an attribute
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list:
  return sorted(set(globals()) | set(_LAZY_SUBMODULES))


__all__ = [
    "QuantizerRole", "Quantizer", "Float8CurrentScalingQuantizer",
    "Float8DelayedScalingQuantizer", "MXFP8Quantizer", "NVFP4Quantizer", "Float8BlockQuantizer",
    "IdentityQuantizer", "HybridQuantizer", "ScaledTensor", "QuantizedTensor", "Recipe",
    "CustomRecipe", "Float8CurrentScaling", "DelayedScaling", "MXFP8BlockScaling",
    "Float8BlockScaling", "NVFP4BlockScaling", "BUILTIN_RECIPES", "autocast", "current_recipe",
    "DelayedScalingState", "init_state", "delayed_scaling_update", "update_state", "explain",
    "explain_recording", "Decision", "Report", "factories", "formats", "ops", "recipes",
    "dense", "DenseQuantizers", "grouped", "grouped_dense", "grouped_dense_states",
    "prepare_weight", "remat_policy", "share_input_quantization",
]
