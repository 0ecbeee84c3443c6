"""Compile time and program size of `bench/e2e.py`'s training step, per variant (issue 24).

    python bench/compile_time.py      # CPU: the d2048-like model, scaled down
    python bench/compile_time.py --size d2048 --variants bf16,fp8_current,fp8_delayed   # on a GPU

Per variant, in one process: trace + lower seconds (`jax.jit(step).lower(...)`, jaxquant's
Python and JAX's tracing), XLA compile seconds (`.compile()`), and the program's size: lines of
the lowered StableHLO, instructions of the compiled HLO, its fusions and custom calls (the FFI
kernels). Each variant is measured `--repeat` times (fresh trace each time: the minimum is
printed, the machine may be shared). Where delayed scaling's program is larger than current
scaling's, the difference is its per-tensor scalar code (the scale from the amax history).
"""

from __future__ import annotations

import argparse
import collections
import re
import sys
import time

import jax
import jax.numpy as jnp
import optax

import jaxquant.flax as jqf
import e2e
from e2e_model import SIZES, Config

# d2048's structure (4 blocks, 16 heads, MLP 4x, vocab 32000) at a width a CPU compiles quickly:
# compile time follows the number of operations, not their sizes.
SMALL = Config(vocab=32000, d_model=256, layers=4, heads=16, mlp=1024, seq=128, batch=4)


def measure(name: str, cfg: Config, repeat: int) -> dict:
  batches = jnp.zeros((2, cfg.batch, cfg.seq + 1), jnp.int32)
  tx = optax.adamw(1e-3)
  model, context, env = e2e.build_variant(name, cfg, attention=True)
  best = None
  with e2e.path_env(env), context():
    variables = dict(jax.jit(model.init)(jax.random.key(0), batches[0, :, :-1]))
    opt_state = jqf.init_optimizer(tx, variables)
    for _ in range(repeat):
      step = e2e.make_step(model, tx)  # a new function: traced again
      t0 = time.perf_counter()
      lowered = step.lower((variables, opt_state), batches, 0)
      t1 = time.perf_counter()
      compiled = lowered.compile()
      t2 = time.perf_counter()
      if best is None or t2 - t0 < best[0] + best[1]:
        best = (t1 - t0, t2 - t1, lowered, compiled)
  lower_s, compile_s, lowered, compiled = best
  text = compiled.as_text()
  ops = collections.Counter(re.findall(r"=\s*\S+\s+([\w-]+)\(", text))
  return dict(variant=name, lower_s=lower_s, compile_s=compile_s,
              stablehlo_lines=len(lowered.as_text().splitlines()), hlo_ops=sum(ops.values()),
              fusions=ops["fusion"], custom_calls=ops["custom-call"])


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--size", choices=["small", *sorted(SIZES)], default="small")
  parser.add_argument("--variants", default="bf16,fp8_current,fp8_delayed,modules_fp8_current,"
                                            "modules_fp8_delayed")
  parser.add_argument("--repeat", type=int, default=2)
  args = parser.parse_args(argv)
  cfg = SMALL if args.size == "small" else SIZES[args.size]
  device = jax.devices()[0]
  print(f"device: {getattr(device, 'device_kind', device)}; jax {jax.__version__}; {cfg}")
  rows = [measure(v.strip(), cfg, args.repeat) for v in args.variants.split(",") if v.strip()]
  base = {r["variant"]: r for r in rows}
  print("| variant | trace+lower s | compile s | vs current | StableHLO lines | HLO ops | "
        "fusions | custom calls |")
  print("|---|---:|---:|---:|---:|---:|---:|---:|")
  for r in rows:
    current = base.get(r["variant"].replace("delayed", "current"))
    total = r["lower_s"] + r["compile_s"]
    ratio = (f"{total / (current['lower_s'] + current['compile_s']):.2f}x"
             if current and current is not r else "-")
    print(f"| {r['variant']} | {r['lower_s']:.2f} | {r['compile_s']:.2f} | {ratio} | "
          f"{r['stablehlo_lines']} | {r['hlo_ops']} | {r['fusions']} | {r['custom_calls']} |")
  return 0


if __name__ == "__main__":
  sys.exit(main())
