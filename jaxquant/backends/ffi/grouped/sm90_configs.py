"""Kernel configurations of the CUTLASS Hopper grouped GEMMs (`jaxquant_grouped_gemm_sm90`, FP8
operands; `jaxquant_grouped_gemm_bf16`, bfloat16 operands).

Each configuration is one set of CUTLASS template choices (tile, cluster, cooperative or
pingpong schedule, FP8 float32 promotion or fast accumulation) compiled as its own instances
(ffi/grouped/sm90/sm90.cmake, `kCfg*` in ffi/grouped/sm90/sm90_gemm.h; this table mirrors
both). "default" has instances for every FP8 type the kernel takes and "bf16" for every
bfloat16 operand layout; the others are alternatives to measure against them and exist only for
the types of the measured cases (each configuration's `instances`).

Which one runs is chosen when the GEMM is traced: `JAXQUANT_SM90_CONFIG=<name>[:rn]` (":rn"
orders the persistent tile scheduler along N instead of along M, a runtime choice with no
instance of its own), else `automatic` (the measured winner for the GEMM's types and shape,
"default" where none measured better). The choice reaches the handler as FFI attributes, so a
new value takes effect in every newly traced function (re-jit after changing it). A
configuration without an instance for a GEMM's types is an error naming the instances, never a
silent substitute; `jaxquant.explain` names any non-default configuration in the GEMM's kernel.

Accumulation follows the dense FP8 GEMM's per-direction convention
(`jaxquant.backends.ffi.gemm.fp8_accumulation`: fast for fprop, split for dgrad and wgrad, as
TransformerEngine's; `JAXQUANT_FP8_ACCUMULATION` or `Precision.HIGHEST` override it): a
forward of per-tensor E4M3 operands takes a fast configuration (`FAST_FORWARD`, measured in
session 31), every other GEMM a split one; an explicit `JAXQUANT_SM90_CONFIG` applies to every
grouped GEMM traced under it, whatever its direction.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Optional

import jax.numpy as jnp
import numpy as np

ENV = "JAXQUANT_SM90_CONFIG"
RASTER_ALONG_N = "rn"

# Instance kinds: which operand types a configuration is compiled for.
PER_TENSOR_ANY = "per-tensor FP8, every type"
FLOAT8BLOCK_ANY = "Float8Block, every type"
PER_TENSOR_E4M3_BF16 = "per-tensor FP8 E4M3 x E4M3 -> bfloat16"
# The dgrad of the HYBRID recipes (E5M2 gradients x E4M3 experts).
PER_TENSOR_E5M2_E4M3_BF16 = "per-tensor FP8 E5M2 x E4M3 -> bfloat16"
FLOAT8BLOCK_1x128_BF16 = "Float8Block 1x128 x 1x128 -> bfloat16"
# The k-grouped FP8 wgrad ("kgrouped"): per-tensor E4M3 x E4M3 or E4M3 x E5M2 (HYBRID's dy)
# wgrads, either output (`kgrouped_reason`).
KGROUPED_FP8 = "per-tensor FP8 wgrads E4M3 x E4M3 / E5M2 -> bfloat16 / float32"
# bfloat16 x bfloat16 (jaxquant_grouped_gemm_bf16) by operand layout (which operands run along
# the contraction: TN both, NN only a (the no-recipe forward's experts [G, K, N] are N-major),
# NT neither (the no-recipe wgrad contracts the token-major x and dy)) and output.
BF16_TN_BF16 = "bfloat16 TN -> bfloat16"
BF16_TN_F32 = "bfloat16 TN -> float32"
BF16_NN_BF16 = "bfloat16 NN -> bfloat16"
BF16_NT_BF16 = "bfloat16 NT -> bfloat16"
BF16_NT_F32 = "bfloat16 NT -> float32"  # the no-recipe wgrad of float32 experts
# ... with per-row factors in the epilogue (row-scaled NVFP4 tokens: kEpiRowScale).
BF16_TN_BF16_ROWS = "bfloat16 TN -> bfloat16, row-scaled"
BF16_TN_F32_ROWS = "bfloat16 TN -> float32, row-scaled"
_BF16_LAYOUTS = (BF16_TN_BF16, BF16_NN_BF16, BF16_NT_BF16)


@dataclasses.dataclass(frozen=True)
class Sm90Config:
  """One kernel configuration: its id in the handler (`config` attribute), what it is, the
  accumulation it uses ("split": float32 promotion every 128-deep k-block; "fast": the tensor
  cores' accumulator throughout) and the operand types it has instances for."""
  name: str
  ident: int
  tile: tuple[int, int, int]
  cluster: tuple[int, int]
  schedule: str
  accumulation: str
  instances: tuple[str, ...]
  wgrad_only: bool = False  # its instances serve wgrads (mode 1) only

  def describe(self) -> str:
    return (f"{'x'.join(map(str, self.tile))} tiles, cluster {self.cluster[0]}x{self.cluster[1]}, "
            f"{self.schedule}, {self.accumulation} accumulation")


CONFIGS = {c.name: c for c in (
    Sm90Config("default", 0, (128, 128, 128), (1, 2), "cooperative", "split",
               (PER_TENSOR_ANY, FLOAT8BLOCK_ANY)),
    Sm90Config("c1x1", 1, (128, 128, 128), (1, 1), "cooperative", "split",
               (PER_TENSOR_E4M3_BF16, FLOAT8BLOCK_1x128_BF16)),
    Sm90Config("n176", 2, (128, 176, 128), (1, 1), "cooperative", "split",
               (PER_TENSOR_E4M3_BF16, PER_TENSOR_E5M2_E4M3_BF16)),
    Sm90Config("fast", 3, (128, 128, 128), (1, 1), "cooperative", "fast",
               (PER_TENSOR_E4M3_BF16,)),
    Sm90Config("pingpong_fast", 4, (128, 128, 128), (1, 1), "pingpong", "fast",
               (PER_TENSOR_E4M3_BF16,)),
    Sm90Config("c2x1", 5, (128, 128, 128), (2, 1), "cooperative", "split",
               (FLOAT8BLOCK_1x128_BF16, PER_TENSOR_E4M3_BF16)),
    # bfloat16: float32 accumulation throughout (no FP8 promotion question), 64-deep k-tiles
    Sm90Config("bf16", 6, (128, 256, 64), (1, 2), "cooperative", "float32",
               _BF16_LAYOUTS + (BF16_TN_F32, BF16_NT_F32, BF16_TN_BF16_ROWS, BF16_TN_F32_ROWS)),
    Sm90Config("bf16_c2x1", 7, (128, 256, 64), (2, 1), "cooperative", "float32",
               _BF16_LAYOUTS + (BF16_NT_F32, BF16_TN_BF16_ROWS)),
    Sm90Config("bf16_pingpong", 8, (64, 128, 128), (1, 1), "pingpong", "float32",
               _BF16_LAYOUTS),
    Sm90Config("bf16_256x128", 9, (256, 128, 64), (2, 1), "cooperative", "float32",
               _BF16_LAYOUTS + (BF16_NT_F32,)),
    # Wgrads (layouts NT and TN, mode 1) on CUTLASS's batched kernel with one TMA descriptor
    # per operand and the group as the batch coordinate (ffi/grouped/sm90/sm90_kgrouped.cuh):
    # no per-group pointer arrays, setup kernel or descriptor rewrites.
    Sm90Config("bf16_kgrouped", 10, (256, 128, 64), (2, 1), "cooperative, k-grouped",
               "float32", (BF16_NT_BF16, BF16_NT_F32, BF16_TN_BF16, BF16_TN_F32),
               wgrad_only=True),
    # Per-tensor FP8 wgrads the same way, on "c2x1"'s tile (the float32 promotion's second
    # accumulator set rules out 256 rows a CTA).
    Sm90Config("kgrouped", 11, (128, 128, 128), (2, 1), "cooperative, k-grouped", "split",
               (KGROUPED_FP8,), wgrad_only=True),
    # 128 x 128 tiles without a cluster: a ragged GEMM's N of 1408 is 11 whole tiles (256-wide
    # ones compute 6 x 256), and no group's row tiles are rounded up to a cluster. Measured
    # slower than "bf16" (H200, session 26, drawn sizes: 64 x 256 forward 0.279 against 0.218
    # ms, dgrad 0.249 against 0.212; more operand bytes a FLOP), so taken only by name.
    Sm90Config("bf16_128x128", 12, (128, 128, 64), (1, 1), "cooperative", "float32",
               _BF16_LAYOUTS),
    # The bfloat16 k-grouped wgrad on the pingpong schedule (design decision 52): each consumer
    # warpgroup computes its own 128 x 128 tiles, one's epilogue under the other's k-loop
    # (ffi/grouped/sm90/sm90_kgrouped_pingpong.cuh). bfloat16 outputs only: with a float32
    # output it measured slower than "bf16_kgrouped".
    Sm90Config("bf16_kgrouped_pingpong", 13, (128, 128, 64), (2, 1), "pingpong, k-grouped",
               "float32", (BF16_NT_BF16, BF16_TN_BF16), wgrad_only=True),
    # 176-wide tiles: a ragged GEMM's N of 1408 is 8 whole tiles, where 256-wide ones compute
    # 6 x 256 (9% padding). Measured much slower than "bf16" (H200, session 27, drawn sizes: 64
    # x 256 forward 0.316 against 0.232 ms), so taken only by name.
    Sm90Config("bf16_128x176", 14, (128, 176, 64), (1, 2), "cooperative", "float32",
               _BF16_LAYOUTS),
    # Fast accumulation leaves room for 128 x 256 tiles (each warpgroup's 64 x 256 float32
    # accumulator is 128 registers without the promotion's second set): the forward's
    # configuration where its accumulation is fast (`FAST_FORWARD`).
    Sm90Config("wide_fast", 15, (128, 256, 128), (1, 2), "cooperative", "fast",
               (PER_TENSOR_E4M3_BF16,)),
)}
DEFAULT = CONFIGS["default"]
BF16_DEFAULT = CONFIGS["bf16"]
# Average tokens per group from which a bfloat16 wgrad (NT, and TN when not k-grouped) takes
# "bf16_c2x1" (cluster 2x1, B multicast), below it "bf16". Measured on an H100
# (bench/grouped.py --gemms, session 6): 8 experts x 2048 tokens wgrad 2.97 vs 3.18 ms; 64
# experts x 256 tokens 0.304 (bf16) vs 0.320. "bf16_pingpong" (64x128 tiles) was never faster
# (dgrad 64 experts 0.605 ms) and is only taken when JAXQUANT_SM90_CONFIG names it.
BF16_LARGE_GROUP_TOKENS = 1024
# A ragged-rows GEMM (mode 0: the forward NN, the dgrad and decoded forward TN) takes "bf16"
# (cluster 1x2: the tokens' tile shared along N) at every group size (design decision 51).
# Routed tokens make groups of uneven sizes, and CUTLASS rounds each group's row tiles up to
# its cluster: under a 2x1 cluster a group of 257-383 rows computes 4 row tiles, not 3. On
# bench/grouped.py's drawn sizes (64 x 210-299 rows) "bf16_c2x1" computes 1.47 x the rows
# and "bf16" 1.23 x. Measured on an H200 (bench/small_groups.py --multinomial, session 26,
# ms): 64 groups x 256, K 2048, N 1408, forward 0.219 under "bf16" against 0.236-0.238 under
# "bf16_c2x1", dgrad 0.218 against 0.232-0.241; 8 x 2048 (K 4096, N 14336) dgrad 2.818 against
# 2.899-2.999, forward 2.823-2.862 (already "bf16"); 128 x 128 forward 0.282 against 0.306.
# (Session 6's and 18's equal groups, whose row tiles pair exactly, had favoured "bf16_c2x1".)
# A wgrad's [M, N] output is cut into whole tiles, and the tile grid into whole clusters: an N
# of 1408 (11 x 128) is 12 columns of 128-wide tiles under a 1 x 2 cluster and 6 of 256-wide
# ones, 9% of the tiles computing nothing. With this rule on, a wgrad takes the alternative
# that covers its output with fewer padded elements ("c2x1" for per-tensor E4M3 x E4M3,
# "bf16_256x128" for bfloat16 below the large group size), and keeps its configuration on a
# tie (`padded_elements`).
WGRAD_BY_PADDING = True


# A wgrad of groups below BF16_LARGE_GROUP_TOKENS runs the k-grouped kernel (design decision
# 50): "bf16_kgrouped" for bfloat16 ones (layouts NT and TN: the no-recipe wgrad and the one of
# decoded copies), "kgrouped" for per-tensor FP8 ones (`automatic`).
# Measured on an H200 (session 25, bench/small_groups.py, one process; ms): 64 groups x 256
# tokens NT 0.232-0.238 against "bf16_256x128"'s 0.274, TN 0.228-0.238 against 0.271; 128 x 128
# NT 0.330-0.350 against "bf16"'s 0.420, TN 0.341-0.352 against 0.412. At 8 x 2048 (K 4096,
# N 14336) it was no faster (NT 2.73-2.92 against "bf16_c2x1"'s 2.81, TN 2.97-2.99 against
# 2.89), so large groups keep their configuration.
KGROUPED_WGRAD = True
# ... and a bfloat16 one writing bfloat16 takes the kernel's pingpong form,
# "bf16_kgrouped_pingpong" (design decision 52). Measured on an H200 (session 27,
# bench/kgrouped_check.cu, equal groups, random data, µs): 64 groups x 256 tokens (M 2048, N
# 1408) NT 192-194 against "bf16_kgrouped"'s 206-241, TN 193-194 against 206-213; 128 x 128 NT
# 265-266 against 304-310. On drawn sizes (bench/small_groups.py --multinomial, ms): 64 x 256 NT
# 0.235-0.245 against 0.263, TN 0.272-0.277 against 0.282. A float32 output keeps
# "bf16_kgrouped" (NT 257-259 µs against the pingpong form's 264-268), and large groups keep
# "bf16_c2x1" (8 x 2048, K 4096, N 14336: NT 3.02 against 2.87-2.95 ms, TN 3.41 against 3.14).
KGROUPED_PINGPONG = True
# A ragged-rows GEMM (mode 0: a forward, or a dgrad under a forced fast accumulation) of
# per-tensor E4M3 x E4M3 -> bfloat16 whose FP8 accumulation is fast (the dense FP8 forward's
# convention, `jaxquant.backends.ffi.gemm.fp8_accumulation`: fast for fprop, split for dgrad and
# wgrad, as TransformerEngine's) takes a fast configuration (`fast_forward`): "wide_fast" where N
# is a multiple of 256 or at least 8192, else "pingpong_fast". Measured on an H200 (session 31,
# bench/grouped.py --gemms, drawn sizes, ms): 8 experts (N 14336) forward "wide_fast" 1.498
# against "n176"'s 1.637, "fast" 1.587, "pingpong_fast" 1.581; 64 experts (N 1408)
# "pingpong_fast" 0.154 against "n176"'s 0.172, "wide_fast" 0.167, "fast" 0.179. Off: every
# accumulation is split, as before session 31.
FAST_FORWARD = True
# The smallest N from which a split ragged-rows GEMM takes "n176" (`automatic`; 8192 before
# session 31, whose H200 measurements found it faster at every N of bench/grouped.py's shapes,
# 1408 to 14336).
N176_MIN_N = 1408


def padded_elements(mn: tuple[int, int], config: "Sm90Config") -> int:
  """Output elements the tiles of `config` cover for an [m, n] output: each axis rounded up to
  whole tiles, then to whole clusters (CUTLASS's scheduler computes those tiles too)."""
  covered = 1
  for size, tile, cluster in zip(mn, config.tile[:2], config.cluster):
    tiles = -(-size // tile)
    covered *= -(-tiles // cluster) * cluster * tile
  return covered


def _less_padded(mn, chosen: "Sm90Config", alternative: "Sm90Config") -> "Sm90Config":
  """`alternative` where `WGRAD_BY_PADDING` is on and it covers `mn` with fewer elements."""
  if WGRAD_BY_PADDING and mn is not None and (
      padded_elements(mn, alternative) < padded_elements(mn, chosen)):
    return alternative
  return chosen


@dataclasses.dataclass(frozen=True)
class Selection:
  """The configuration a GEMM is traced with, and the scheduler's tile order."""
  config: Sm90Config
  raster_along_n: bool = False

  @property
  def label(self) -> str:
    return self.config.name + (f":{RASTER_ALONG_N}" if self.raster_along_n else "")

  @property
  def is_default(self) -> bool:
    return self.config in (DEFAULT, BF16_DEFAULT) and not self.raster_along_n

  def attributes(self) -> dict:
    """The handler's attributes for this selection."""
    return dict(config=np.int32(self.config.ident), raster_along_n=self.raster_along_n)


def parse(value: str) -> Selection:
  """`<name>[:rn]` -> the selection; an unknown name or option is an error listing the valid
  ones."""
  name, *options = value.strip().split(":")
  config = CONFIGS.get(name or "default")
  if config is None or any(o != RASTER_ALONG_N for o in options) or len(options) > 1:
    raise ValueError(f"{ENV}={value!r}: expected <name>[:{RASTER_ALONG_N}] with name one of "
                     f"{sorted(CONFIGS)}")
  return Selection(config, bool(options))


def selected() -> Optional[Selection]:
  """The selection `JAXQUANT_SM90_CONFIG` forces now, or None (the automatic choice)."""
  value = os.environ.get(ENV, "")
  return parse(value) if value else None


def automatic(kind: str, wgrad: bool, n: int, m: Optional[int] = None,
              tokens_per_group: Optional[float] = None, kgrouped: bool = False,
              fast: bool = False) -> Selection:
  """The configuration a GEMM takes without `JAXQUANT_SM90_CONFIG`: an alternative only where
  it measured faster than "default" at both of `bench/grouped.py`'s shapes on an H100
  (bench/RESULTS.md, session 4; 8 experts N 14336, 64 experts N 1408), or, where noted, on an
  H200:
    - a wgrad the k-grouped kernel serves (`kgrouped`: `kgrouped_reason` is None) of groups
      below the large group size (`tokens_per_group`): "kgrouped" while `KGROUPED_WGRAD` holds
      (session 25, bench/kgrouped_check.cu: 64 groups x 256 tokens 0.238 ms against "c2x1"'s
      0.258 and the default's 0.266; 8 x 2048 1.72 against 1.58, so large groups keep theirs);
    - per-tensor E4M3 x E4M3 or E5M2 x E4M3 (the HYBRID dgrad) -> bf16 ragged GEMM with split
      accumulation and N a multiple of 176 or at least `N176_MIN_N`: "n176" (H100, session 4:
      1199 vs 1163 and 539 vs 517 TFLOP/s for fprop; a 2048- or 4096-wide N measured no better
      or worse there. H200, session 31, E4M3 x E4M3, ms: forward N 14336 1.637 vs 1.670, N 1408
      0.172 vs 0.191; dgrad N 4096 1.615 vs 1.673, N 2048 0.181 vs 0.190);
    - Float8Block wgrad, 1x128 x 1x128 -> bf16: "c1x1" (849 vs 839 and 287 vs 256 TFLOP/s).
    - per-tensor E4M3 x E4M3 -> bf16 wgrad whose [m, n] output "c2x1" covers with fewer padded
      elements (`WGRAD_BY_PADDING`; measured on an H200, session 19: 0.307 -> 0.293 ms at 64
      groups x 256 tokens, 0.484 -> 0.467 at 128 x 128).
    - a ragged-rows GEMM of per-tensor E4M3 x E4M3 -> bf16 whose accumulation is fast
      (`fast`: the forward's, `FAST_FORWARD`): `fast_forward(n)`.
  Fast-accumulation configurations are chosen only there."""
  if fast and FAST_FORWARD and not wgrad and kind == PER_TENSOR_E4M3_BF16:
    return Selection(CONFIGS[fast_forward(n)])
  if (wgrad and kgrouped and KGROUPED_WGRAD and tokens_per_group is not None
      and tokens_per_group < BF16_LARGE_GROUP_TOKENS):
    return Selection(CONFIGS["kgrouped"])
  if kind == PER_TENSOR_E4M3_BF16 and wgrad and m is not None:
    return Selection(_less_padded((m, n), DEFAULT, CONFIGS["c2x1"]))
  if (kind in (PER_TENSOR_E4M3_BF16, PER_TENSOR_E5M2_E4M3_BF16) and not wgrad
      and (n % 176 == 0 or n >= N176_MIN_N)):
    return Selection(CONFIGS["n176"])
  if kind == FLOAT8BLOCK_1x128_BF16 and wgrad:
    return Selection(CONFIGS["c1x1"])
  return Selection(DEFAULT)


def fast_forward(n: int) -> str:
  """The fast-accumulation configuration of a ragged-rows GEMM with `n` output columns: 128 x
  256 tiles ("wide_fast") where they cover N without a half-empty column of tiles, else each
  consumer warpgroup its own 128 x 128 tile, one's epilogue under the other's k-loop
  ("pingpong_fast")."""
  return "wide_fast" if n % 256 == 0 or n >= 8192 else "pingpong_fast"


def instance_kind(a, b, out_dtype, block: bool) -> str:
  """The instance kind a GEMM of `a` and `b` (already served by the default instances) needs
  beyond "every type": E4M3 x E4M3 or E5M2 x E4M3 -> bfloat16, or Float8Block with 1x128 b ->
  bfloat16, or "" when it is none of them."""
  out = np.dtype(a.orig_dtype if out_dtype is None else out_dtype)
  e4m3 = np.dtype(jnp.float8_e4m3fn)
  if out != np.dtype(jnp.bfloat16):
    return ""
  if block:
    return FLOAT8BLOCK_1x128_BF16 if tuple(b.quantizer.block) == (1, 128) else ""
  if np.dtype(b.data.dtype) == e4m3 and np.dtype(a.data.dtype) == e4m3:
    return PER_TENSOR_E4M3_BF16
  if np.dtype(b.data.dtype) == e4m3 and np.dtype(a.data.dtype) == np.dtype(jnp.float8_e5m2):
    return PER_TENSOR_E5M2_E4M3_BF16
  return ""


def kgrouped_reason(a, b, block: bool) -> Optional[str]:
  """Why the k-grouped FP8 wgrad ("kgrouped") cannot serve the GEMM of `a` and `b` (None: it
  can): per-tensor E4M3 x E4M3 or E4M3 x E5M2 wgrads only."""
  e4m3, e5m2 = np.dtype(jnp.float8_e4m3fn), np.dtype(jnp.float8_e5m2)
  if a.token_axis != 1:
    return "not a wgrad (mode 1)"
  if block:
    return "Float8Block operands"
  if np.dtype(a.data.dtype) != e4m3 or np.dtype(b.data.dtype) not in (e4m3, e5m2):
    return f"{np.dtype(a.data.dtype).name} x {np.dtype(b.data.dtype).name} operands"
  return None


def unserved(selection: Selection, a, b, out_dtype, block: bool) -> Optional[str]:
  """Why `selection` has no instance for a GEMM the default instances serve (None: it has)."""
  config = selection.config
  if KGROUPED_FP8 in config.instances:
    reason = kgrouped_reason(a, b, block)
    return None if reason is None else (
        f"{ENV}={selection.label}: configuration {config.name!r} serves {KGROUPED_FP8} only, "
        f"not {reason}")
  if (PER_TENSOR_ANY if not block else FLOAT8BLOCK_ANY) in config.instances:
    return None
  kind = instance_kind(a, b, out_dtype, block)
  if kind and kind in config.instances:
    return None
  out = np.dtype(a.orig_dtype if out_dtype is None else out_dtype).name
  what = (f"Float8Block {tuple(a.quantizer.block)} x {tuple(b.quantizer.block)}" if block else
          f"per-tensor FP8 {np.dtype(a.data.dtype).name} x {np.dtype(b.data.dtype).name}")
  return (f"{ENV}={selection.label}: configuration {config.name!r} has instances for "
          f"{', '.join(config.instances)} only, not {what} -> {out}")


def bf16_kind(layout: str, out_dtype, row_scaled: bool = False) -> str:
  """The bfloat16 instance kind of a GEMM with operand `layout` ("TN", "NN" or "NT") writing
  `out_dtype` (bfloat16 or float32), with per-row factors in the epilogue or not."""
  return f"bfloat16 {layout} -> {np.dtype(out_dtype).name}" + (", row-scaled" if row_scaled
                                                                else "")


def automatic_bf16(kind: str, tokens_per_group: float,
                   wgrad_mn: Optional[tuple[int, int]] = None,
                   wgrad: bool = False) -> Selection:
  """The configuration a bfloat16 GEMM takes without `JAXQUANT_SM90_CONFIG`: a wgrad
  (`wgrad`) of groups below the large group size the k-grouped kernel while `KGROUPED_WGRAD`
  holds ("bf16_kgrouped_pingpong" writing bfloat16 while `KGROUPED_PINGPONG` holds, else
  "bf16_kgrouped"); else "bf16" for a ragged-rows GEMM (mode 0), and for a wgrad by the
  groups' average token count (the measured rule at `BF16_LARGE_GROUP_TOKENS`) and
  (`wgrad_mn`: its per-group output shape), the padding rule (`WGRAD_BY_PADDING`); an instance
  kind the chosen configuration does not have (float32 output) keeps "bf16"."""
  large = tokens_per_group >= BF16_LARGE_GROUP_TOKENS
  wgrad = wgrad or kind.startswith("bfloat16 NT")  # layout NT is the no-recipe wgrad's only
  if wgrad and not large and KGROUPED_WGRAD:
    forms = ["bf16_kgrouped_pingpong"] if KGROUPED_PINGPONG else []
    for name in forms + ["bf16_kgrouped"]:  # the first with an instance for this kind
      if kind in CONFIGS[name].instances:
        return Selection(CONFIGS[name])
  name = "bf16_c2x1" if wgrad and large else "bf16"
  config = CONFIGS[name]
  config = config if kind in config.instances else BF16_DEFAULT
  alternative = CONFIGS["bf16_256x128"]
  if not large and kind in alternative.instances:
    config = _less_padded(wgrad_mn, config, alternative)
  return Selection(config)


def bf16_selection(layout: str, out_dtype, tokens_per_group: float,
                   row_scaled: bool = False,
                   wgrad_mn: Optional[tuple[int, int]] = None,
                   wgrad: bool = False) -> Selection:
  """The configuration a bfloat16 GEMM is traced with: the one `JAXQUANT_SM90_CONFIG` forces
  (ValueError when it has no instance for this layout and output, or serves wgrads only and
  this is not one), else `automatic_bf16`. `row_scaled`: with per-row factors in the epilogue
  (their own instances); `wgrad_mn`: a wgrad's per-group output shape; `wgrad`: a wgrad (mode
  1), given or not its output shape."""
  kind = bf16_kind(layout, out_dtype, row_scaled)
  wgrad = wgrad or wgrad_mn is not None
  selection = selected()
  if selection is None:
    return automatic_bf16(kind, tokens_per_group, wgrad_mn, wgrad)
  if selection.config.wgrad_only and not wgrad:
    raise ValueError(f"{ENV}={selection.label}: configuration {selection.config.name!r} serves "
                     "wgrads (mode 1) only, not this ragged-rows GEMM (mode 0)")
  if kind not in selection.config.instances:
    raise ValueError(f"{ENV}={selection.label}: configuration {selection.config.name!r} has "
                     f"instances for {', '.join(selection.config.instances)} only, not {kind}")
  return selection


def kernel_label(selection: Selection) -> str:
  """What `jaxquant.explain` appends to the CUTLASS kernel's name ("" for the default)."""
  if selection.is_default:
    return ""
  order = ", tiles ordered along N" if selection.raster_along_n else ""
  return f" [config {selection.label}: {selection.config.describe()}{order}]"
