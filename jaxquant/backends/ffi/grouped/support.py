"""Which grouped kernel serves a case, and why not (the routes of `jaxquant.backends.ffi.grouped`).

Targets (ffi/grouped, CPU and CUDA handlers with the same numerics):

  jaxquant_grouped_quantize_fp8  per-tensor FP8 (current or delayed scaling) of tokens `x[T, C]`
      with one amax / scale per group: the rowwise copy and the transposed columnwise copy in
      any token layout (`jaxquant.grouping.layout`), in one quantize launch for all groups
      (current scaling: after one amax launch; delayed scaling: no amax pass, the quantize
      launch reduces each group's amax for the history from the values it loads); also the
      expert weights `[G, rows, cols]` (equal groups, columnwise `[G, cols, rows]`).
      Bit-for-bit `jaxquant.grouping.formats`.
  jaxquant_grouped_quantize_nvfp4  NVFP4 with one second-level scale per group (each group's
      amax; after the RHT for an rht columnwise copy): tokens in any token layout (block >= 16
      for the columnwise copy and 16x16 blocks), the rowwise and / or transposed columnwise
      copy, 1x16 or 16x16 blocks, RHT, stochastic rounding with each group's words at the index
      within the group; also the expert weights `[G, rows, cols]` (each expert its own amax,
      columnwise `[G, cols, rows]`). Amax launches + one launch of the single-tensor NVFP4 tile
      kernel instantiated over the token layout. Bit-for-bit `jaxquant.grouping.formats`.
  jaxquant_grouped_decode_nvfp4 / _mxfp8  NVFP4 / MXFP8 storages (any leading axes, columns
      whole 16-chunks) decoded to their bfloat16 raw values (code x block scale) for the GEMMs on
      decoded operands; bit for bit XLA's decode (`decode_kernel`).
  jaxquant_grouped_amax  the per-group amax of tokens (one launch).
  jaxquant_grouped_amax_gated  the same amax for delayed scaling's just-in-time first scale
      (`first_scale="current"`): its grid exits at once, leaving zeros, unless some group's
      scale (the gate) is still 0, so a state with every scale stored costs one empty launch.
  jaxquant_grouped_gemm  the ragged GEMMs of `jaxquant.grouped.gemm` in one launch (forward /
      dgrad: rows in groups x one matrix per group; wgrad: a contraction over each group's
      positions), operands per-tensor FP8, MXFP8, NVFP4 (row-scaled included) or Float8Block
      with power-of-two scales, in any mix,
      decoded exactly in the kernel, per-group / per-row / per-(group, column) factors and the
      bias in the float32 epilogue (mma.sync, bf16/f16 tensor-core inputs).
  jaxquant_grouped_gemm_sm90  the same GEMMs for per-tensor FP8 and Float8Block operands on
      Hopper (CUDA only, built when CUTLASS is found): CUTLASS's persistent warp-specialized
      pointer-array grouped GEMM (TMA + FP8 wgmma with float32 promotion, per-group scale product
      in the epilogue; for Float8Block the blockwise-scaled mainloop, which multiplies each
      128-deep k-block's partial sums by the row and column block scales before adding them in
      float32), group offsets read on the device. `gemm_kernel` picks it where it serves.
  jaxquant_grouped_gemm_bf16  the same two GEMM modes on bfloat16 operands (CUDA: CUTLASS's
      Hopper grouped kernel with bfloat16 wgmma, float32 sums, per-group alpha, bfloat16 or
      float32 out; operands K-major or, with no transpose, as GroupedDense stores them: `bf16`).
      It serves GroupedDense without a recipe (`jaxquant.layers.grouped_plain`), GEMMs of
      high-precision (Identity) bfloat16 operands, and every other pair of exactly decodable
      operands (MXFP8, NVFP4 in all its options, power-of-two Float8Block, per-tensor FP8 pairs
      the FP8 instances do not take): decoded to bfloat16 (NVFP4 and MXFP8 by
      jaxquant_grouped_decode_*, the rest by XLA); row-scaled tokens' per-row factors in the
      kernel's epilogue (`has_row_scale`), other per-row / per-column factors and the bias
      applied to a float32 output (`decoded`). Else, or with
      JAXQUANT_GROUPED_GEMM_KERNEL=mma_sync, the mma.sync kernel, with the reason
      (`jaxquant.explain` shows the kernel and why).

Raw copies (design decision 47): where the grouped GEMMs read MXFP8 operands decoded to
bfloat16 (CUDA, the bfloat16 CUTLASS kernel), `jaxquant_grouped_quantize_mxfp8` writes the copies
that feed only those GEMMs (`jaxquant.grouped.quantize(decoded=True)`, as `grouped_dense` asks)
as their raw values in bfloat16 (`raw=True`), the decode's bits, so no decode pass runs
(`raw_copies_reason`; `JAXQUANT_GROUPED_RAW_COPIES=off` keeps the codes).

Block formats whose scales are block-local (MXFP8, Float8Block; the rowwise copy of row-scaled
NVFP4) need no grouped quantize kernel: the reference quantizes the padded token layout with the
single-tensor format, so the ordinary single-tensor kernel (one launch) on the XLA-gathered
layout is already the grouped quantize, and `jaxquant_grouped_amax` gives the per-group amax.
Expert weights `[G, rows, cols]` in those formats likewise: one single-tensor launch per copy on
`[G * rows, cols]` when `rows` keeps every block inside one expert (`expert_route`), the
columnwise copy regrouped to `[G, cols, rows]` by XLA.

Each `*_unsupported` function returns None when a kernel can serve the case, else the reason
the reference path is taken; `jaxquant.explain` prints that reason, and `JAXQUANT_BACKEND=ffi`
turns it into an error (never a silent fallback). The reference path computes every group in one
program (one `jax.lax.ragged_dot` per GEMM), never a Python loop over groups.
"""

