"""Fine-grained experts: the grouped GEMMs of equal small groups against the batched GEMM of the
same per-group shapes (one card, one process).

With every group the same size, the grouped problem is also a batched one, so XLA's batched
GEMM (`einsum` over [G, m, K]: cuBLAS or XLA's own GEMM emitter, whichever XLA picks) is a peer
that does exactly the same FLOPs without a grouped kernel's per-group work (CUTLASS's pointer-
array kernel rewrites its TMA descriptors whenever a CTA moves to another group). The dense
GEMM of the same FLOPs is the roofline peer. Rows: the no-recipe bfloat16 GEMMs as
`GroupedDense` runs them (NN forward, TN dgrad, NT wgrad), the decoded copies' TN forward and
wgrad, and the per-tensor FP8 GEMMs of a Float8CurrentScaling step (TN, wgrad on the 16-token
layout).

    python bench/small_groups.py                        # 64 experts x 256 rows, K 2048, N 1408
    python bench/small_groups.py --groups 128 --rows 128
    python bench/small_groups.py --configs c2x1,bf16_256x128 --only wgrad
    python bench/small_groups.py --once                 # each GEMM once after compiling (ncu)
    python bench/small_groups.py --empty 32             # half the groups empty (zero-fills)
    python bench/small_groups.py --multinomial          # group sizes drawn as grouped.py's
    python bench/small_groups.py --tiny                 # CPU smoke check
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

import jaxquant as jq
import jaxquant.grouped as jg
from jaxquant.backends.ffi.grouped import bf16, sm90_configs
from grouped import group_sizes as grouped_step_sizes  # bench/grouped.py
from grouped import no_recipe_gemms
from timing import bench, card  # bench/timing.py


def einsum(spec: str):
  return jax.jit(lambda a, b: jnp.einsum(spec, a, b, preferred_element_type=jnp.bfloat16))


def group_sizes(groups: int, rows: int, seed: int, empty: int = 0,
                multinomial: bool = False) -> np.ndarray:
  """Every group `rows` rows (the first `empty` none), or with `multinomial` a draw of
  `groups * rows` rows over the groups as bench/grouped.py's steps route them (its seed's
  draw: 210-299 rows a group at 64 x 256)."""
  if multinomial:
    return grouped_step_sizes(np.random.default_rng(seed), groups * rows, groups)
  return np.where(np.arange(groups) < empty, 0, rows).astype(np.int32)


def cases(groups: int, rows: int, k: int, n: int, seed: int, grouped_only: bool = False,
          empty: int = 0, multinomial: bool = False):
  """(name, function, operands) of every GEMM to time (the grouped ones only: traced under
  the CUTLASS configuration `JAXQUANT_SM90_CONFIG` names now); the FLOPs are 2 G rows K N
  each. `empty` > 0: the first `empty` groups have no rows (their rows belong to no group:
  the outputs the GEMMs' setup kernels zero-fill), grouped GEMMs only; `multinomial`: drawn
  group sizes (`group_sizes`), no batched peers."""
  rng = np.random.default_rng(seed)
  t = groups * rows
  sizes = jnp.asarray(group_sizes(groups, rows, seed, empty, multinomial))
  x = jnp.asarray(rng.standard_normal((t, k), np.float32), jnp.bfloat16)
  dy = jnp.asarray(rng.standard_normal((t, n), np.float32), jnp.bfloat16)
  w = jnp.asarray(rng.standard_normal((groups, n, k), np.float32), jnp.bfloat16)  # [G, N, K]
  if not grouped_only:
    kernel = jnp.swapaxes(w, 1, 2)
    yield ("dense bf16 [T,K] x [K,N]", einsum("tk,kn->tn"), (x, kernel[0]))
  if not (grouped_only or empty > 0 or multinomial):  # the batched peers need equal groups
    xb, dyb = x.reshape(groups, rows, k), dy.reshape(groups, rows, n)
    yield ("batched bf16 fprop", einsum("gtk,gkn->gtn"), (xb, kernel))
    yield ("batched bf16 dgrad", einsum("gtn,gkn->gtk"), (dyb, kernel))
    yield ("batched bf16 wgrad", einsum("gtk,gtn->gkn"), (xb, dyb))
  # the no-recipe GroupedDense's three GEMMs, as bench/grouped.py times them
  layouts = {"fprop": "NN", "dgrad": "TN", "wgrad": "NT"}
  for kind, fn, ops in no_recipe_gemms(x, w, dy, sizes):
    yield (f"grouped bf16 {kind} ({layouts[kind]})", jax.jit(fn), ops)
  # the forward of decoded (MXFP8 / NVFP4) copies: the experts' [G, N, K] copy K-major (TN)
  starts = bf16.group_starts(sizes)
  yield ("grouped bf16 fprop (TN)",
         jax.jit(lambda a, b, s: bf16.gemm(a, b, s, mode=0, out_dtype=jnp.bfloat16)),
         (x, w, starts))
  # the wgrad of decoded (MXFP8 / NVFP4) copies: the tokens' columnwise copies [K, L]
  # and [N, L], tokens contiguous (layout TN), every group starting on a multiple of 8 tokens
  # (16 bytes: the kernels' contract for K-major operands, which the library's token layouts
  # keep; drawn sizes are padded with zero tokens to it)
  counts = np.asarray(sizes)
  padded = -(-counts // bf16.ALIGN) * bf16.ALIGN
  rows_of = np.concatenate([np.arange(c) + o for c, o in zip(counts, np.cumsum(counts) - counts)])
  slots = np.concatenate([np.arange(c) + o for c, o in zip(counts, np.cumsum(padded) - padded)])
  lay = jax.jit(lambda v: jnp.zeros((int(padded.sum()), v.shape[1]), v.dtype)
                .at[slots].set(v[rows_of]).T)
  yield ("grouped bf16 wgrad (TN)",
         jax.jit(lambda a, b, s: bf16.gemm(a, b, s, mode=1, out_dtype=jnp.bfloat16)),
         (lay(x), lay(dy), bf16.group_starts(jnp.asarray(padded))))
  fp8 = jq.Float8CurrentScalingQuantizer()
  a = jax.jit(lambda x, s: jg.quantize(x, s, fp8, columnwise=True, col_block=16))(x, sizes)
  c = jax.jit(lambda d, s: jg.quantize(d, s, fp8, col_block=16))(dy, sizes)
  e = jax.jit(lambda w: jg.quantize_experts(w, fp8))(w)
  gemm = jax.jit(lambda a, b: jg.gemm(a, b))
  yield ("grouped fp8 fprop", gemm, (a.rowwise, e.rowwise))
  yield ("grouped fp8 dgrad", gemm, (c.rowwise, e.columnwise))
  yield ("grouped fp8 wgrad", gemm, (a.columnwise, c.columnwise))


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--groups", type=int, default=64)
  parser.add_argument("--rows", type=int, default=256, help="rows (tokens) of every group")
  parser.add_argument("--k", type=int, default=2048)
  parser.add_argument("--n", type=int, default=1408)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--once", action="store_true",
                      help="compile every GEMM, then run each once (for a profiler's filter)")
  parser.add_argument("--only", type=lambda v: v.split(","), default=[""], metavar="TEXT,...",
                      help="run only the cases whose name contains one of these")
  parser.add_argument("--configs", type=lambda v: [c for c in v.split(",") if c], default=[],
                      metavar="NAME,...", help="also time the grouped GEMMs under each of these "
                      "CUTLASS configurations (sm90_configs; those without an instance for a "
                      "GEMM's operands are skipped)")
  parser.add_argument("--empty", type=int, default=0, help="the first EMPTY groups get no rows "
                      "(grouped GEMMs only: what their setup kernels zero-fill)")
  parser.add_argument("--multinomial", action="store_true", help="group sizes drawn as "
                      "bench/grouped.py's steps draw them (ROWS the average), no batched peers")
  parser.add_argument("--tiny", action="store_true", help="tiny shapes, one timed call (CPU)")
  args = parser.parse_args(argv)
  if args.tiny:
    args.groups, args.rows, args.k, args.n = 4, 16, 64, 32
  timing = dict(repeats=1, calls=1, warmup=1) if args.tiny else dict(repeats=5, calls=10)
  flops = 2 * (args.groups - args.empty) * args.rows * args.k * args.n
  print(f"card: {card()}; jax {jax.__version__}; {args.groups} groups x {args.rows} rows, "
        f"K {args.k}, N {args.n}: {flops / 1e9:.1f} GFLOP a GEMM", flush=True)
  selected = [c for c in cases(args.groups, args.rows, args.k, args.n, args.seed,
                               empty=args.empty, multinomial=args.multinomial)
              if any(o in c[0] for o in args.only)]
  if args.once:
    for name, fn, ops in selected:
      jax.block_until_ready(fn(*ops))
    for name, fn, ops in selected:
      print(f"  once: {name}", flush=True)
      jax.block_until_ready(fn(*ops))
    return 0
  dense = None

  def report(label: str, sec: float) -> None:
    ratio = f"  {dense / sec:4.2f}x dense" if dense else ""
    print(f"  {label:40s} {sec * 1e3:8.3f} ms {flops / sec / 1e12:7.1f} TFLOP/s{ratio}",
          flush=True)

  for name, fn, ops in selected:
    sec = bench(fn, *ops, **timing)
    dense = sec if name.startswith("dense") else dense
    report(name, sec)
  for config in args.configs:
    sm90_configs.parse(config)
    os.environ[sm90_configs.ENV] = config
    try:
      for name, fn, ops in cases(args.groups, args.rows, args.k, args.n, args.seed, True,
                                 args.empty, args.multinomial):
        if not any(o in name for o in args.only):
          continue
        try:
          sec = bench(fn, *ops, **timing)
        except ValueError as e:  # no instance of this configuration for these operands
          if "has instances for" not in str(e) and "serves wgrads" not in str(e):
            raise
          continue
        report(f"{name} [{config}]", sec)
    finally:
      os.environ.pop(sm90_configs.ENV, None)
  return 0


if __name__ == "__main__":
  sys.exit(main())
