"""The platform the ops are lowered for, in jaxquant's names ("cpu", "cuda", ...)."""

from __future__ import annotations

import jax


def current_platform() -> str:
  """The platform of jax's default backend: "cpu", "cuda", ..."""
  platform = jax.default_backend()
  return "cuda" if platform == "gpu" else platform