from __future__ import annotations

from typing import Optional

import jax.numpy as jnp
import numpy as np

from jaxquant.backends.ffi import quantize as single_quantize
from jaxquant.backends.ffi import registry
from jaxquant.backends.ffi.grouped import bf16, decode_kernel, decoded, sm90_configs
from jaxquant.backends.platform import compute_capability
from jaxquant.backends.platform import current_platform as _platform
from jaxquant.formats import format_of
from jaxquant.settings import env_choice

QUANTIZE_TARGET_PREFIX = "jaxquant_grouped_quantize"
GEMM_SM90_TARGET = "jaxquant_grouped_gemm_sm90"
GEMM_BF16_TARGET = bf16.TARGET
# jaxquant_grouped_gemm_sm90's workspace (ffi/grouped/sm90/sm90_gemm.h, workspace_bytes): per
# group 128 bytes of problem shapes / pointers / strides, plus a bound on CUTLASS's workspace.
SM90_WORKSPACE_PER_GROUP = 128
SM90_WORKSPACE_FIXED = 4096 + (1 << 20)
# Token-layout block the sm90 wgrad needs: every group's first token 16-byte aligned for TMA.
SM90_WGRAD_BLOCK = 16
# Float8Block on the CUTLASS kernel: the scale block along the contraction, which is the k-tile
# (one float32 scale per row per 128-deep k-block; a wgrad group must start a block).
SM90_BLOCK_K = 128
_E4M3 = np.dtype(jnp.float8_e4m3fn)
QUANTIZE_FP8_TARGET = "jaxquant_grouped_quantize_fp8"
QUANTIZE_NVFP4_TARGET = "jaxquant_grouped_quantize_nvfp4"
AMAX_TARGET = "jaxquant_grouped_amax"
AMAX_GATED_TARGET = "jaxquant_grouped_amax_gated"
GEMM_TARGET = "jaxquant_grouped_gemm"
CPU_MAX_MACS = 1 << 24  # the CPU handler is a plain loop: small problems only
_MAX_DIM = 2**31 - 1
OUT_DTYPES = (np.dtype("bfloat16"), np.dtype("float16"), np.dtype("float32"))


def _targets(platform: str) -> frozenset:
  """Grouped targets the extension registered for `platform`."""
  return frozenset(t for t in registry.registered_targets(platform)
                   if t.startswith("jaxquant_grouped_"))


def _missing(*targets: str) -> Optional[str]:
  platform = _platform()
  reason = registry.unserved_reason(platform)
  if reason is not None:
    return reason
  for target in targets:
    if target not in _targets(platform):
      return (f"no grouped kernel ({target}) in the jaxquant FFI extension for {platform}; "
              "the reference computes all groups in one program")
  return None


def _fp8_targets(leaf) -> tuple[str, ...]:
  """The targets per-tensor FP8 `leaf` runs: delayed scaling with a just-in-time first scale
  also the gated amax (`jaxquant.backends.ffi.grouped.quantize._delayed_scale`)."""
  if format_of(leaf).needs_current_amax(leaf):
    return QUANTIZE_FP8_TARGET, AMAX_GATED_TARGET
  return (QUANTIZE_FP8_TARGET,)


def fp8_kernel_note(leaf) -> str:
  """What `jaxquant.explain` appends to an FFI per-tensor FP8 grouped quantize: the launches
  that run."""
  fmt = format_of(leaf)
  if not fmt.stateful(leaf):  # current scaling
    return f"kernel: {QUANTIZE_FP8_TARGET} (an amax pass, then the quantize)"
  note = (f"kernel: {QUANTIZE_FP8_TARGET} (scales from the state: no amax pass, the quantize "
          "records each group's amax)")
  if fmt.needs_current_amax(leaf):
    note += (f" after {AMAX_GATED_TARGET} (reads x only while some group's scale is 0: the "
             "just-in-time first scale)")
  return note


def _single_kernel_reason(leaf, direction: str) -> Optional[str]:
  return single_quantize.kernel_reason(leaf)


