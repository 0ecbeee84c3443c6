"""Grouped NVFP4 (or per-tensor FP8) quantize bandwidth next to the single-tensor kernel's.

    python bench/grouped_quantize.py                 # 8 and 64 experts at LLM sizes (a GPU)
    python bench/grouped_quantize.py --format fp8    # per-tensor FP8 (current, delayed)
    python bench/grouped_quantize.py --tiny          # smoke check (runs on CPU)
    python bench/grouped.py --quantize               # the same table after the step table

With `--format fp8` the rows are current-scaling FP8 copies (both directions, amax pass
included on both sides), then delayed scaling's (no amax pass: the quantize records the
amax), of the step's operands: x `[T, K]` (E4M3), dy `[T, N]` (E5M2, and
E4M3 to separate the encoder's cost) and the expert weights; bytes as below with no scales.

Each row quantizes the same bf16 matrix twice: `jaxquant.grouped.quantize` (tokens `x[T, K]`
sorted by group, one second-level scale per group: `jaxquant_grouped_quantize_nvfp4`) or
`jaxquant.grouped.quantize_experts` (`w[G, N, K]`, one amax per expert), and
`jaxquant.ops.quantize` of the same elements as one tensor (the single-tensor NVFP4 kernel,
`jaxquant_quantize_nvfp4`). The options are the NVFP4BlockScaling recipe's for that operand
(input: rowwise 1x16 and columnwise RHT; grad_output: stochastic rounding on both, RHT
columnwise; weights: 16x16 blocks, both copies). GB/s counts the bytes each must move at
least (bench/quantize.py's model): x read once (2 B/elem), each copy written once (0.5 B/elem
of E2M1 plus its E4M3 scales); both sides also run their amax pass, which is not counted.
"grouped/single" is the ratio of the two bandwidths (issue 15's bar: >= 1). "positions/rows"
is the grouped copy's token-layout length over the rows of x: a columnwise copy pads each
group to 16 positions and its static length is 16 floor((T + 15 G) / 16), so the grouped
kernel quantizes that many more rows than the single-tensor one (its ratio's ceiling at equal
per-row speed is rows/positions).
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np

import jaxquant as jq
import jaxquant.grouped as jg
from timing import bench  # bench/timing.py (this folder is on sys.path when run)

# (experts, routed rows T, K, N): the fc1 cases of bench/grouped.py
CASES = {8: (8, 16384, 4096, 14336), 64: (64, 16384, 2048, 1408)}
TINY = {8: (8, 256, 128, 64), 64: (64, 512, 64, 32)}

INPUT = jq.NVFP4Quantizer(rht=True)
GRAD = jq.NVFP4Quantizer(rht=True, stochastic_rounding=True)
WEIGHT = jq.NVFP4Quantizer(block_2d=True)


FP8_X = jq.Float8CurrentScalingQuantizer()
FP8_DY = jq.Float8CurrentScalingQuantizer(dtype=jnp.float8_e5m2)
# first_scale="one": the fresh state's scale is 1, so no just-in-time amax pass runs (the
# steady state of training; with the default "current" the first step reads x twice).
FP8_X_DELAYED = jq.Float8DelayedScalingQuantizer(first_scale="one")
FP8_DY_DELAYED = jq.Float8DelayedScalingQuantizer(dtype=jnp.float8_e5m2, first_scale="one")


def _bytes(elements: int, copies: int, scale_block: int) -> int:
  """NVFP4 (scale_block > 0): E2M1 copies plus scales; FP8 (scale_block 0): 1 B a value."""
  if scale_block == 0:
    return 2 * elements + copies * elements
  return 2 * elements + copies * (elements // 2 + elements // scale_block)


def _fp8_rows():
  """The per-tensor FP8 rows, as `_rows`: (name, grouped, single, copies, 0, operand)."""
  tok = lambda q: (lambda x, s, keys, key: jg.quantize(x, s, q, rowwise=True, columnwise=True))
  one = lambda q: (lambda x, s, keys, key: jq.ops.quantize(x, q, rowwise=True, columnwise=True))
  yield "x both E4M3", tok(FP8_X), one(FP8_X), 2, 0, "tokens"
  yield "dy both E5M2", tok(FP8_DY), one(FP8_DY), 2, 0, "grads"
  yield "dy both E4M3", tok(FP8_X), one(FP8_X), 2, 0, "grads"
  experts = lambda w, keys, key: jg.quantize_experts(w, FP8_X)
  single = lambda w, keys, key: jq.ops.quantize(w.reshape(-1, w.shape[-1]), FP8_X)
  yield "w both E4M3", experts, single, 2, 0, "experts"
  # Delayed scaling: no amax pass (first_scale="one": the fresh states hold scale 1, as after a
  # first step), the kernel records each group's amax while it quantizes.
  def delayed_tok(q):
    return lambda x, s, keys, key: jg.quantize(x, s, q, rowwise=True, columnwise=True,
                                               state=jg.init_state(q, s.shape[0]))
  def delayed_one(q):
    return lambda x, s, keys, key: jq.ops.quantize(x, q, rowwise=True, columnwise=True,
                                                   state=jq.init_state(q))
  x_q, dy_q = FP8_X_DELAYED, FP8_DY_DELAYED
  yield "x both E4M3 delayed", delayed_tok(x_q), delayed_one(x_q), 2, 0, "tokens"
  yield "dy both E5M2 delayed", delayed_tok(dy_q), delayed_one(dy_q), 2, 0, "grads"
  experts = lambda w, keys, key: jg.quantize_experts(
      w, FP8_X_DELAYED, state=jg.init_state(FP8_X_DELAYED, w.shape[0]))
  single = lambda w, keys, key: jq.ops.quantize(w.reshape(-1, w.shape[-1]), FP8_X_DELAYED,
                                                state=jq.init_state(FP8_X_DELAYED))
  yield "w both E4M3 delayed", experts, single, 2, 0, "experts"


def _rows():
  """(name, grouped fn, single-tensor fn, copies, scale block elements, operand) per row."""
  tok = lambda q, r, c: (lambda x, s, keys, key: jg.quantize(
      x, s, q, rowwise=r, columnwise=c, keys=keys))
  one = lambda q, r, c: (lambda x, s, keys, key: jq.ops.quantize(
      x, q, rowwise=r, columnwise=c, key=key))
  yield "x rowwise 1x16", tok(INPUT, True, False), one(INPUT, True, False), 1, 16, "tokens"
  yield "x columnwise RHT", tok(INPUT, False, True), one(INPUT, False, True), 1, 16, "tokens"
  yield "dy rowwise SR", tok(GRAD, True, False), one(GRAD, True, False), 1, 16, "tokens"
  yield "dy columnwise RHT+SR", tok(GRAD, False, True), one(GRAD, False, True), 1, 16, "tokens"
  experts = lambda w, keys, key: jg.quantize_experts(w, WEIGHT)
  single = lambda w, keys, key: jq.ops.quantize(w.reshape(-1, w.shape[-1]), WEIGHT)
  yield "w 16x16 both copies", experts, single, 2, 256, "experts"


def _positions(fn, args) -> int:
  """Rows (token-layout positions) of the grouped output: the columnwise copy's last axis when
  it is a token layout, else the rowwise copy's rows (expert weights: G N)."""
  out = jax.eval_shape(fn, *args)
  if out.rowwise is not None:
    return int(np.prod(out.rowwise.data.shape[:-1]))
  col = out.columnwise.data.shape
  return int(col[0] * col[2]) if len(col) == 3 else int(col[-1])


