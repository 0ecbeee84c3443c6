"""The platform the ops are lowered for, in jaxquant's names ("cpu", "cuda", ...), and the GPU's
compute capability (which kernels can run)."""

from __future__ import annotations

import functools
from typing import Optional

import jax


def current_platform() -> str:
  """The platform of jax's default backend: "cpu", "cuda", ..."""
  platform = jax.default_backend()
  return "cuda" if platform == "gpu" else platform


@functools.lru_cache(maxsize=None)
def compute_capability() -> Optional[tuple[int, int]]:
  """(major, minor) of the first GPU, None without one."""
  try:
    devices = jax.devices("gpu")
  except RuntimeError:
    return None
  cc = getattr(devices[0], "compute_capability", None) if devices else None
  if not cc:
    return None
  major, minor = str(cc).split(".")[:2]
  return int(major), int(minor)
