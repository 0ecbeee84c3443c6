"""Recipe names on the command line: "bf16", the built-ins and the factory zoo.

Names are written with `_` (`fp8_current`); `-` is accepted for `_` (`fp8-current`)."""

from __future__ import annotations

from typing import Optional

import jaxquant

BASELINE = "bf16"  # no quantization: plain bfloat16 compute


def available() -> list[str]:
  """Every recipe name `--recipe` accepts, baseline first."""
  return [BASELINE, *jaxquant.BUILTIN_RECIPES, *jaxquant.factories.ZOO]


def canonical(name: str) -> str:
  """The recipe name with `-` read as `_` (`"fp8-current"` -> `"fp8_current"`)."""
  return name.strip().replace("-", "_")


def parse(spec: str) -> list[str]:
  """`"all"`, one name, or a comma-separated list -> recipe names (validated, order kept)."""
  names = [canonical(n) for n in spec.split(",") if n.strip()]
  if not names:
    raise ValueError(f"--recipe {spec!r}: expected a recipe name, a comma-separated list or "
                     "'all'")
  expanded: list[str] = []
  for name in names:
    for n in (available() if name == "all" else [name]):
      if n not in available():
        raise ValueError(f"--recipe: unknown recipe {n!r}; expected 'all' or one of "
                         f"{', '.join(available())}")
      if n not in expanded:
        expanded.append(n)
  return expanded


def make(name: str) -> Optional[jaxquant.Recipe]:
  """The recipe object for a name (None for the unquantized baseline)."""
  name = canonical(name)
  if name == BASELINE:
    return None
  if name in jaxquant.BUILTIN_RECIPES:
    return jaxquant.BUILTIN_RECIPES[name]()
  if name in jaxquant.factories.ZOO:
    return jaxquant.CustomRecipe(jaxquant.factories.ZOO[name])
  raise ValueError(f"unknown recipe {name!r}; expected one of {', '.join(available())}")
