"""Block-scaled storages decoded to bfloat16 by jaxquant's decode kernels.

The grouped GEMMs on decoded operands (`decoded`) read bfloat16 raw values (payload times block
scale). XLA's fused decodes ran below the copy rate on an H100: NVFP4's packed float4 at ~1.6
TB/s (4 values a thread), MXFP8's at ~2.5 TB/s. The kernels (ffi/grouped/decode_cuda.cu)
give a thread 16 values of one block and write the same bits as XLA's decode:

  jaxquant_grouped_decode_nvfp4  NVFP4 (1x16 or 16x16 blocks; row-scaled, RHT and stochastic
      rounding change nothing here), columns whole 16-blocks; the values are exact in bfloat16;
  jaxquant_grouped_decode_mxfp8  MXFP8 (E4M3 / E5M2 x E8M0), columns a multiple of 16: the
      float32 product rounded once to bfloat16, as XLA's decode (exact above 2^-126).

A storage the kernels do not take stays with XLA, and `slower_note` names it for explain. A
storage its quantize kernel wrote raw (`Format.stores_raw`) is its own decode.
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

NVFP4_TARGET = "jaxquant_grouped_decode_nvfp4"
MXFP8_TARGET = "jaxquant_grouped_decode_mxfp8"
TARGETS = {"nvfp4": NVFP4_TARGET, "mxfp8": MXFP8_TARGET}
CHUNK = 16  # values a thread decodes; the columns must be whole chunks

Storage = Union[ScaledTensor, GroupedScaledTensor]


def reason(storage: Storage) -> Optional[str]:
  """Why no kernel decodes `storage` (None: one does, or its quantize kernel already did)."""
  if format_of(storage.quantizer).stores_raw(storage):
    return None
  name = format_of(storage.quantizer).name
  target = TARGETS.get(name)
  if target is None:
    return f"{name} is decoded by XLA"
  platform = current_platform()
  missing = registry.unserved_reason(platform)
  if missing is not None:
    return missing
  if target not in registry.registered_targets(platform):
    return f"no {target} in the jaxquant FFI extension for {platform}"
  cols = storage.data.shape[-1]
  if cols % CHUNK:
    return f"{cols} columns are not whole chunks of {CHUNK}"
  return None


def raw_bf16(storage: Storage) -> Optional[jax.Array]:
  """The raw values of `storage` (any leading axes) in bfloat16 from a kernel, or None where
  `reason` says XLA decodes them."""
  if reason(storage) is not None:
    return None
  if format_of(storage.quantizer).stores_raw(storage):
    return storage.data
  data, scale_inv = storage.data, storage.scale_inv
  *lead, rows, cols = data.shape
  batch = int(np.prod(lead)) if lead else 1
  operands = (data.reshape(batch, rows, cols), scale_inv.reshape(batch, *scale_inv.shape[-2:]))
  result = [jax.ShapeDtypeStruct((batch, rows, cols), jnp.bfloat16)]
  if format_of(storage.quantizer).name == "nvfp4":
    block_rows, _ = scale_blocks(storage.quantizer)
    out, = calls.call(NVFP4_TARGET, result, *operands, block_rows=np.int64(block_rows))
  else:
    out, = calls.call(MXFP8_TARGET, result, *operands)
  return out.reshape(data.shape)


def slower_note(*operands) -> str:
  """For `jaxquant.explain`'s reason: the NVFP4 / MXFP8 operands XLA decodes instead of a
  kernel, and why ("" when the kernels decode every one of them)."""
  parts = []
  for s in operands:
    if not isinstance(s, (ScaledTensor, GroupedScaledTensor)) or s.scale_inv is None:
      continue
    name = format_of(s.quantizer).name
    if name not in TARGETS:
      continue
    why = reason(s)
    if why is not None:
      parts.append(f"{name.upper()} operand {tuple(s.shape)} decoded by XLA, not "
                   f"{TARGETS[name]}: {why}")
  return "; ".join(parts)
