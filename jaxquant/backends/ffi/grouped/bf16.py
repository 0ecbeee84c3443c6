"""The bfloat16 grouped GEMM `jaxquant_grouped_gemm_bf16`: which shapes it takes, and the call.

CUTLASS's Hopper pointer-array grouped GEMM on bfloat16 operands (ffi/grouped/sm90, CUDA only,
built with CUTLASS; a CPU handler with the same contract serves tests), float32 accumulation,
`out = alpha[g] * acc` (times `row_scale[r]` in mode 0 when given: the row-scaled instances)
written as bfloat16 or float32. Two modes, as `jaxquant_grouped_gemm`:

  mode 0 (ragged rows x experts): `out[r] = a[r] . b[group(r)]^T`, rows past the last group 0;
  mode 1 (wgrad): `out[g] = sum over group g's tokens of a[:, t] b[:, t]^T` (0 for empty groups).

Unlike FP8, bfloat16 wgmma reads operands contiguous along K or along M / N, so no operand has
to be transposed first. The three layouts with instances (`sm90_configs`, "TN" / "NN" / "NT"):

  TN  a `[L, K]` (mode 1: `[M, L]`), b `[G, N, K]` (mode 1: `[N, L]`): decoded quantized operands
      and Identity storages (K-major like every jaxquant storage), the no-recipe dgrad;
  NN  a `[L, K]`, b `[G, K, N]`: the no-recipe forward (the kernel as stored);
  NT  a `[L, M]`, b `[L, N]` (mode 1): the no-recipe wgrad (the tokens x and dy as stored).

TMA needs 16-byte aligned rows and group bases: every leading dimension a multiple of 8
bfloat16 (4 float32 for the output), and in mode 1 with a K-major operand every group's first
token at a multiple of 8 (the token layout's block; the kernel traps otherwise).
"""

from __future__ import annotations

from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxquant.backends.ffi import calls
from jaxquant.backends.ffi import registry
from jaxquant.backends.ffi.grouped import sm90_configs
from jaxquant.backends.platform import compute_capability
from jaxquant.backends.platform import current_platform

TARGET = "jaxquant_grouped_gemm_bf16"
ALIGN = 8  # bfloat16 elements in 16 bytes (TMA)
LAYOUTS = {(True, True): "TN", (True, False): "NN", (False, False): "NT"}
OUT_DTYPES = (np.dtype(jnp.bfloat16), np.dtype(np.float32))
_MAX_DIM = 2**31 - 1
_MAX_GROUPS = 2**24 - 1
# The workspace (ffi/grouped/sm90/sm90_gemm.h, workspace_bytes): per group 128 bytes of problem
# shapes / pointers / strides, plus a bound on CUTLASS's own (per-SM TMA descriptors).
WORKSPACE_PER_GROUP = 128
WORKSPACE_FIXED = 4096 + (1 << 20)
KERNEL = "CUTLASS sm90 bf16 wgmma"  # what `jaxquant.explain` names the kernel


def workspace_bytes(groups: int) -> int:
  return groups * WORKSPACE_PER_GROUP + WORKSPACE_FIXED


def _status() -> str:
  status = registry.extension_function("grouped_sm90_status")
  return status() if status is not None else "an extension built before the CUTLASS kernel"


def device_reason(platform: Optional[str] = None) -> Optional[str]:
  """Why the kernel cannot run on `platform` (default: the current one) and its device (None:
  it can)."""
  platform = platform or current_platform()
  if platform != "cuda":
    return f"the CUTLASS bfloat16 grouped kernel is CUDA-only (platform {platform})"
  reason = registry.unserved_reason(platform)
  if reason is not None:
    return reason
  if TARGET not in registry.registered_targets(platform):
    return f"the extension has no CUTLASS bfloat16 grouped kernel ({_status()})"
  cc = compute_capability()
  if cc != (9, 0):
    return f"the device is compute capability {cc}; the CUTLASS grouped kernel is sm_90a"
  return None