def run(experts: int, spec, timing: dict, seed: int = 0, fmt: str = "nvfp4",
        only: str = "") -> list[dict]:
  groups, t, k, n = spec
  rng = np.random.default_rng(seed)
  sizes = jnp.asarray(rng.multinomial(t, np.full(groups, 1.0 / groups)).astype(np.int32))
  x = jax.random.normal(jax.random.key(seed), (t, k), jnp.bfloat16)
  dy = jax.random.normal(jax.random.key(seed + 2), (t, n), jnp.bfloat16)
  w = jax.random.normal(jax.random.key(seed + 1), (groups, n, k), jnp.bfloat16)
  keys = jax.random.split(jax.random.key(1), groups)
  key = jax.random.key(2)
  print(f"\ngrouped {fmt.upper()} quantize, {groups} experts: tokens [{t}, {k}], grads "
        f"[{t}, {n}], experts [{groups}, {n}, {k}], bfloat16", flush=True)
  rows = []
  for name, grouped_fn, single_fn, copies, block, operand in (
      _fp8_rows() if fmt == "fp8" else _rows()):
    if only not in name:
      continue
    args = {"tokens": (x, sizes, keys, key), "grads": (dy, sizes, keys, key)}.get(
        operand, (w, keys, key))
    paths = {d.path for d in jq.explain(grouped_fn, *args) if d.op == "grouped_quantize"}
    nbytes = _bytes(int(np.prod(args[0].shape)), copies, block)
    grouped_s = bench(jax.jit(grouped_fn), *args, **timing)
    single_s = bench(jax.jit(single_fn), *args, **timing)
    positions = _positions(grouped_fn, args) / int(np.prod(args[0].shape[:-1]))
    row = dict(experts=groups, operand=name, mbytes=nbytes / 1e6, grouped_us=grouped_s * 1e6,
               grouped_gbs=nbytes / grouped_s / 1e9, single_us=single_s * 1e6,
               single_gbs=nbytes / single_s / 1e9, ratio=single_s / grouped_s, positions=positions,
               grouped_path=",".join(sorted(paths)))
    rows.append(row)
    print(f"  {name:24s} grouped {row['grouped_us']:8.1f} us {row['grouped_gbs']:6.0f} GB/s "
          f"({row['grouped_path']})  single {row['single_us']:8.1f} us "
          f"{row['single_gbs']:6.0f} GB/s  grouped/single {row['ratio']:.2f}  "
          f"positions/rows {row['positions']:.3f}", flush=True)
  return rows


