"""Recipes: which quantizer serves each role, and `autocast` to hand one to modules.

A recipe is a frozen value with one method, `quantizer(role)`. The built-ins are thin wrappers
over the reference factories in `jaxquant.factories`; `CustomRecipe` takes any user factory.
`autocast(recipe)` sets the recipe that modules without a `recipe=` attribute use while they are
traced (a context variable, so it is per thread and nests).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Callable, Iterator, Optional

import jax

from jaxquant import factories
from jaxquant.quantizers import Quantizer, check_first_scale
from jaxquant.roles import QuantizerRole


class Recipe:
  """Base class: maps a `QuantizerRole` (or None) to a `Quantizer`."""

  def factory(self) -> Callable[[Optional[QuantizerRole]], Quantizer]:
    raise NotImplementedError

  def quantizer(self, role: Optional[QuantizerRole]) -> Quantizer:
    quantizer = self.factory()(role)
    if not isinstance(quantizer, Quantizer):
      raise TypeError(f"{type(self).__name__}: the factory returned {quantizer!r} "
                      f"({type(quantizer).__name__}) for role {role!r}; a factory must return "
                      "a jaxquant Quantizer (e.g. jaxquant.IdentityQuantizer() to leave a "
                      "tensor unquantized)")
    return quantizer


@dataclasses.dataclass(frozen=True)
class CustomRecipe(Recipe):
  """A recipe from a user factory `qfactory(role_or_None) -> Quantizer`."""

  qfactory: Callable[[Optional[QuantizerRole]], Quantizer]

  def __post_init__(self):
    if not callable(self.qfactory):
      raise TypeError(f"CustomRecipe: qfactory={self.qfactory!r} is not callable; expected a "
                      "function role -> Quantizer")

  def factory(self):
    return self.qfactory


@dataclasses.dataclass(frozen=True)
class Float8CurrentScaling(Recipe):
  fp8_format: str = "HYBRID"
  pow2_scale: bool = False
  amax_epsilon: float = 0.0

  def factory(self):
    return functools.partial(factories.float8_current_scaling, fp8_format=self.fp8_format,
                             pow2_scale=self.pow2_scale, amax_epsilon=self.amax_epsilon)


@dataclasses.dataclass(frozen=True)
class DelayedScaling(Recipe):
  """Per-tensor FP8 with scales from an amax history (TransformerEngine's `DelayedScaling`).

  `first_scale="current"` (default) quantizes each tensor's first step with the scale of its own
  amax (as `Float8CurrentScaling` would), so step 1 matches current scaling bit for bit;
  `first_scale="one"` keeps TransformerEngine's scale-1 start.
  """

  fp8_format: str = "HYBRID"
  margin: int = 0
  amax_history_len: int = 1024
  amax_compute_algo: str = "max"
  first_scale: str = "current"

  def __post_init__(self):
    check_first_scale(self.first_scale, type(self).__name__)

  def factory(self):
    return functools.partial(factories.delayed_scaling, fp8_format=self.fp8_format,
                             margin=self.margin, amax_history_len=self.amax_history_len,
                             amax_compute_algo=self.amax_compute_algo,
                             first_scale=self.first_scale)


@dataclasses.dataclass(frozen=True)
class MXFP8BlockScaling(Recipe):
  fp8_format: str = "E4M3"

  def factory(self):
    return functools.partial(factories.mxfp8_block_scaling, fp8_format=self.fp8_format)


@dataclasses.dataclass(frozen=True)
class Float8BlockScaling(Recipe):
  fp8_format: str = "E4M3"
  x_block_scaling_dim: int = 1
  w_block_scaling_dim: int = 2
  grad_block_scaling_dim: int = 1
  pow2_scale: bool = True
  amax_epsilon: float = 0.0

  def factory(self):
    return functools.partial(
        factories.float8_block_scaling, fp8_format=self.fp8_format,
        x_block_scaling_dim=self.x_block_scaling_dim,
        w_block_scaling_dim=self.w_block_scaling_dim,
        grad_block_scaling_dim=self.grad_block_scaling_dim, pow2_scale=self.pow2_scale,
        amax_epsilon=self.amax_epsilon)


@dataclasses.dataclass(frozen=True)
class NVFP4BlockScaling(Recipe):
  disable_rht: bool = False
  disable_stochastic_rounding: bool = False
  disable_2d_quantization: bool = False
  row_scaled_activation: bool = False

  def factory(self):
    return functools.partial(
        factories.nvfp4_block_scaling, disable_rht=self.disable_rht,
        disable_stochastic_rounding=self.disable_stochastic_rounding,
        disable_2d_quantization=self.disable_2d_quantization,
        row_scaled_activation=self.row_scaled_activation)


BUILTIN_RECIPES = {
    "fp8_current": Float8CurrentScaling,
    "fp8_delayed": DelayedScaling,
    "mxfp8": MXFP8BlockScaling,
    "fp8_block": Float8BlockScaling,
    "nvfp4": NVFP4BlockScaling,
}

# The active recipe is part of `jax.jit`'s cache key, so a function traced under one recipe is
# re-traced (not silently reused) under another.
_CURRENT = jax.make_user_context(default_value=None)


@contextlib.contextmanager
def autocast(recipe: Optional[Recipe]) -> Iterator[Optional[Recipe]]:
  """Use `recipe` for modules traced inside this block (None: no quantization)."""
  if recipe is not None and not isinstance(recipe, Recipe):
    raise TypeError(f"recipe: expected a jaxquant Recipe or None, got {type(recipe).__name__}")
  with _CURRENT(recipe):
    yield recipe


def current_recipe() -> Optional[Recipe]:
  """The recipe set by the innermost `autocast`, or None."""
  return _CURRENT.value
