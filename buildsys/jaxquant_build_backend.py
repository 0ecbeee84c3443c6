"""PEP 517 build backend: scikit-build-core, plus the pip cuBLAS wheel where CUDA is compiled.

The CUDA GEMM kernels link cuBLASLt from the pip `nvidia-cublas` wheel (CMakeLists.txt). In an
isolated build (pip's default) the build environment holds only the build requirements, so this
wrapper adds `nvidia-cublas` to them when the CUDA kernels will be compiled: a CUDA compiler is
found the way CMake looks for one first (`$CUDACXX`, `nvcc` on `PATH`,
`/usr/local/cuda/bin/nvcc`) and neither `JAXQUANT_CUDA` nor `JAXQUANT_GEMM` is switched off
(`-C cmake.define.JAXQUANT_CUDA=OFF`, or `-DJAXQUANT_CUDA=OFF` in `$CMAKE_ARGS`). Everything
else is scikit-build-core's.
"""

from __future__ import annotations

import os
import re
import shutil
from typing import Any, Optional

from scikit_build_core import build as _skbuild
from scikit_build_core.build import *  # noqa: F401,F403  (the PEP 517 hooks)

# The wheel cuBLASLt comes from (CUDA 13: libcublasLt.so.13 in nvidia/cu13/lib).
CUBLAS_REQUIREMENT = "nvidia-cublas>=13.0,<14"
_OFF = {"off", "0", "false", "no", "n"}


def cuda_compiler() -> Optional[str]:
  """The CUDA compiler CMake would find first, or None."""
  for candidate in (os.environ.get("CUDACXX"), shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc"):
    if candidate and os.path.isfile(candidate) and os.access(candidate, os.X_OK):
      return candidate
  return None


def _switched_off(option: str, config_settings: Optional[dict[str, Any]]) -> bool:
  """Whether `-C cmake.define.<option>=OFF` or `-D<option>=OFF` in `$CMAKE_ARGS` was given."""
  key = f"cmake.define.{option}".lower()
  for name, value in (config_settings or {}).items():
    if name.lower().replace("-", "_") == key and str(value).strip().lower() in _OFF:
      return True
  match = re.search(rf"-D\s*{option}(?::BOOL)?=(\w+)", os.environ.get("CMAKE_ARGS", ""))
  return bool(match and match.group(1).lower() in _OFF)


def needs_cublas(config_settings: Optional[dict[str, Any]] = None) -> bool:
  """Whether this build compiles the CUDA GEMM kernels (and so needs cuBLASLt)."""
  return (cuda_compiler() is not None and not _switched_off("JAXQUANT_CUDA", config_settings)
          and not _switched_off("JAXQUANT_GEMM", config_settings))


def get_requires_for_build_wheel(config_settings=None) -> list[str]:
  extra = [CUBLAS_REQUIREMENT] if needs_cublas(config_settings) else []
  return [*_skbuild.get_requires_for_build_wheel(config_settings), *extra]


def get_requires_for_build_editable(config_settings=None) -> list[str]:
  extra = [CUBLAS_REQUIREMENT] if needs_cublas(config_settings) else []
  return [*_skbuild.get_requires_for_build_editable(config_settings), *extra]
