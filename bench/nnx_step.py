"""Training-step time of the NNX transformer of `examples/nnx_quantize.py`, bf16 vs the same
model quantized with one `jaxquant.nnx.quantize_model` call, side by side on one card.

    PYTHONPATH=examples python bench/nnx_step.py          # d_model 2048, 4 layers, seq 1024
    PYTHONPATH=examples python bench/nnx_step.py --recipes fp8_current,mxfp8 --json out.json

One step = `nnx.value_and_grad` of the next-token loss + `nnx.Optimizer` (AdamW) update, one
`nnx.jit` program. Time = median over repeats of (R back-to-back steps) / R after warm-up.
Every model is built from the same seed and trained on the same batch.
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from timing import bench  # bench/timing.py (this folder is on sys.path when run)

try:  # examples/ must be on the path: PYTHONPATH=examples (bench/run.py sets it)
  import nnx_quantize
  from lm import recipes
except ModuleNotFoundError as err:
  if err.name not in ("lm", "train_lm", "nnx_quantize"):
    raise
  raise SystemExit(f"bench/nnx_step.py imports examples/ ({err}): run it as "
                   "PYTHONPATH=examples python bench/nnx_step.py") from err

import jaxquant


def step_time(cfg, recipe_name: str, tokens: jax.Array, args) -> dict:
  model, swaps = nnx_quantize.build(cfg, recipe_name, seed=0)
  optimizer = nnx.Optimizer(model, optax.adamw(1e-4), wrt=nnx.Param)

  def step(tokens):
    return nnx_quantize.train_step(model, optimizer, tokens)

  report = jaxquant.explain(lambda: nnx_quantize.loss_fn(model, tokens)) if swaps else []
  seconds = bench(step, tokens, repeats=args.repeats, calls=args.calls)
  return {"recipe": recipe_name, "step_ms": seconds * 1e3, "swapped": len(swaps),
          "gemm_paths": sorted({d.path for d in report if d.op == "gemm"})}


def main(argv=None) -> list[dict]:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--recipes", default="fp8_current")
  parser.add_argument("--d-model", type=int, default=2048)
  parser.add_argument("--layers", type=int, default=4)
  parser.add_argument("--heads", type=int, default=16)
  parser.add_argument("--seq", type=int, default=1024)
  parser.add_argument("--batch", type=int, default=8)
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--calls", type=int, default=5)
  parser.add_argument("--json", default=None)
  args = parser.parse_args(argv)
  cfg = nnx_quantize.Config(vocab=256, d_model=args.d_model, layers=args.layers,
                            heads=args.heads)
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, (args.batch, args.seq + 1)),
                       jnp.int32)
  names = [recipes.BASELINE] + [n for n in recipes.parse(args.recipes) if n != recipes.BASELINE]
  rows = [step_time(cfg, name, tokens, args) for name in names]
  base = rows[0]["step_ms"]
  print(f"device: {jax.devices()[0].device_kind}; d_model {args.d_model}, {args.layers} layers, "
        f"{args.heads} heads, seq {args.seq}, batch {args.batch}")
  for row in rows:
    row["speedup_vs_bf16"] = base / row["step_ms"]
    print(f"{row['recipe']:>14s}  {row['step_ms']:8.2f} ms/step  {row['speedup_vs_bf16']:.3f}x "
          f"bf16  swapped {row['swapped']}  gemm paths {row['gemm_paths']}")
  if args.json:
    with open(args.json, "w") as f:
      json.dump({"config": vars(args), "device": jax.devices()[0].device_kind, "rows": rows}, f,
                indent=1)
  return rows


if __name__ == "__main__":
  main()
