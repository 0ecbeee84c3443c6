"""The FFI GEMM: which kernel multiplies each operand pair, and the calls that run it.

`C[m, n] = sum_k a[m, k] b[n, k] (+ bias[n])` on the TN storage convention (docs/design.md §3
"Storage convention", §6.3 "GEMM paths"). Paths, as `jaxquant.explain` reports them:

  cublaslt-fp8        per-tensor FP8 x per-tensor FP8 (E4M3 x E4M3, E4M3 x E5M2, E5M2 x E4M3)
  cublaslt-fp8-block  Float8Block x Float8Block, cuBLASLt's Hopper block scaling (1x128 x 1x128,
                      1x128 x 128x128, 128x128 x 1x128; cuBLASLt >= 12.9, sm_90)
  wgmma-dequant-<a>[-<b>]  MXFP8 / NVFP4 operands (any mix, row-scaled NVFP4 included): a
                      kernel that decodes the payload into bf16 tiles in shared memory and
                      multiplies them with wgmma (sm_90); no dequantized copy reaches memory.
                      On CUDA it is taken when JAXQUANT_MX_GEMM=wgmma-dequant: by default
                      (JAXQUANT_MX_GEMM=auto) these pairs take dequant-bf16 there, which measured
                      1.8x faster on an H100 (see MX_GEMM_AUTO_REASON); on CPU the target's
                      handler serves them (so CI exercises it).
  dequant-bf16        any other pair: both operands decoded exactly to bf16 by XLA, one bf16
                      GEMM with float32 accumulation, factors and bias in float32
  dequant-f32         the same where a decoded value is not exact in bf16 (Float8Block with
                      pow2_scale=False, float16/float32 Identity operands): a float32 GEMM
  xla-dot             two high-precision operands: XLA's own dot, exactly like the reference
On CPU the two kernel targets have simple float32 handlers (no cuBLASLt, no wgmma), so `explain`
names what ran there: `ffi-cpu gemm-fp8` (the jaxquant_gemm_fp8 target's CPU handler, for the pairs
the cublaslt-* paths take on CUDA) and `ffi-cpu gemm-dequant` (jaxquant_gemm_dequant, for the
wgmma-dequant pairs). They serve small problems only (M*N*K <= CPU_MAX_MACS), larger ones take the
reference path, visibly. Under a mesh the kernel paths are partitioned
(`jaxquant.backends.ffi.partitioning.gemm`): each shard multiplies its rows, a sharded K ends in one
float32 psum, and the bias is added after it; the XLA paths are partitioned by XLA itself.

FP8 accumulation (cublaslt-fp8): "fast" lets the tensor cores accumulate in reduced precision
between promotions, "split" promotes to float32 every k-block. The default is `fast` for the
forward GEMM and `split` for the backward GEMMs, as TransformerEngine does (see
ffi/gemm/NOTES.md for the measurement behind it); `JAXQUANT_FP8_ACCUMULATION=fast|split` forces
one for every GEMM, and `precision=jax.lax.Precision.HIGHEST` forces split for that call.

The CUDA handlers are CUDA-graph (XLA command buffer) compatible. cuBLASLt runs its first
heuristic algorithm; `JAXQUANT_GEMM_AUTOTUNE=1` times its top 8 once per problem instead (opt-in:
it measured no gain on H100, ffi/gemm/NOTES.md). `JAXQUANT_GEMM_TRACE=1` logs each handler call.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import os
from typing import Any, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxquant.formats import format_of
from jaxquant.backends.ffi import partitioning, registry
from jaxquant.backends.platform import compute_capability
from jaxquant.backends.platform import current_platform as _platform
from jaxquant.backends.reference import ops as reference
from jaxquant.tensors import ScaledTensor
from jaxquant.settings import env_choice

Operand = Union[ScaledTensor, jax.Array]

FP8_TARGET = "jaxquant_gemm_fp8"
GELU_TARGET = "jaxquant_gemm_fp8_gelu"  # per-tensor FP8 with gelu in cuBLASLt's epilogue
DEQUANT_TARGET = "jaxquant_gemm_dequant"
CUBLASLT_WORKSPACE_BYTES = 32 * 1024 * 1024 + 256  # cuBLASLt's Hopper recommendation + alignment
CPU_MAX_MACS = 1 << 24
MIN_CUBLASLT_BLOCK_SCALING = 120900  # cuBLASLt version with VEC128_32F / BLK128x128_32F
OUT_DTYPES = (np.dtype(jnp.bfloat16), np.dtype(jnp.float16), np.dtype(jnp.float32))
ACCUMULATIONS = ("fast", "split")
# Default FP8 accumulation per GEMM direction (the last component of the ops-level role label).
DEFAULT_ACCUMULATION = {"fprop": "fast", "dgrad": "split", "wgrad": "split"}

_SCALE_PER_TENSOR, _SCALE_VEC128, _SCALE_BLK128 = 0, 1, 2

MX_GEMM_CHOICES = ("auto", "wgmma-dequant", "dequant-bf16")
MX_GEMM_AUTO_REASON = (
    "measured faster than the wgmma-dequant kernel on H100 (8192^3: 673 vs 365 TFLOP/s MXFP8, "
    "ffi/gemm/NOTES.md); JAXQUANT_MX_GEMM=wgmma-dequant selects the kernel")


def _mx_gemm_choice(platform: str) -> str:
  """How MXFP8 / NVFP4 pairs are multiplied: "wgmma-dequant" or "dequant-bf16"."""
  value = env_choice("JAXQUANT_MX_GEMM", MX_GEMM_CHOICES, "auto")
  if value == "auto":
    return "dequant-bf16" if platform == "cuda" else "wgmma-dequant"
  return value


# ---------------------------------------------------------------------------------------------
# Operand classification: what the operand's format says (`Format.gemm_family` and friends).
# ---------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class _Kind:
  family: str  # "fp8" | "fp8-block" | "mxfp8" | "nvfp4" | "hp"
  dtype: np.dtype  # payload dtype (high-precision dtype for "hp")
  block_2d: bool = False  # 2-D scale tiles (one scale per tile of several rows)
  exact_bf16: bool = True  # decoded values (before any factor) are exact in bfloat16


def _kind(x: Operand) -> _Kind:
  if not isinstance(x, ScaledTensor) or x.scale_inv is None:
    dtype = np.dtype(x.data.dtype if isinstance(x, ScaledTensor) else x.dtype)
    return _Kind("hp", dtype, exact_bf16=dtype == np.dtype(jnp.bfloat16))
  q = x.quantizer
  fmt = format_of(q)
  return _Kind(fmt.gemm_family(q), np.dtype(x.data.dtype),
               block_2d=fmt.block_shape(q)[0] > 1, exact_bf16=fmt.exact_in_bf16(q))


# ---------------------------------------------------------------------------------------------
# What this process can run.
# ---------------------------------------------------------------------------------------------

def _targets(platform: str) -> frozenset:
  """GEMM targets the extension registered for `platform` ("cpu", "cuda")."""
  return registry.registered_targets(platform) & {FP8_TARGET, DEQUANT_TARGET}


@functools.lru_cache(maxsize=None)
def cublaslt_version() -> Optional[int]:
  """cuBLASLt's version (e.g. 130100), from the wheel's library the extension links; None if
  it cannot be loaded."""
  try:
    import nvidia.cu13
    path = os.path.join(list(nvidia.cu13.__path__)[0], "lib", "libcublasLt.so.13")
    lib = ctypes.CDLL(path)
    lib.cublasLtGetVersion.restype = ctypes.c_size_t
    return int(lib.cublasLtGetVersion())
  except Exception:  # noqa: BLE001 - any failure means "unknown"
    return None


# ---------------------------------------------------------------------------------------------
# Path selection.
# ---------------------------------------------------------------------------------------------

def _dequant_path(ka: _Kind, kb: _Kind) -> str:
  return "dequant-bf16" if ka.exact_bf16 and kb.exact_bf16 else "dequant-f32"


def _kernel_path(a: Operand, b: Operand, platform: str) -> tuple[str, str]:
  """(path, why a faster path was not taken or "")."""
  ka, kb = _kind(a), _kind(b)
  if ka.family == "hp" and kb.family == "hp":
    return "xla-dot", ""
  n, k = b.shape[0], a.shape[1]
  cuda = platform == "cuda"
  cc = compute_capability() if cuda else None
  e5m2 = np.dtype(jnp.float8_e5m2)
  if ka.family == kb.family == "fp8":
    if ka.dtype == e5m2 and kb.dtype == e5m2:
      return _dequant_path(ka, kb), "cuBLASLt has no E5M2 x E5M2 FP8 GEMM"
    if cuda and (cc is None or cc < (8, 9)):
      return _dequant_path(ka, kb), f"FP8 tensor cores need sm_89+, device is {cc}"
    if k % 16 or n % 16:
      return _dequant_path(ka, kb), f"cuBLASLt FP8 needs K, N multiples of 16 (K={k}, N={n})"
    return "cublaslt-fp8", ""
  if ka.family == kb.family == "fp8-block":
    if ka.block_2d and kb.block_2d:
      return _dequant_path(ka, kb), "cuBLASLt has no 128x128 x 128x128 block-scaled GEMM"
    if ka.dtype == e5m2 and kb.dtype == e5m2:
      return _dequant_path(ka, kb), "cuBLASLt has no E5M2 x E5M2 FP8 GEMM"
    if k % 128 or n % 16:
      return _dequant_path(ka, kb), (f"cuBLASLt block scaling needs K % 128 == 0 and "
                                     f"N % 16 == 0 (K={k}, N={n})")
    if cuda:
      version = cublaslt_version()
      if version is None or version < MIN_CUBLASLT_BLOCK_SCALING:
        return _dequant_path(ka, kb), (f"cuBLASLt {version} has no Hopper block scaling "
                                       f"(needs >= {MIN_CUBLASLT_BLOCK_SCALING})")
      if cc != (9, 0):
        return _dequant_path(ka, kb), f"cuBLASLt's 1x128/128x128 modes are sm_90 only ({cc})"
    return "cublaslt-fp8-block", ""
  if ka.family in ("mxfp8", "nvfp4") and kb.family in ("mxfp8", "nvfp4"):
    choice = _mx_gemm_choice(platform)
    if choice == "dequant-bf16":
      forced = os.environ.get("JAXQUANT_MX_GEMM", "auto").strip().lower() not in ("", "auto")
      return _dequant_path(ka, kb), ("JAXQUANT_MX_GEMM=dequant-bf16" if forced
                                     else MX_GEMM_AUTO_REASON)
    if cuda and cc != (9, 0):
      return _dequant_path(ka, kb), f"the wgmma-dequant kernel is built for sm_90a ({cc})"
    name = ka.family if ka.family == kb.family else f"{ka.family}-{kb.family}"
    return f"wgmma-dequant-{name}", ""
  return _dequant_path(ka, kb), f"no kernel multiplies {ka.family} x {kb.family}"


def _uses_target(path: str) -> Optional[str]:
  if path.startswith("cublaslt-"):
    return FP8_TARGET
  if path.startswith("wgmma-dequant"):
    return DEQUANT_TARGET
  return None


def _built_without_gemm() -> bool:
  """Whether the extension was built with -DJAXQUANT_GEMM=OFF (CUDA kernels, no CUDA GEMM)."""
  build_options = registry.extension_function("build_options")
  return build_options is not None and build_options().get("gemm", True) is False


def _missing_target_reason(platform: str, what: str) -> str:
  reason = f"{what} for platform {platform!r}"
  if platform == "cuda" and _built_without_gemm():
    reason += (": the extension was built with -DJAXQUANT_GEMM=OFF (no cuBLASLt); reinstall "
               "with nvidia-cublas (pip install -e \".[cuda]\") for the CUDA GEMM kernels")
  return reason


def gemm_unsupported(a: Operand, b: Operand) -> Optional[str]:
  """None when the FFI path can multiply `a` and `b` on the current platform, else why not."""
  platform = _platform()
  targets = _targets(platform)
  if not targets:
    return _missing_target_reason(platform, "the jaxquant extension has no GEMM targets")
  path, _ = _kernel_path(a, b, platform)
  if platform == "cpu" and _uses_target(path):
    macs = a.shape[0] * b.shape[0] * a.shape[1]
    if macs > CPU_MAX_MACS:
      return (f"the CPU GEMM handlers serve small problems (M*N*K <= {CPU_MAX_MACS}); this one "
              f"has {macs}")
  target = _uses_target(path)
  if target is not None and target not in targets:
    return _missing_target_reason(platform, f"target {target} is not built")
  return None


# What `explain` shows for a kernel path served by a target's CPU handler.
_CPU_HANDLER_NAMES = {FP8_TARGET: "ffi-cpu gemm-fp8", DEQUANT_TARGET: "ffi-cpu gemm-dequant"}


def gemm_path(a: Operand, b: Operand) -> str:
  """The name of what `gemm` runs for this pair (for jaxquant.explain): the CUDA kernel path
  (`cublaslt-fp8`, `wgmma-dequant-mxfp8`, ...), the CPU handler that stands in for it on CPU
  (`ffi-cpu gemm-fp8`, `ffi-cpu gemm-dequant`), or an XLA path (`dequant-bf16`, `xla-dot`)."""
  platform = _platform()
  path, _ = _kernel_path(a, b, platform)
  target = _uses_target(path)
  return _CPU_HANDLER_NAMES[target] if platform == "cpu" and target else path


def gemm_path_reason(a: Operand, b: Operand) -> str:
  """Why a slower path than the pair's kernel was taken ("" when none)."""
  return _kernel_path(a, b, _platform())[1]