def shape_reason(mode: int, a_shape: Sequence[int], b_shape: Sequence[int], *, a_dtype, b_dtype,
                 out_dtype, a_k_major: bool = True, b_k_major: bool = True,
                 token_block: Optional[int] = None) -> Optional[str]:
  """Why no instance takes these operands (None: one does), the device aside. `token_block`
  (mode 1 with a K-major operand): the token layout's block, which aligns the group starts."""
  for name, dtype in (("a", a_dtype), ("b", b_dtype)):
    if np.dtype(dtype) != np.dtype(jnp.bfloat16):
      return f"{name} is {np.dtype(dtype).name}; the CUTLASS grouped instances take bfloat16"
  layout = LAYOUTS.get((a_k_major, b_k_major))
  if layout is None or (mode == 0 and not a_k_major):
    return "an M-major a with a K-major b (no instance: layouts TN, NN, NT)"
  out = np.dtype(out_dtype)
  if out not in OUT_DTYPES or (out == np.dtype(np.float32) and layout == "NN"):
    return (f"{out.name} output of layout {layout} (instances: bfloat16 out for TN / NN / NT, "
            "float32 out for TN / NT)")
  if mode == 0:
    (length, k), n = a_shape, b_shape[1 if b_k_major else 2]
    m, groups = length, b_shape[0]
  else:
    length, m = (a_shape[1], a_shape[0]) if a_k_major else a_shape
    n, groups, k = b_shape[0] if b_k_major else b_shape[1], None, length
  dims = (length, m, n, k)
  if 0 in dims:
    return f"an empty GEMM (L, M, N, K = {dims})"
  if max(dims) > _MAX_DIM:
    return f"a GEMM dimension is >= 2^31 ({dims})"
  if groups is not None and groups > _MAX_GROUPS:
    return f"{groups} groups (at most 2^24 - 1)"
  out_align = 4 if out == np.dtype(np.float32) else ALIGN
  if n % out_align:
    return f"N = {n} is not a multiple of {out_align} (16-byte TMA rows of the output)"
  leading = {"K": k if mode == 0 else None, "N": n if not b_k_major else None,
             "M": m if mode == 1 and not a_k_major else None,
             "token length L": length if mode == 1 and (a_k_major or b_k_major) else None}
  for name, value in leading.items():
    if value is not None and value % ALIGN:
      return f"{name} = {value} is not a multiple of {ALIGN} (16-byte TMA rows of bfloat16)"
  if mode == 1 and (a_k_major or b_k_major) and (token_block is None or token_block % ALIGN):
    return (f"wgrad token layout block {token_block}: K-major operands need every group's "
            f"first token at a multiple of {ALIGN} (16-byte TMA)")
  return None


def selection(mode: int, a_shape, groups: int, out_dtype, *, a_k_major: bool = True,
              b_k_major: bool = True, row_scaled: bool = False,
              b_shape=None) -> sm90_configs.Selection:
  """The configuration (`sm90_configs.bf16_selection`) of a GEMM `shape_reason` accepts
  (`row_scaled`: with per-row factors in the epilogue; `b_shape`, when given, lets a wgrad's
  choice see its output shape)."""
  layout = LAYOUTS.get((a_k_major, b_k_major))
  if layout is None:
    raise ValueError(f"a_k_major={a_k_major}, b_k_major={b_k_major}: no bfloat16 grouped GEMM "
                     "instance (layouts TN, NN, NT)")
  tokens = a_shape[0] if mode == 0 else (a_shape[1] if a_k_major else a_shape[0])
  wgrad_mn = None
  if mode == 1 and b_shape is not None:
    wgrad_mn = (a_shape[0] if a_k_major else a_shape[1], b_shape[0] if b_k_major else b_shape[1])
  return sm90_configs.bf16_selection(layout, out_dtype, tokens / max(groups, 1),
                                     row_scaled=row_scaled, wgrad_mn=wgrad_mn, wgrad=mode == 1)