def _nvfp4_shape_reason(leaf, direction: str, shape) -> Optional[str]:
  """Why `jaxquant_grouped_quantize_nvfp4` cannot take tokens / weights of `shape` (None: it
  can)."""
  if shape is None:
    return None
  if 0 in tuple(shape):
    return f"an empty operand (shape {tuple(shape)}): nothing for the kernel to read"
  if max(shape) > _MAX_DIM:
    return f"shape {tuple(shape)} has a dimension >= 2^31"
  if direction == "rowwise" and shape[-1] % 2:
    return (f"the rowwise NVFP4 copy of {shape[-1]} features: an odd row length shares bytes "
            "between rows, which the grouped kernel does not write")
  return None


def quantize_route(quantizer, direction: str,
                   shape=None) -> tuple[Optional[str], Optional[str]]:
  """(route, reason): route "fp8" (the grouped FP8 kernel), "nvfp4" (the grouped NVFP4 kernel)
  or "single" (XLA gathers the padded layout, the single-tensor kernel quantizes it,
  `jaxquant_grouped_amax` gives the per-group amax); reason is None when a route serves the
  case (the route is the format's, `Format.grouped_quantize_kernel`; the reason adds what this
  process lacks). `shape` (tokens `[T, C]`), when given, is checked against the kernel's
  limits."""
  route, reason = format_of(quantizer).grouped_quantize_kernel(quantizer, direction)
  if route == "fp8":
    return "fp8", _missing(*_fp8_targets(quantizer))
  if route == "single":
    return "single", _missing(AMAX_TARGET) or _single_kernel_reason(quantizer, direction)
  if route == "nvfp4":
    return "nvfp4", (_missing(QUANTIZE_NVFP4_TARGET)
                     or _nvfp4_shape_reason(quantizer, direction, shape))
  return None, reason


def quantize_unsupported(quantizer, direction: str, shape=None) -> Optional[str]:
  """Why grouped quantize of tokens (`shape` `[T, C]`, when given) with `quantizer` in
  `direction` cannot run on the FFI."""
  return quantize_route(quantizer, direction, shape)[1]


def expert_rows_multiple(leaf, direction: str) -> Optional[int]:
  """How many rows an expert must be a multiple of so that no scaling block of `leaf`'s
  `direction` copy spans two experts when `[G, rows, cols]` is quantized as one
  `[G * rows, cols]` matrix by the single-tensor kernel; None when that kernel cannot give each
  expert its own result (per-tensor / per-expert amaxes, stochastic rounding, RHT)."""
  return format_of(leaf).expert_rows_multiple(leaf, direction)


def expert_route(quantizer, direction: str, w_shape=None) -> tuple[Optional[str], Optional[str]]:
  """(route, reason) for one copy of expert weights `[G, rows, cols]`: "fp8" (the grouped FP8
  kernel, one amax and scale per expert), "nvfp4" (the grouped NVFP4 kernel, one amax per
  expert) or "single" (one single-tensor kernel launch on `[G * rows, cols]`, blocks never
  spanning experts; the columnwise copy regrouped by XLA). A Hybrid's columnwise copy from
  `rowwise_dequantized` needs the rowwise copy served too (it is decoded by XLA in between)."""
  if w_shape is not None and w_shape[0] * w_shape[1] > _MAX_DIM:
    return None, f"expert weights: {w_shape[0]} x {w_shape[1]} rows is >= 2^31"
  if direction == "columnwise" and format_of(quantizer).columnwise_from_rowwise(quantizer):
    # the columnwise copy quantizes each expert's decoded rowwise copy: both must be served
    reason = expert_route(quantizer, "rowwise", w_shape)[1]
    if reason is not None:
      return None, ("expert weights: columnwise_source='rowwise_dequantized' decodes the "
                    f"rowwise copy, which takes the reference: {reason}")
  leaf = quantizer.for_direction(direction)
  route = format_of(leaf).grouped_quantize_kernel(leaf, direction)[0]
  if route == "fp8":
    return "fp8", _missing(*_fp8_targets(leaf))
  if route == "nvfp4":
    # one amax per expert: the grouped NVFP4 kernel with every expert a group of `rows` rows
    reason = _missing(QUANTIZE_NVFP4_TARGET)
    if reason is None and w_shape is not None:
      reason = _nvfp4_shape_reason(leaf, direction, w_shape)
      if reason is None and (direction == "columnwise" or leaf.block_2d) and w_shape[1] % 16:
        reason = (f"expert weights: {w_shape[1]} rows per expert is not a multiple of 16, so "
                  f"a 16-row block of {leaf}'s {direction} copy would span two experts in the "
                  "grouped NVFP4 kernel; the reference quantizes each expert")
    return "nvfp4", reason
  multiple = expert_rows_multiple(leaf, direction)
  if multiple is None:
    return None, (f"expert weights: no kernel gives every expert its own {direction} "
                  f"{type(leaf).__name__} copy ({leaf}); the reference quantizes all experts in "
                  "one program (vmap)")
  if w_shape is not None and w_shape[1] % multiple:
    return None, (f"expert weights: {w_shape[1]} rows per expert is not a multiple of "
                  f"{multiple}, so one {direction} scaling block of {leaf} would span two "
                  "experts in the single-tensor kernel; the reference quantizes each expert")
  return "single", _single_kernel_reason(leaf, direction)