# ---------------------------------------------------------------------------------------------
# Operand preparation (layouts the kernels expect).
# ---------------------------------------------------------------------------------------------

def _pad_cols(x: jax.Array, cols: int) -> jax.Array:
  extra = cols - x.shape[1]
  return x if extra == 0 else jnp.pad(x, ((0, 0), (0, extra)))


def _block_scales(t: ScaledTensor) -> tuple[jax.Array, int]:
  """Float8Block scales in cuBLASLt's layout: 1x128 -> (ceil(K/128), round_up(rows, 4)) rows
  fastest; 128x128 -> (ceil(rows/128), round_up(ceil(K/128), 4)) K-blocks fastest."""
  s = t.scale_inv.astype(jnp.float32)
  if t.quantizer.block == (128, 128):
    return _pad_cols(s, -(-s.shape[1] // 4) * 4), _SCALE_BLK128
  return _pad_cols(s.T, -(-s.shape[0] // 4) * 4), _SCALE_VEC128


def _dequant_operand(t: ScaledTensor, kp: int) -> tuple[jax.Array, jax.Array, jax.Array, int]:
  """(payload, scale bytes, factor, scale tile rows) for jaxquant_gemm_dequant, K padded to kp."""
  fmt = format_of(t.quantizer)
  if fmt.gemm_family(t.quantizer) == "mxfp8":  # block scales only, no factor
    return _pad_cols(t.data, kp), t.scale_inv, jnp.zeros((0,), jnp.float32), 1
  # float4_e2m1fn is stored packed two per byte (rows byte-aligned once kp % 32 == 0), which
  # is the layout the kernel reads; no unpacking or copy beyond the padding.
  data = _pad_cols(t.data, kp)
  scale = _pad_cols(t.scale_inv, kp // 16)
  factor = fmt.gemm_factor(t).astype(jnp.float32)
  return data, scale, factor, fmt.block_shape(t.quantizer)[0]


def _empty_bias() -> jax.Array:
  return jnp.zeros((0,), jnp.float32)


def fp8_accumulation(accumulation: Optional[str], role: Any, precision: Any) -> str:
  """The accumulation ("fast" or "split") of an FP8 GEMM: split under `Precision.HIGHEST`,
  else `accumulation` when given, else `JAXQUANT_FP8_ACCUMULATION` when set, else the
  direction's default (`DEFAULT_ACCUMULATION`, from the last component of the ops-level `role`
  label: fast for fprop, split for dgrad and wgrad, as TransformerEngine's FP8 GEMMs). The
  grouped CUTLASS GEMMs follow the same rule (`grouped.support.sm90_selection`)."""
  forced = os.environ.get("JAXQUANT_FP8_ACCUMULATION", "").strip().lower()
  if forced and forced not in ACCUMULATIONS:
    raise ValueError(f"JAXQUANT_FP8_ACCUMULATION={forced!r}; expected one of {ACCUMULATIONS}")
  if precision is not None and lax.Precision(precision) == lax.Precision.HIGHEST:
    return "split"
  if accumulation is not None:
    if accumulation not in ACCUMULATIONS:
      raise ValueError(f"accumulation={accumulation!r}; expected one of {ACCUMULATIONS}")
    return accumulation
  if forced:
    return forced
  direction = role.rsplit("/", 1)[-1] if isinstance(role, str) else None
  return DEFAULT_ACCUMULATION.get(direction, "split")


# ---------------------------------------------------------------------------------------------
# The calls.
# ---------------------------------------------------------------------------------------------

def _cublaslt(a: ScaledTensor, b: ScaledTensor, path: str, out_dtype, bias, fast: bool):
  platform = _platform()
  m, n = a.shape[0], b.shape[0]
  # cuBLASLt's FP8 bias epilogue takes bf16 for bf16/f32 outputs and f16 for f16 outputs.
  want_bias = np.dtype(jnp.float16) if out_dtype == np.dtype(jnp.float16) else np.dtype(
      jnp.bfloat16)
  fused = bias is None or np.dtype(bias.dtype) == want_bias
  kernel_out = out_dtype if fused else np.dtype(jnp.float32)
  if path == "cublaslt-fp8":
    a_scale, a_mode = a.scale_inv.astype(jnp.float32), _SCALE_PER_TENSOR
    b_scale, b_mode = b.scale_inv.astype(jnp.float32), _SCALE_PER_TENSOR
  else:
    (a_scale, a_mode), (b_scale, b_mode) = _block_scales(a), _block_scales(b)
    fast = False
  workspace = CUBLASLT_WORKSPACE_BYTES if platform == "cuda" else 0
  call = jax.ffi.ffi_call(
      FP8_TARGET,
      (jax.ShapeDtypeStruct((m, n), kernel_out), jax.ShapeDtypeStruct((workspace,), jnp.uint8)),
      vmap_method="sequential")
  out, _ = call(a.data, a_scale, b.data, b_scale,
                bias if (fused and bias is not None) else _empty_bias(),
                a_scale_mode=np.int64(a_mode), b_scale_mode=np.int64(b_mode),
                fast_accum=bool(fast))
  if not fused:  # bias of another dtype: added in float32 after the GEMM, like the reference
    out = (out + bias.astype(jnp.float32)).astype(out_dtype)
  return out


def _wgmma_dequant(a: ScaledTensor, b: ScaledTensor, out_dtype, bias):
  k = a.shape[1]
  fp4 = "nvfp4" in (_kind(a).family, _kind(b).family)
  kp = -(-k // 32) * 32 if fp4 else -(-k // 16) * 16
  a_data, a_scale, a_factor, a_tile = _dequant_operand(a, kp)
  b_data, b_scale, b_factor, b_tile = _dequant_operand(b, kp)
  call = jax.ffi.ffi_call(DEQUANT_TARGET,
                          jax.ShapeDtypeStruct((a.shape[0], b.shape[0]), out_dtype),
                          vmap_method="sequential")
  return call(a_data, a_scale, a_factor, b_data, b_scale, b_factor,
              bias if bias is not None else _empty_bias(), k=np.int64(kp),
              a_scale_tile_rows=np.int64(a_tile), b_scale_tile_rows=np.int64(b_tile))


def _decoded(x: Operand, dtype) -> tuple[jax.Array, Optional[jax.Array]]:
  """(values without the GEMM factor, factor or None), values cast to `dtype` (exact when
  the path chose bf16)."""
  if isinstance(x, ScaledTensor) and x.scale_inv is not None:
    if _kind(x).family == "fp8":  # the per-tensor scale is arbitrary: keep it for the epilogue
      return x.data.astype(dtype), x.scale_inv.astype(jnp.float32)
    fmt = format_of(x.quantizer)
    return fmt.dequantize_raw(x).astype(dtype), fmt.gemm_factor(x)
  data = x.data if isinstance(x, ScaledTensor) else x
  return data.astype(dtype), None


def _dequant_xla(a: Operand, b: Operand, path: str, out_dtype, bias):
  dtype = jnp.bfloat16 if path == "dequant-bf16" else jnp.float32
  lhs, lhs_factor = _decoded(a, dtype)
  rhs, rhs_factor = _decoded(b, dtype)
  acc = lax.dot_general(lhs, rhs, (((1,), (1,)), ((), ())), precision=lax.Precision.HIGHEST,
                        preferred_element_type=jnp.float32)
  if lhs_factor is not None:
    acc = acc * (lhs_factor[:, None] if lhs_factor.ndim else lhs_factor)
  if rhs_factor is not None:
    acc = acc * (rhs_factor[None, :] if rhs_factor.ndim else rhs_factor)
  if bias is not None:
    acc = acc + bias.astype(jnp.float32)
  return acc.astype(out_dtype)


def gemm(a: Operand, b: Operand, *, out_dtype, bias: Optional[jax.Array] = None,
         precision=None, accumulation: Optional[str] = None, role: Any = None) -> jax.Array:
  """`C = a b^T (+ bias)` through the path `gemm_path(a, b)` names.

  Args:
    a, b: `ScaledTensor`s or high-precision arrays, `[M, K]` and `[N, K]` (validated by
      `jaxquant.ops.gemm`).
    out_dtype: bfloat16, float16 or float32.
    bias: optional `[N]` bias (any of those dtypes), added in float32 after accumulation.
    precision: for high-precision pairs, as `lax.dot_general`; `Precision.HIGHEST` also forces
      split accumulation on cublaslt-fp8.
    accumulation: "fast" or "split" for cublaslt-fp8; None = the per-direction default.
    role: the ops-level label ("linear/fc1/fprop"); its last part picks the default
      accumulation.
  """
  out_dtype = np.dtype(out_dtype)
  if out_dtype not in OUT_DTYPES:
    raise ValueError(f"out_dtype: {out_dtype.name} is not supported by the FFI GEMM; expected "
                     "bfloat16, float16 or float32")
  path, _ = _kernel_path(a, b, _platform())
  if path == "xla-dot":
    return reference.gemm(a, b, out_dtype=out_dtype, bias=bias, precision=precision)
  if _uses_target(path):  # partitioned: local GEMMs, one psum over the mesh axes sharding K
    fast = (path.startswith("cublaslt-")
            and fp8_accumulation(accumulation, role, precision) == "fast")
    return partitioning.gemm(_Kernel(path, fast), a, b, bias, out_dtype)
  return _dequant_xla(a, b, path, out_dtype, bias)


@dataclasses.dataclass(frozen=True)
class _Kernel:
  """The single-device kernel call of a path (hashable: it keys the partitioned call)."""

  path: str
  fast: bool

  def __call__(self, a: ScaledTensor, b: ScaledTensor, bias, out_dtype) -> jax.Array:
    if self.path.startswith("cublaslt-"):
      return _cublaslt(a, b, self.path, np.dtype(out_dtype), bias, self.fast)
    return _wgmma_dequant(a, b, np.dtype(out_dtype), bias)


# ---------------------------------------------------------------------------------------------
# The GEMM with gelu in its epilogue (an MLP's fc1: jaxquant.layers.fused_activation).
# ---------------------------------------------------------------------------------------------

GELU_OUT_DTYPE = np.dtype(jnp.bfloat16)  # the epilogue's measured (and tested) output dtype


def gemm_gelu_unsupported(a: Operand, b: Operand, out_dtype, bias: Optional[jax.Array]
                          ) -> Optional[str]:
  """None when `jaxquant_gemm_fp8_gelu` can compute `gelu(a b^T + bias)` and its
  pre-activation for these operands here, else why not."""
  platform = _platform()
  if GELU_TARGET not in registry.registered_targets(platform):
    return _missing_target_reason(platform, f"target {GELU_TARGET} is not built")
  path, why = _kernel_path(a, b, platform)
  if path != "cublaslt-fp8":
    return (f"the gelu epilogue runs on the cublaslt-fp8 path (per-tensor FP8 operands); this "
            f"pair takes {path}" + (f" ({why})" if why else ""))
  if np.dtype(out_dtype) != GELU_OUT_DTYPE:
    return f"the gelu epilogue writes bfloat16 outputs; this GEMM's is {np.dtype(out_dtype).name}"
  if bias is not None and np.dtype(bias.dtype) != GELU_OUT_DTYPE:
    return f"the gelu epilogue adds a bfloat16 bias; this one is {np.dtype(bias.dtype).name}"
  if platform == "cpu" and a.shape[0] * b.shape[0] * a.shape[1] > CPU_MAX_MACS:
    return (f"the CPU GEMM handlers serve small problems (M*N*K <= {CPU_MAX_MACS}); this one "
            f"has {a.shape[0] * b.shape[0] * a.shape[1]}")
  return None


def gemm_gelu(a: ScaledTensor, b: ScaledTensor, *, bias: Optional[jax.Array], precision=None,
              role: Any = None) -> tuple[jax.Array, jax.Array]:
  """`(gelu(h), h)` with `h = a b^T (+ bias)`, both bfloat16, from one cuBLASLt GEMM whose
  epilogue applies the bias and the gelu (tanh approximation) in float32 and writes both
  (`gemm_gelu_unsupported` is None). Partitioned over the rows of `a` and of `b`; the
  contraction axis is gathered whole (gelu of a partial sum is not a partial sum)."""
  m, n = a.shape[0], b.shape[0]
  fast = fp8_accumulation(None, role, precision) == "fast"
  workspace = CUBLASLT_WORKSPACE_BYTES if _platform() == "cuda" else 0
  results = (jax.ShapeDtypeStruct((m, n), GELU_OUT_DTYPE),
             jax.ShapeDtypeStruct((m, n), GELU_OUT_DTYPE),
             jax.ShapeDtypeStruct((workspace,), jnp.uint8))
  layout = partitioning.Layout(
      operands=((("m", 1), ("k", 1)), (), (("n", 1), ("k", 1)), (),
                ((("n", 1),) if bias is not None else ((None, 1),))),
      results=((("m", 1), ("n", 1)), (("m", 1), ("n", 1)), ((None, 1),)),
      whole=("k",),  # a sharded contraction is gathered first
      names=(("m", "rows of a"), ("n", "rows of b"), ("k", "contraction axis")),
      what="GEMM with gelu epilogue")
  out, aux, _ = partitioning.call(
      GELU_TARGET, results, a.data, a.scale_inv.astype(jnp.float32), b.data,
      b.scale_inv.astype(jnp.float32), bias if bias is not None else _empty_bias(),
      layout=layout, a_scale_mode=np.int64(_SCALE_PER_TENSOR),
      b_scale_mode=np.int64(_SCALE_PER_TENSOR), fast_accum=bool(fast))
  return out, aux
