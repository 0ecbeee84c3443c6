"""Choosing between the reference path and the FFI kernels.

`JAXQUANT_BACKEND` = `auto` (default: FFI where the extension is loaded and supports the case,
else reference), `reference`, or `ffi` (forcing the FFI where it cannot serve the case is an
error, never a silent fallback). Every choice is recorded for `jaxquant.explain`.
"""

from __future__ import annotations

import os
from typing import Optional

from jaxquant.backends.ffi import ops as ffi
from jaxquant.backends.ffi import registry
from jaxquant.backends.platform import current_platform

BACKENDS = ("auto", "reference", "ffi")


def requested_backend() -> str:
  value = os.environ.get("JAXQUANT_BACKEND", "auto").strip().lower() or "auto"
  if value not in BACKENDS:
    raise ValueError(f"JAXQUANT_BACKEND={value!r}; expected one of {BACKENDS}")
  return value


def ffi_module():
  """The FFI backend (`jaxquant.backends.ffi.ops`), or None when the extension is not built."""
  return ffi if ffi.available() else None


def ffi_missing_reason() -> str:
  """Why `ffi_module()` is None: the extension is not built, failed to load, or serves nothing."""
  return registry.unserved_reason(current_platform()) or "jaxquant FFI extension not built"


def choose(op: str, unsupported_reason: Optional[str]) -> tuple[str, str]:
  """("ffi" | "reference", reason) for an op whose FFI support check gave `unsupported_reason`
  (None = the FFI can serve it)."""
  mode = requested_backend()
  if mode == "reference":
    return "reference", "JAXQUANT_BACKEND=reference"
  if unsupported_reason is None:
    return "ffi", ""
  if mode == "ffi":
    raise RuntimeError(f"JAXQUANT_BACKEND=ffi, but the FFI path cannot serve this {op}: "
                       f"{unsupported_reason}. Unset JAXQUANT_BACKEND or set it to 'reference'.")
  return "reference", unsupported_reason
