"""NVFP4 storages decoded to bfloat16 by the kernel `jaxquant_grouped_decode_nvfp4`.

The grouped GEMMs on decoded operands (`decoded`) read bfloat16 raw values (payload times block
scale, exact). XLA's fused decode of the packed float4 payload ran at about half of the copy
rate on an H100 (1.6 TB/s, 0.74 ms for 8 experts' weights); the kernel decodes one 16-wide
block a thread (ffi/grouped/decode_nvfp4_cuda.cu) to the same bits. It takes NVFP4 storages
(1x16 or 16x16 blocks, row-scaled and RHT included: the raw values do not depend on them) whose
columns are whole blocks; other formats' decodes stay in XLA, which fuses them with their
neighbours (the MXFP8 experts' columnwise regroup) at ~2.5 TB/s.
"""

from __future__ import annotations

from typing import Optional, Union

import jax
import jax.numpy as jnp
import numpy as np

from jaxquant.backends.ffi import calls, registry
from jaxquant.backends.platform import current_platform
from jaxquant.formats import format_of
from jaxquant.grouping.tensors import GroupedScaledTensor, scale_blocks
from jaxquant.tensors import ScaledTensor

TARGET = "jaxquant_grouped_decode_nvfp4"
BLOCK = 16

Storage = Union[ScaledTensor, GroupedScaledTensor]


def reason(storage: Storage) -> Optional[str]:
  """Why the kernel does not decode `storage` (None: it does)."""
  if format_of(storage.quantizer).name != "nvfp4":
    return f"{format_of(storage.quantizer).name} is decoded by XLA"
  platform = current_platform()
  missing = registry.unserved_reason(platform)
  if missing is not None:
    return missing
  if TARGET not in registry.registered_targets(platform):
    return f"no {TARGET} in the jaxquant FFI extension for {platform}"
  cols = storage.data.shape[-1]
  if cols % BLOCK:
    return f"{cols} columns are not whole blocks of {BLOCK}"
  return None


def raw_bf16(storage: Storage) -> Optional[jax.Array]:
  """The raw values of `storage` (any leading axes) in bfloat16 from the kernel, or None where
  `reason` says XLA decodes them."""
  if reason(storage) is not None:
    return None
  data, scale_inv = storage.data, storage.scale_inv
  *lead, rows, cols = data.shape
  batch = int(np.prod(lead)) if lead else 1
  block_rows, _ = scale_blocks(storage.quantizer)
  out, = calls.call(TARGET, [jax.ShapeDtypeStruct((batch, rows, cols), jnp.bfloat16)],
                    data.reshape(batch, rows, cols),
                    scale_inv.reshape(batch, *scale_inv.shape[-2:]),
                    block_rows=np.int64(block_rows))
  return out.reshape(data.shape)


def slower_note(*operands) -> str:
  """For `jaxquant.explain`'s reason: the NVFP4 operands XLA decodes instead of the kernel, and
  why ("" when the kernel decodes every NVFP4 operand)."""
  parts = []
  for s in operands:
    if not isinstance(s, (ScaledTensor, GroupedScaledTensor)) or s.scale_inv is None or \
        format_of(s.quantizer).name != "nvfp4":
      continue
    why = reason(s)
    if why is not None:
      parts.append(f"NVFP4 operand {tuple(s.shape)} decoded by XLA, not {TARGET}: {why}")
  return "; ".join(parts)
