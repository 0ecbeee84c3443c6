"""The FFI seam of the grouped ops: where grouped CUDA kernels plug in.

Planned targets (the GPU follow-up of issue 7; none is built yet):

  jaxquant_grouped_quantize_<format>  one launch for all groups: reads `x[T, C]` and
      `group_sizes[G]`, writes the rowwise copy and the transposed columnwise copy in the padded
      token layout (`jaxquant.grouped.layout`) with per-group amax / scales, bit-for-bit the
      reference of `jaxquant.grouped.formats`.
  jaxquant_grouped_gemm  the ragged GEMMs of `jaxquant.grouped.gemm` in one launch (a
      persistent grouped kernel, or cuBLASLt's grouped mode where the cuBLASLt version has it),
      with the per-group / per-token factors in the epilogue.

Each `*_unsupported` function returns None when a kernel can serve the case, else the reason
the reference path is taken; `jaxquant.explain` prints that reason, and `JAXQUANT_BACKEND=ffi`
turns it into an error (never a silent fallback). The reference path computes every group in one
program (one `jax.lax.ragged_dot` per GEMM), never a Python loop over groups.
"""

from __future__ import annotations

import functools
from typing import Optional

from jaxquant.kernels import registry

QUANTIZE_TARGET_PREFIX = "jaxquant_grouped_quantize"
GEMM_TARGET = "jaxquant_grouped_gemm"


def _platform() -> str:
  from jaxquant.ops.dispatch import current_platform
  return current_platform()


@functools.lru_cache(maxsize=None)
def _targets(platform: str) -> frozenset:
  """Grouped targets the extension registered for `platform`."""
  if not registry.extension_built() or not registry.registered_platforms():
    return frozenset()
  from jaxquant import _jaxquant_ffi as ext
  names = set()
  for name, targets in ext.registrations().items():
    if name.lower() == platform.lower():
      names |= {t for t in targets if t.startswith(("jaxquant_grouped_",))}
  return frozenset(names)


def _missing(target: str) -> Optional[str]:
  platform = _platform()
  reason = registry.unserved_reason(platform)
  if reason is not None:
    return reason
  if not any(t.startswith(target) for t in _targets(platform)):
    return (f"no grouped kernel ({target}) in the jaxquant FFI extension for {platform} yet; "
            "the reference computes all groups in one program")
  return None


def quantize_unsupported(quantizer, direction: str) -> Optional[str]:
  """Why grouped quantize of tokens with `quantizer` in `direction` cannot run on the FFI."""
  return _missing(QUANTIZE_TARGET_PREFIX)


def quantize_experts_unsupported(quantizer) -> Optional[str]:
  """Why the expert weights `[G, rows, cols]` cannot be quantized by one FFI launch."""
  return _missing(QUANTIZE_TARGET_PREFIX)


def gemm_unsupported(a, b) -> Optional[str]:
  """Why a grouped GEMM of `a` and `b` cannot run on the FFI."""
  return _missing(GEMM_TARGET)


def _not_built(*args, **kwargs):
  raise NotImplementedError("the grouped FFI kernels are not built yet (issue 7, GPU part)")


quantize_tokens = quantize_experts = gemm = _not_built
