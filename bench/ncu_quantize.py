"""The grouped quantize kernels of a GroupedDense step, each launched once, for Nsight Compute.

    ncu --clock-control none -k regex:"grouped_quantize_kernel|nvfp4_kernel" \
        --section SpeedOfLight --section WarpStateStats python bench/ncu_quantize.py

Each case is compiled first, then run once, so a kernel filter sees exactly one launch per case
(in the order printed). The shapes are bench/grouped.py's 8-expert step (Mixtral fc1: tokens
x [16384, 4096], output gradients dy [16384, 14336], expert weights [8, 14336, 4096]; `--shape
moe64` the 64-expert step's, [64, 1408, 2048] weights). `--tiny`
runs small shapes (a CPU smoke check). Timings come from bench/grouped_quantize.py and
bench/quantize.py; this script only gives a profiler one launch of each kernel to read.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

import jax
import jax.numpy as jnp
import numpy as np

import jaxquant as jq
import jaxquant.grouped as jg

SHAPES = {"llm": (8, 16384, 4096, 14336), "moe64": (64, 16384, 2048, 1408),
          "tiny": (8, 256, 128, 64)}


def cases(groups: int, tokens: int, k: int, n: int):
  """(name, function, arguments) of each grouped quantize of the step's operands."""
  rng = np.random.default_rng(0)
  sizes = jnp.asarray(rng.multinomial(tokens, np.full(groups, 1.0 / groups)).astype(np.int32))
  x = jax.random.normal(jax.random.key(0), (tokens, k), jnp.bfloat16)
  dy = jax.random.normal(jax.random.key(1), (tokens, n), jnp.bfloat16)
  w = jax.random.normal(jax.random.key(2), (groups, n, k), jnp.bfloat16)
  keys = jax.random.split(jax.random.key(3), groups)
  delayed = jq.Float8DelayedScalingQuantizer()
  fresh = jg.init_state(delayed, groups)  # scales set: no just-in-time amax pass
  state = dataclasses.replace(fresh, scale=jnp.ones_like(fresh.scale))
  current = jq.Float8CurrentScalingQuantizer()
  weight4 = jq.NVFP4Quantizer(block_2d=True)
  input4 = jq.NVFP4Quantizer(rht=True)
  grad4 = jq.NVFP4Quantizer(rht=True, stochastic_rounding=True)
  yield ("fp8 delayed: expert weights, both copies",
         lambda w, s: jg.quantize_experts(w, delayed, state=s), (w, state))
  # the tokens of the MoE step (session 15: ~2.3 TB/s in train_lm --moe on an H200, where the
  # float32 weights ran at ~3.0): both copies from one read, the rowwise one packed
  grad_delayed = jq.Float8DelayedScalingQuantizer(dtype=jnp.float8_e5m2)
  fresh_dy = jg.init_state(grad_delayed, groups)
  state_dy = dataclasses.replace(fresh_dy, scale=jnp.ones_like(fresh_dy.scale))
  yield ("fp8 delayed: dy tokens, both copies (wgrad block 16)",
         lambda dy, sz, s: jg.quantize(dy, sz, grad_delayed, col_block=16, state=s),
         (dy, sizes, state_dy))
  yield ("fp8 current: dy, both copies (wgrad block 16)",
         lambda dy, sz: jg.quantize(dy, sz, current, col_block=16), (dy, sizes))
  yield ("nvfp4 16x16: expert weights, both copies",
         lambda w: jg.quantize_experts(w, weight4), (w,))
  yield ("nvfp4: x rowwise 1x16",
         lambda x, sz: jg.quantize(x, sz, input4, columnwise=False), (x, sizes))
  yield ("nvfp4: dy columnwise RHT + SR",
         lambda dy, sz, k: jg.quantize(dy, sz, grad4, rowwise=False, keys=k), (dy, sizes, keys))
  # one gathered launch for both copies (row_packed: the rowwise copy packed, the columnwise
  # one padded to the wgrad's token block), the kernel of design decision 33
  block = jq.Float8BlockQuantizer((1, 128))
  yield ("fp8 block 1x128: dy, both copies (one gathered launch)",
         lambda dy, sz: jg.quantize(dy, sz, block), (dy, sizes))
  yield ("mxfp8: dy, both copies (one gathered launch)",
         lambda dy, sz: jg.quantize(dy, sz, jq.MXFP8Quantizer()), (dy, sizes))
  # the copies GroupedDense makes for its decoded GEMMs (design decision 47): raw bfloat16
  # values where the bfloat16 CUTLASS kernel runs, else the codes as above
  yield ("mxfp8 decoded=True: dy, both copies",
         lambda dy, sz: jg.quantize(dy, sz, jq.MXFP8Quantizer(), decoded=True), (dy, sizes))
  yield ("mxfp8: expert weights, both copies",
         lambda w: jg.quantize_experts(w, jq.MXFP8Quantizer()), (w,))
  yield ("mxfp8 decoded=True: expert weights, both copies",
         lambda w: jg.quantize_experts(w, jq.MXFP8Quantizer(), decoded=True), (w,))
  # GroupedDense's forward copy in the weights' own layout (design decision 49: whole-row
  # stores of both copies, mxfp8_x_layout_kernel)
  yield ("mxfp8 decoded=True, columnwise along N: expert weights, both copies",
         lambda w: jg.quantize_experts(w, jq.MXFP8Quantizer(), decoded=True,
                                       columnwise_along_n=True), (w,))
  # float32 weights (Flax's default parameters), decision 47's kernel (session 24: an x-layout
  # form for float32 ran slower, bench/RESULTS.md)
  yield ("mxfp8 decoded=True: float32 expert weights, both copies",
         lambda w: jg.quantize_experts(w, jq.MXFP8Quantizer(), decoded=True),
         (w.astype(jnp.float32),))


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--tiny", action="store_true", help="small shapes (runs on CPU)")
  parser.add_argument("--shape", choices=sorted(SHAPES), default="llm",
                      help="llm: the 8-expert step's operands; moe64: the 64-expert step's")
  args = parser.parse_args(argv)
  spec = SHAPES["tiny" if args.tiny else args.shape]
  compiled = []
  for name, fn, fn_args in cases(*spec):
    compiled.append((name, jax.jit(fn).lower(*fn_args).compile(), fn_args))
  for index, (name, exe, fn_args) in enumerate(compiled):
    out = exe(*fn_args)
    jax.block_until_ready(out)
    leaves = jax.tree_util.tree_leaves(out)
    print(f"{index}: {name}: {len(leaves)} arrays, first {leaves[0].shape} {leaves[0].dtype}",
          flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