def print_table(rows: list[dict]) -> None:
  print("\n| experts | operand | MB | grouped us | grouped GB/s | single-tensor us | "
        "single-tensor GB/s | grouped/single | positions/rows | grouped path |")
  print("|---|---|---|---|---|---|---|---|---|---|")
  for r in rows:
    print(f"| {r['experts']} | {r['operand']} | {r['mbytes']:.0f} | {r['grouped_us']:.1f} | "
          f"{r['grouped_gbs']:.0f} | {r['single_us']:.1f} | {r['single_gbs']:.0f} | "
          f"{r['ratio']:.2f} | {r['positions']:.3f} | {r['grouped_path']} |")


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--experts", type=int, nargs="+", choices=sorted(CASES),
                      default=sorted(CASES))
  parser.add_argument("--tiny", action="store_true", help="tiny sizes (a CPU smoke check)")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--format", choices=["nvfp4", "fp8"], default="nvfp4",
                      help="NVFP4 (the recipe's options) or per-tensor FP8 (current scaling)")
  parser.add_argument("--only", default="", help="only the rows whose name contains this")
  args = parser.parse_args(argv)
  timing = dict(repeats=1, calls=1, warmup=1) if args.tiny else dict(repeats=5, calls=10,
                                                                      warmup=2)
  device = jax.devices()[0]
  print(f"device: {getattr(device, 'device_kind', str(device))}; jax {jax.__version__}")
  cases = TINY if args.tiny else CASES
  rows = []
  for experts in args.experts:
    rows += run(experts, cases[experts], timing, args.seed, args.format, args.only)
  print_table(rows)
  return 0


if __name__ == "__main__":
  sys.exit(main())