def quantize_experts_unsupported(quantizer, w_shape=None,
                                 direction: Optional[str] = None) -> Optional[str]:
  """Why the expert weights `[G, rows, cols]` (one `direction`, or both) cannot be quantized by
  the FFI kernels (one launch per copy, or one for both copies of per-tensor FP8)."""
  for d in ((direction,) if direction else ("rowwise", "columnwise")):
    reason = expert_route(quantizer, d, w_shape)[1]
    if reason is not None:
      return reason
  return None


# ---------------------------------------- NVFP4 pairs ----------------------------------------

NVFP4_PAIR_ENV = "JAXQUANT_GROUPED_NVFP4_PAIR"
# auto: both NVFP4 copies of tokens from one call where it serves (decision 55); off: one call a
# copy, each with its own amax launch (what ran before; kept to measure against).
NVFP4_PAIR_CHOICES = ("auto", "off")


def nvfp4_pair_choice() -> str:
  """`JAXQUANT_GROUPED_NVFP4_PAIR` ("auto" when unset); an unknown value is an error."""
  return env_choice(NVFP4_PAIR_ENV, NVFP4_PAIR_CHOICES, "auto")


# ------------------------------------------ raw copies -----------------------------------------

RAW_COPIES_ENV = "JAXQUANT_GROUPED_RAW_COPIES"
# auto: raw copies, the experts' forward copy in their own layout where a GEMM reads it along N
# (decision 49); transposed: raw copies, every columnwise copy transposed (decision 47 alone);
# off: codes, decoded by the GEMMs' decode pass.
RAW_COPIES_CHOICES = ("auto", "transposed", "off")


DGRAD_COPY_ENV = "JAXQUANT_EXPERTS_DGRAD_COPY"
# patched: raw MXFP8 experts' dgrad copy written over their forward copy in the weights' own
# layout after the forward GEMM, only where the two differ (decision 56); written: the quantize
# kernel writes both copies (decision 49 alone; kept to measure against).
DGRAD_COPY_CHOICES = ("patched", "written")


def dgrad_copy_choice() -> str:
  """`JAXQUANT_EXPERTS_DGRAD_COPY` ("patched" when unset); an unknown value is an error."""
  return env_choice(DGRAD_COPY_ENV, DGRAD_COPY_CHOICES, "patched")


def raw_copies_choice() -> str:
  """`JAXQUANT_GROUPED_RAW_COPIES` ("auto" when unset); an unknown value is an error."""
  return env_choice(RAW_COPIES_ENV, RAW_COPIES_CHOICES, "auto")


def _raw_route_reason() -> Optional[str]:
  """Why no copy is written raw in this process (None: raw copies may be): the codes asked for,
  the GEMMs reading codes, or no bfloat16 kernel to read the raw values."""
  if raw_copies_choice() == "off":
    return f"{RAW_COPIES_ENV}=off"
  if decoded.kernel_choice() != "auto":
    return f"{decoded.KERNEL_ENV}={decoded.kernel_choice()}: the GEMMs read codes"
  return bf16.device_reason()


def raw_copies_reason(leaf) -> Optional[str]:
  """Why copies of `leaf` that feed only grouped GEMMs are not written raw (bfloat16 code x
  block scale) by their quantize kernel, both directions (None: they are). Only MXFP8 is, where
  its GEMMs decode it for the bfloat16 CUTLASS kernel: there the raw copy is what the decode
  would give, one pass sooner. NVFP4's grouped kernel has its own rule (`nvfp4_raw_reason`):
  its copies are raw as MXFP8's, but it has no kernel for the experts' copy along N."""
  if format_of(leaf).name != "mxfp8":
    return f"{format_of(leaf).name} keeps its codes"
  return _raw_route_reason() or _missing(single_quantize.gathered_kernel(leaf))


def nvfp4_raw_reason(leaf, direction: str = "rowwise") -> Optional[str]:
  """Why the grouped NVFP4 kernel does not write `leaf`'s `direction` copies raw (bfloat16 code
  x block scale, the decode pass's bits) where they feed only grouped GEMMs on decoded operands
  (None: it does). The second-level scale stays the GEMM's per-group factor and an RHT'd copy
  stays transformed (both operands of its GEMM are). Session 28: the decode of the 64-expert
  weights cost ~0.12 ms a step."""
  fmt = format_of(leaf)
  if fmt.name != "nvfp4":
    return f"{fmt.name} is not NVFP4"
  if fmt.grouped_quantize_kernel(leaf, direction)[0] != "nvfp4":
    return f"{leaf}'s {direction} copy is not written by the grouped NVFP4 kernel"
  return _raw_route_reason() or _missing(QUANTIZE_NVFP4_TARGET)