def kernel_label(mode: int, a_shape, groups: int, out_dtype, *, a_k_major: bool = True,
                 b_k_major: bool = True, row_scaled: bool = False, b_shape=None) -> str:
  """`KERNEL` with the configuration when it is not the default, for `jaxquant.explain`
  (`row_scaled`: " with per-row factors in the epilogue")."""
  chosen = selection(mode, a_shape, groups, out_dtype, a_k_major=a_k_major, b_k_major=b_k_major,
                     row_scaled=row_scaled, b_shape=b_shape)
  epilogue = " with per-row factors in the epilogue" if row_scaled else ""
  return KERNEL + epilogue + sm90_configs.kernel_label(chosen)


def group_starts(extents: jax.Array) -> jax.Array:
  """int32 `[G + 1]` group starts from the positions each group occupies."""
  return jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(extents.astype(jnp.int32))])


def row_scale_reason(mode: int, out_dtype, *, b_k_major: bool = True) -> Optional[str]:
  """Why the kernel cannot apply per-row factors in its epilogue (None: the row-scaled TN
  instances can): they scale the rows of a ragged GEMM with experts read K-major."""
  if mode != 0:
    return "per-row factors scale a ragged GEMM's rows (mode 0)"
  if not b_k_major:
    return "no row-scaled instance reads the experts along N (layout NN)"
  if np.dtype(out_dtype) not in OUT_DTYPES:
    return f"{np.dtype(out_dtype).name} output"
  return None


def gemm(a: jax.Array, b: jax.Array, starts: jax.Array, *, mode: int, out_dtype,
         alpha: Optional[jax.Array] = None, a_k_major: bool = True,
         b_k_major: bool = True, row_scale: Optional[jax.Array] = None) -> jax.Array:
  """One `jaxquant_grouped_gemm_bf16` call (its shapes checked by `shape_reason` first).

  Args:
    a, b: bfloat16 operands in the layout `a_k_major` / `b_k_major` name (module docstring).
    starts: int32 `[G + 1]` group starts along the token axis (`group_starts`).
    mode: 0 (ragged rows x experts) or 1 (wgrad).
    out_dtype: bfloat16 or float32.
    alpha: optional float32 `[G]`, multiplied into each group's float32 sums.
    row_scale: optional float32 `[L]` (mode 0, `row_scale_reason` None): each row's factor,
      multiplied in float32 after alpha, before the one rounding to `out_dtype` (the row-scaled
      instances: `sm90_configs`).
  """
  groups = starts.shape[0] - 1
  if mode == 0:
    n = b.shape[1] if b_k_major else b.shape[2]
    out_shape = (a.shape[0], n)
  else:
    m = a.shape[0] if a_k_major else a.shape[1]
    n = b.shape[0] if b_k_major else b.shape[1]
    out_shape = (groups, m, n)
  has_row_scale = row_scale is not None
  if has_row_scale:
    reason = row_scale_reason(mode, out_dtype, b_k_major=b_k_major)
    if reason is not None:
      raise ValueError(f"row_scale: {reason}")
  chosen = selection(mode, a.shape, groups, out_dtype, a_k_major=a_k_major, b_k_major=b_k_major,
                     row_scaled=has_row_scale, b_shape=b.shape)
  has_alpha = alpha is not None
  alpha = (alpha.astype(jnp.float32).reshape(groups) if has_alpha
           else jnp.zeros((1,), jnp.float32))
  row_scale = (row_scale.astype(jnp.float32).reshape(a.shape[0]) if has_row_scale
               else jnp.zeros((1,), jnp.float32))
  out, _ = calls.call(
      TARGET, [jax.ShapeDtypeStruct(out_shape, np.dtype(out_dtype)),
               jax.ShapeDtypeStruct((workspace_bytes(groups),), np.uint8)],
      a, b, starts.astype(jnp.int32), alpha, row_scale, mode=np.int32(mode),
      a_k_major=a_k_major, b_k_major=b_k_major, has_alpha=has_alpha,
      has_row_scale=has_row_scale, **chosen.attributes())
  return out
