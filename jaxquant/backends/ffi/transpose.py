"""FFI transpose: the columnwise copy of per-tensor FP8 data, by moving bytes."""

from __future__ import annotations

from typing import Optional

import jax
import numpy as np

from jaxquant.backends.ffi import calls
from jaxquant.backends.ffi.partitioning import Layout
from jaxquant.quantizers import FP8_DTYPES
from jaxquant.tensors import ScaledTensor


def unsupported(t: ScaledTensor) -> Optional[str]:
  if t.data.ndim != 2 or 0 in t.data.shape:
    return f"the FFI transpose needs a non-empty 2-D matrix; got shape {tuple(t.data.shape)}"
  if np.dtype(t.data.dtype) not in FP8_DTYPES:
    return f"the FFI transpose moves float8 bytes, not {np.dtype(t.data.dtype).name}"
  return None


def transpose(t: ScaledTensor) -> ScaledTensor:
  rows, cols = t.data.shape
  layout = Layout(operands=((("m", 1), ("k", 1)),), results=((("k", 1), ("m", 1)),),
                  what="jaxquant_transpose_fp8")  # local per shard
  (data_t,) = calls.call("jaxquant_transpose_fp8",
                         [jax.ShapeDtypeStruct((cols, rows), t.data.dtype)], t.data,
                         layout=layout)
  return ScaledTensor(data_t, t.scale_inv, t.amax, t.quantizer, t.orig_dtype, t.rht)