def _stores_raw(operand) -> bool:
  return (getattr(operand, "scale_inv", None) is not None
          and format_of(operand.quantizer).stores_raw(operand))


# --------------------------------------------- GEMM -------------------------------------------

def gemm_scaling(operand) -> Optional[int]:
  """The kernel's scaling code of a quantized operand (0 per-tensor FP8, 1 MXFP8, 2 NVFP4 1x16,
  3 NVFP4 16x16, 4 / 5 Float8Block 1x128 / 128x128 with power-of-two scales), or None when the
  kernel does not take it."""
  q = getattr(operand, "quantizer", None)
  if getattr(operand, "scale_inv", None) is None:
    return None
  return format_of(q).grouped_gemm_scaling(q)


def _decodes_exactly(a, b) -> bool:
  """Whether every quantized operand of the pair decodes exactly to bfloat16."""
  return all(gemm_scaling(o) is not None for o in (a, b) if not decoded.high_precision(o))


def gemm_unsupported(a, b, out_dtype=None) -> Optional[str]:
  """Why a grouped GEMM of `a` and `b` cannot run on the FFI. A pair with a high-precision
  (Identity) operand runs only on the bfloat16 CUTLASS kernel (`decoded`)."""
  raw = [name for name, o in (("a", a), ("b", b)) if _stores_raw(o)]
  if raw:  # bfloat16 values, not codes: only the bfloat16 kernel reads them
    reason = decoded.route_reason(a, b, a.orig_dtype if out_dtype is None else out_dtype,
                                  exact=_decodes_exactly(a, b))
    if reason is not None:
      holds = "a and b hold" if len(raw) == 2 else f"{raw[0]} holds"
      return (f"{holds} raw MXFP8 values in bfloat16, which only the bfloat16 CUTLASS kernel "
              f"reads: {reason}")
    return None
  bf16_reason = None
  if decoded.high_precision(a) or decoded.high_precision(b):
    bf16_reason = decoded.route_reason(a, b, a.orig_dtype if out_dtype is None else out_dtype,
                                       exact=_decodes_exactly(a, b))
    if bf16_reason is None:
      return None
  for name, operand in (("a", a), ("b", b)):
    if gemm_scaling(operand) is None:
      q = getattr(operand, "quantizer", None)
      what = ("a high-precision operand" if q is None
              else format_of(q).grouped_gemm_operand(q))
      return (f"{name} is {what}: the grouped GEMM kernel takes per-tensor FP8, MXFP8, NVFP4 "
              "and power-of-two Float8Block operands (the reference runs jax.lax.ragged_dot)"
              + (f"; the bfloat16 CUTLASS kernel: {bf16_reason}" if bf16_reason else ""))
  if out_dtype is not None and np.dtype(out_dtype) not in OUT_DTYPES:
    return f"output dtype {np.dtype(out_dtype).name}; the kernel writes bfloat16/float16/float32"
  if a.token_axis == 0:
    m, k = a.shape
    n = b.shape[1]
  else:
    m, k = a.shape
    n = b.shape[0]
  for name, operand in (("a", a), ("b", b)):
    if format_of(operand.quantizer).elements_per_byte(operand.quantizer) > 1 and k % 2:
      return f"{name} is NVFP4 with an odd contraction length {k} (rows share bytes)"
  if max(m, n, k) > _MAX_DIM:
    return f"a GEMM dimension is >= 2^31 ({m}, {n}, {k})"
  reason = _missing(GEMM_TARGET)
  if reason is not None:
    return reason
  if _platform() == "cpu":
    macs = m * n * k * (a.groups if a.token_axis == 1 else 1)
    if macs > CPU_MAX_MACS:
      return (f"the CPU grouped GEMM handler serves small problems only ({macs} MACs > "
              f"{CPU_MAX_MACS})")
  return None


def sm90_workspace_bytes(groups: int, scale_floats: int = 0) -> int:
  """Bytes of the u8 workspace jaxquant_grouped_gemm_sm90 takes for `groups` groups and
  `scale_floats` repacked Float8Block scales (`sm90_block_scale_floats`)."""
  return groups * SM90_WORKSPACE_PER_GROUP + SM90_WORKSPACE_FIXED + 4 * scale_floats


