"""The FFI path: registers the extension's handlers with XLA and says what it can serve.

`available()` is False when the extension was not built (or registered nothing); the ops then
take the reference path and `jaxquant.explain` says why.
"""

from __future__ import annotations

import functools
from typing import Optional

import jax

try:
  from jaxquant import _jaxquant_ffi as _ext
except ImportError:  # extension not built
  _ext = None


@functools.lru_cache(maxsize=None)
def _registered_platforms() -> tuple[str, ...]:
  if _ext is None:
    return ()
  platforms = []
  for platform, targets in _ext.registrations().items():
    for name, capsule in targets.items():
      jax.ffi.register_ffi_target(name, capsule, platform=platform)
    if targets:
      platforms.append(platform)
  return tuple(platforms)


def available() -> bool:
  return bool(_registered_platforms())


def path_name() -> str:
  return "ffi"


def quantize_unsupported(x2d, quantizer, *, rowwise: bool, columnwise: bool) -> Optional[str]:
  return "the FFI quantize kernels are not built yet"


def transpose_unsupported(t) -> Optional[str]:
  return "the FFI transpose kernel is not built yet"


def gemm_unsupported(a, b) -> Optional[str]:
  return "the FFI GEMM is not built yet"
