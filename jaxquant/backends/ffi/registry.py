"""Loading `jaxquant._jaxquant_ffi` and registering its handlers with XLA, once per process."""

from __future__ import annotations

import functools
import warnings
from typing import Optional

import jax

try:
  from jaxquant import _jaxquant_ffi as _ext
  _LOAD_ERROR = None
except ModuleNotFoundError as err:  # extension not built
  _ext, _LOAD_ERROR = None, None if err.name == "jaxquant._jaxquant_ffi" else err
except ImportError as err:  # built, but cannot be loaded (e.g. cuBLASLt missing at run time)
  _ext, _LOAD_ERROR = None, err
if _LOAD_ERROR is not None:
  warnings.warn(
      f"jaxquant: the FFI extension is built but failed to load ({_LOAD_ERROR}); the ops take "
      "the reference path. If libcublasLt is missing: pip install nvidia-cublas (the cuda "
      "extra brings it), or reinstall with -C cmake.define.JAXQUANT_CUDA=OFF.", RuntimeWarning,
      stacklevel=2)

# XLA platform names (as registered) for jaxquant's platform names (`platform.current_platform`).
_XLA_PLATFORM = {"cpu": "cpu", "cuda": "CUDA"}


@functools.lru_cache(maxsize=None)
def registered_platforms() -> tuple[str, ...]:
  """XLA platforms ("cpu", "CUDA") whose handlers were registered; () without the extension."""
  if _ext is None:
    return ()
  platforms = []
  for platform, targets in _ext.registrations().items():
    for name, capsule in targets.items():
      jax.ffi.register_ffi_target(name, capsule, platform=platform)
    if targets:
      platforms.append(platform)
  return tuple(platforms)


@functools.lru_cache(maxsize=None)
def registered_targets(platform: str) -> frozenset:
  """Names of the targets registered for jaxquant platform `platform` ("cpu", "cuda")."""
  xla_platform = _XLA_PLATFORM.get(platform)
  if xla_platform is None or xla_platform not in registered_platforms():
    return frozenset()
  return frozenset(_ext.registrations()[xla_platform])


def extension_function(name: str):
  """The extension's module-level function `name`, or None (not built, or built without it)."""
  return getattr(_ext, name, None) if _ext is not None else None


def extension_built() -> bool:
  return _ext is not None


def unserved_reason(platform: str) -> Optional[str]:
  """None when the extension has handlers for `platform` ("cpu", "cuda"), else why not."""
  if _ext is None:
    if _LOAD_ERROR is not None:
      return f"jaxquant FFI extension failed to load: {_LOAD_ERROR}"
    return "jaxquant FFI extension not built"
  xla_platform = _XLA_PLATFORM.get(platform)
  if xla_platform is None or xla_platform not in registered_platforms():
    built = ", ".join(registered_platforms()) or "none"
    hint = " (it was built without nvcc)" if platform == "cuda" else ""
    return f"the jaxquant FFI extension has no {platform} handlers{hint}; built for: {built}"
  return None