def sm90_block_scale_floats(a, b) -> int:
  """Float8Block scales the CUTLASS kernel's setup repacks into its workspace (0 for
  per-tensor FP8): every scale of both operands once (ffi/grouped/sm90/sm90_gemm.h,
  block_scale_floats)."""
  if gemm_scaling(a) not in (4, 5):
    return 0
  if a.token_axis == 0:
    (rows, k), n = a.shape, b.shape[1]
    b_rows = 128 if gemm_scaling(b) == 5 else 1
    k_blocks = -(-k // SM90_BLOCK_K)
    return rows * k_blocks + a.groups * -(-n // b_rows) * k_blocks
  (m, length), n = a.shape, b.shape[0]
  return (m + n) * -(-length // SM90_BLOCK_K)


def _sm90_build_status() -> str:
  status = registry.extension_function("grouped_sm90_status")
  return status() if status is not None else "an extension built before the CUTLASS kernel"


def _sm90_device_reason() -> Optional[str]:
  """Why the CUTLASS Hopper kernel cannot run on this platform / device (None: it can)."""
  platform = _platform()
  if platform != "cuda":
    return f"the CUTLASS Hopper grouped kernel is CUDA-only (platform {platform})"
  if GEMM_SM90_TARGET not in _targets(platform):
    return f"the extension has no CUTLASS Hopper grouped kernel ({_sm90_build_status()})"
  cc = compute_capability()
  if cc != (9, 0):
    return f"the device is compute capability {cc}; the CUTLASS grouped kernel is sm_90a"
  return None


def _sm90_block_reason(a, b) -> Optional[str]:
  """Why the CUTLASS blockwise-scaled instances cannot take a Float8Block pair (None: they
  can): a with 1x128 blocks, b with 128x128 tiles (expert weights) or 1x128 blocks, E4M3."""
  scalings = (gemm_scaling(a), gemm_scaling(b))
  names = tuple(type(getattr(o, "quantizer", None)).__name__ for o in (a, b))
  if scalings[0] != 4 or scalings[1] not in (4, 5):
    return (f"a is {names[0]} ({_block_of(a)}) and b is {names[1]} ({_block_of(b)}): the CUTLASS "
            "blockwise kernel takes a Float8Block (1, 128) a and a Float8Block b")
  if a.token_axis == 1 and scalings[1] != 4:
    return "the Float8Block wgrad on the CUTLASS kernel needs (1, 128) blocks on both operands"
  for name, operand in (("a", a), ("b", b)):
    if np.dtype(operand.data.dtype) != _E4M3:
      return (f"{name} is Float8Block {np.dtype(operand.data.dtype).name}: the CUTLASS "
              "blockwise instances are E4M3 x E4M3")
  if a.token_axis == 0:
    if a.shape[1] % SM90_BLOCK_K:
      return (f"K = {a.shape[1]} is not a multiple of {SM90_BLOCK_K} (the CUTLASS blockwise "
              "kernel's k-tile is one Float8Block scale block)")
  elif a.layout.block % SM90_BLOCK_K or a.shape[1] % SM90_BLOCK_K:
    return (f"wgrad token layout block {a.layout.block} / length {a.shape[1]}: the CUTLASS "
            f"blockwise kernel needs both multiples of {SM90_BLOCK_K} (every group's tokens "
            "start a Float8Block scale block)")
  return None


def _block_of(operand) -> str:
  q = getattr(operand, "quantizer", None)
  if q is None or format_of(q).gemm_family(q) != "fp8-block":
    return "not Float8Block"
  return f"block {q.block}"


def sm90_unsupported(a, b, out_dtype=None, bias=None) -> Optional[str]:
  """Why `jaxquant_grouped_gemm_sm90` cannot serve a grouped GEMM of `a` and `b` (None: it
  can). Per-tensor FP8 pairs run on the FP8 instances, Float8Block pairs on the blockwise-scaled
  ones. Mirrors the handler's check in ffi/grouped/grouped_sm90.cu."""
  reason = _sm90_device_reason()
  if reason is not None:
    return reason
  block = gemm_scaling(a) in (4, 5) or gemm_scaling(b) in (4, 5)
  if block:
    reason = _sm90_block_reason(a, b)
    if reason is not None:
      return reason
  else:
    for name, operand in (("a", a), ("b", b)):
      if gemm_scaling(operand) != 0:
        q = getattr(operand, "quantizer", None)
        return (f"{name} is {type(q).__name__}: the CUTLASS Hopper FP8 kernel takes per-tensor "
                "FP8 and Float8Block operands (others are decoded to bfloat16 for the CUTLASS "
                "bfloat16 kernel, or by the mma.sync kernel)")
  e5m2 = np.dtype(jnp.float8_e5m2)
  if np.dtype(a.data.dtype) == e5m2 and np.dtype(b.data.dtype) == e5m2:
    return "E5M2 x E5M2 has no CUTLASS instance"
  if bias is not None:
    return "a bias (the CUTLASS kernel's epilogue is alpha * acc)"
  out = np.dtype(a.orig_dtype if out_dtype is None else out_dtype)
  if out not in (np.dtype(jnp.bfloat16), np.dtype(np.float32)):
    return f"output dtype {out.name} (the CUTLASS instances write bfloat16 / float32)"
  n = b.shape[1] if a.token_axis == 0 else b.shape[0]
  align = 8 if out == np.dtype(jnp.bfloat16) else 4
  if n % align:
    return f"N = {n} is not a multiple of {align} (16-byte TMA rows of the output)"
  if a.token_axis == 0:
    if a.shape[1] % 16:
      return f"K = {a.shape[1]} is not a multiple of 16 (16-byte TMA rows of the operands)"
  else:
    if a.layout.block % SM90_WGRAD_BLOCK or a.shape[1] % 16:
      return (f"wgrad token layout block {a.layout.block} / length {a.shape[1]}: the CUTLASS "
              f"kernel needs both multiples of {SM90_WGRAD_BLOCK} (16-byte aligned group starts)")
  return None


def gemm_kernel(a, b, out_dtype=None, bias=None, accumulation: str = "split") -> tuple[str, str]:
  """(FFI target, why not a CUTLASS kernel or "") for a grouped GEMM the FFI serves: the FP8
  CUTLASS instances where they serve, else the bfloat16 CUTLASS instances on operands decoded
  by XLA (`decoded`; JAXQUANT_GROUPED_GEMM_KERNEL=mma_sync opts out), else the mma.sync kernel.
  Raises ValueError when `JAXQUANT_SM90_CONFIG` names a CUTLASS configuration without an
  instance for this GEMM (`sm90_selection`, `sm90_configs.bf16_selection`). `accumulation`:
  the FP8 accumulation the GEMM's direction takes (`fp8_accumulation`)."""
  reason = sm90_unsupported(a, b, out_dtype, bias)
  if reason is None:
    sm90_selection(a, b, out_dtype, accumulation)
    return GEMM_SM90_TARGET, ""
  out = a.orig_dtype if out_dtype is None else out_dtype
  bf16_reason = decoded.route_reason(a, b, out, bias, exact=_decodes_exactly(a, b))
  if bf16_reason is None:
    decoded.kernel_label(a, b, out, bias)  # a forced configuration without an instance raises
    return GEMM_BF16_TARGET, ""
  if bf16.device_reason() is None:  # else the same device reason twice
    reason += f"; not decoded for the CUTLASS bfloat16 kernel: {bf16_reason}"
  return GEMM_TARGET, f"mma.sync grouped kernel: {reason}"


def gemm_kernel_note(a, b, out_dtype=None, bias=None, stored_kn=None,
                     accumulation: str = "split") -> tuple[str, str]:
  """What `jaxquant.explain` appends to an FFI grouped GEMM's detail ("kernel: ..." naming the
  kernel and any non-default configuration) and why a slower kernel serves it (""). With
  `stored_kn` (experts `b` held as their `[G, K, N]` copy) it also says whether the kernel reads
  that copy along N or XLA transposes it first, and why."""
  target, why = gemm_kernel(a, b, out_dtype, bias, accumulation)
  out = a.orig_dtype if out_dtype is None else out_dtype
  along_n, transpose = False, ""
  if stored_kn is not None:
    reason = (decoded.n_major_reason(a, stored_kn, out, bias) if target == GEMM_BF16_TARGET
              else "only the bfloat16 kernel reads decoded experts along N")
    along_n = reason is None
    transpose = ("; b read along N from its [G, K, N] copy" if along_n else
                 f"; b transposed by XLA from its [G, K, N] copy ({reason})")
  if target == GEMM_SM90_TARGET:
    return ("kernel: CUTLASS sm90 wgmma" + sm90_kernel_label(a, b, out_dtype, accumulation)
            + transpose, "")
  if target == GEMM_BF16_TARGET:
    label = (decoded.kernel_label(a, stored_kn, out, bias, b_k_major=False) if along_n
             else decoded.kernel_label(a, b, out, bias))
    return "kernel: " + label + transpose, decode_kernel.slower_note(
        a, stored_kn if along_n else b)
  return "kernel: mma.sync" + transpose, why


# Formats whose grouped GEMMs run on operands decoded to bfloat16 on Hopper (no FP8 CUTLASS
# instance takes their block scales, and Hopper has no FP4 tensor cores).
_DECODED_FAMILIES = ("mxfp8", "nvfp4")


def along_n_reason(quantizer, w_shape, decoded_copies: bool, w_dtype) -> Optional[str]:
  """Why the FFI kernel does not write the columnwise copy of expert weights `w_shape` `[G,
  rows, cols]` of `w_dtype` in the weights' own layout when asked (`quantize_experts(
  columnwise_along_n=True)`; None: it does). It does for copies that feed the GEMMs on decoded
  operands (`decoded_copies`), written raw (MXFP8, `raw_copies_reason`) by one quantizer (no
  Hybrid) from bfloat16 weights (the kernel rounds their bits), both directions on the
  gathered kernel."""
  if not decoded_copies:
    return "the copies feed no GEMM on decoded operands"
  if format_of(quantizer).halves(quantizer) is not None:
    return "a Hybrid quantizes its two copies apart"
  reason = raw_copies_reason(quantizer)
  if reason is not None:
    return f"not written raw ({reason})"
  if raw_copies_choice() != "auto":
    return f"{RAW_COPIES_ENV}={raw_copies_choice()}"
  if np.dtype(w_dtype) != np.dtype(jnp.bfloat16):
    return (f"{np.dtype(w_dtype).name} weights: the kernel rounds bfloat16 bits (its float32 "
            "form ran slower than the transposed copy, bench/RESULTS.md session 24)")
  for direction in ("rowwise", "columnwise"):
    route_reason = expert_route(quantizer, direction, tuple(w_shape))[1]
    if route_reason is not None:
      return f"{direction}: {route_reason}"
  return None


def experts_along_n(quantizer, w_shape, decoded_copies: bool, w_dtype) -> bool:
  """Whether the FFI kernel writes the columnwise copy of expert weights `w_shape` of
  `w_dtype` in the weights' own layout when asked (`along_n_reason` gives why not)."""
  return along_n_reason(quantizer, w_shape, decoded_copies, w_dtype) is None


def forward_reads_along_n(quantizer, out_dtype, bias: bool) -> bool:
  """Whether the forward GEMM of `jaxquant.grouped_dense` (output `out_dtype`, with or without
  a `bias`) can read the forward copy of its expert weights, quantized as stored by
  `quantizer` (a copy of one quantizer written raw, `raw_copies_reason`), along N from the
  weights' own `[G, K, N]` layout: the N-major instances write bfloat16 and take no bias (as
  `experts_read_transposed`). Where this holds `grouped_dense` asks for that layout, and the
  quantize reports in `explain` when the kernel does not write it (`along_n_reason`)."""
  return (not bias and np.dtype(out_dtype) == np.dtype(jnp.bfloat16)
          and format_of(quantizer).halves(quantizer) is None
          and raw_copies_reason(quantizer) is None)


def experts_read_transposed(quantizer, out_dtype, bias: bool) -> bool:
  """Whether `jaxquant.grouped_dense` should quantize one copy of its expert weights and hand
  the forward GEMM (output `out_dtype`, with or without a `bias`) the dgrad copy as
  `TransposedExperts`: the format's two copies are each other's transposes and its grouped
  GEMMs run decoded on the bfloat16 CUTLASS kernel here, whose N-major instances read the
  decoded `[G, K, N]` values along N and write bfloat16 (a bias, or another output dtype, needs
  the float32 output only the K-major instances write). Elsewhere two copies are cheaper than an
  XLA transpose of one."""
  fmt = format_of(quantizer)
  return (fmt.columnwise_is_transposed_rowwise(quantizer)
          and fmt.gemm_family(quantizer) in _DECODED_FAMILIES
          and not bias and np.dtype(out_dtype) == np.dtype(jnp.bfloat16)
          and bf16.device_reason() is None and decoded.kernel_choice() == "auto")


def sm90_selection(a, b, out_dtype=None, accumulation: str = "split") -> sm90_configs.Selection:
  """The CUTLASS configuration a GEMM the CUTLASS kernel serves is traced with
  (`sm90_configs`: the one `JAXQUANT_SM90_CONFIG` forces, else the automatic choice for the
  GEMM's types, N and `accumulation`, the FP8 accumulation of its direction); ValueError when
  a forced one has no instance for the GEMM's types."""
  block = gemm_scaling(a) in (4, 5) or gemm_scaling(b) in (4, 5)
  selection = sm90_configs.selected()
  if selection is None:
    kind = sm90_configs.instance_kind(a, b, out_dtype, block)
    wgrad = a.token_axis == 1
    return sm90_configs.automatic(
        kind, wgrad, int(b.shape[-2]), int(a.shape[-2]) if wgrad else None,
        tokens_per_group=a.shape[-1] / max(a.groups, 1) if wgrad else None,
        kgrouped=sm90_configs.kgrouped_reason(a, b, block) is None,
        fast=accumulation == "fast")
  reason = sm90_configs.unserved(selection, a, b, out_dtype, block)
  if reason is not None:
    raise ValueError(reason)
  return selection


def sm90_kernel_label(a, b, out_dtype=None, accumulation: str = "split") -> str:
  """What `jaxquant.explain` appends to "CUTLASS sm90 wgmma": the configuration the GEMM runs
  when it is not the default ("" otherwise)."""
  return sm90_configs.kernel_label(sm90_selection(a, b, out_dtype, accumulation))


def sm90_wgrad_block(x_quantizer, dy_quantizer) -> int:
  """Token-layout block for the wgrad copies so a CUTLASS kernel can serve the wgrad GEMM: 16
  when both columnwise operands are per-tensor FP8 and the FP8 kernel can run here, else 8 where
  the bfloat16 kernel can run (decoded or Identity operands; 16-byte aligned bfloat16 group
  starts; block formats already need more), else 1."""
  if registry.unserved_reason(_platform()) is not None:
    return 1
  per_tensor = all(format_of(q).scale_layout(q) == "tensor" for q in (x_quantizer, dy_quantizer))
  if per_tensor and _sm90_device_reason() is None:
    return SM90_WGRAD_BLOCK
  return bf16.ALIGN if bf16.device_reason() is None else 1
