"""Dense forward + backward time, side by side on one card: `jaxquant.flax.Dense` under each
built-in recipe vs bf16 `flax.linen.Dense` and Flax's `Fp8DirectDotGeneralOp`.

    python bench/dense.py                       # 16384 tokens x 8192 -> 8192, bf16, bias
    python bench/dense.py --tokens 4096 --json out.json

One step = y, vjp = jax.vjp(apply, variables, x); vjp(dy): the forward GEMM, dgrad and wgrad
(and every quantize / amax / state update the recipe needs), jitted as one program. Time =
median over repeats of (R back-to-back steps) / R after warm-up; fresh random inputs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax.linen import fp8_ops

import jaxquant as jq
from timing import bench  # bench/timing.py (this folder is on sys.path when run)
import jaxquant.flax  # noqa: F401

RECIPES = {
    "Float8CurrentScaling": lambda: jq.recipes.Float8CurrentScaling(),
    "DelayedScaling": lambda: jq.recipes.DelayedScaling(),
    "Float8BlockScaling": lambda: jq.recipes.Float8BlockScaling(),
    "MXFP8BlockScaling": lambda: jq.recipes.MXFP8BlockScaling(),
    "NVFP4BlockScaling": lambda: jq.recipes.NVFP4BlockScaling(),
}


def step_fn(model):
  def step(variables, x, dy, key):
    apply = lambda v, x: model.apply(v, x, rngs={"quantize": key})
    y, vjp = jax.vjp(apply, variables, x)
    return y, vjp(dy)
  return jax.jit(step)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--tokens", type=int, default=16384)
  parser.add_argument("--in-features", type=int, default=8192)
  parser.add_argument("--features", type=int, default=8192)
  parser.add_argument("--json", default=None)
  args = parser.parse_args(argv)
  device = jax.devices()[0]
  card = getattr(device, "device_kind", str(device))
  t, k, n = args.tokens, args.in_features, args.features
  print(f"device: {card}; Dense {t} tokens x {k} -> {n}, bfloat16", flush=True)
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((t, k), np.float32), jnp.bfloat16)
  dy = jnp.asarray(rng.standard_normal((t, n), np.float32), jnp.bfloat16)
  key = jax.random.key(1)
  common = dict(features=n, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
  models = {
      "flax nn.Dense (bf16)": nn.Dense(**common),
      "flax Fp8DirectDotGeneralOp": nn.Dense(**common,
                                             dot_general_cls=fp8_ops.Fp8DirectDotGeneralOp),
  }
  for name, make in RECIPES.items():
    models[f"jaxquant {name}"] = jq.flax.Dense(**common, recipe=make())
  # The same recipe with fast FP8 accumulation in dgrad/wgrad too (default: forward only), and
  # with the handler's opt-in one-time timing of cuBLASLt's heuristic candidates.
  env = {"jaxquant Float8CurrentScaling, fast acc all": {"JAXQUANT_FP8_ACCUMULATION": "fast"},
         "jaxquant Float8CurrentScaling, autotuned": {"JAXQUANT_GEMM_AUTOTUNE": "1"}}
  for name in env:
    models[name] = jq.flax.Dense(**common, recipe=RECIPES["Float8CurrentScaling"]())
  flops = 3 * 2 * t * k * n
  results, base = [], None
  for name, model in models.items():
    for var in ("JAXQUANT_FP8_ACCUMULATION", "JAXQUANT_GEMM_AUTOTUNE"):
      os.environ.pop(var, None)
    os.environ.update(env.get(name, {}))  # read when the step is traced / the GEMM runs
    variables = model.init(jax.random.key(0), x)
    step = step_fn(model)
    paths = ""
    if name.startswith("jaxquant"):
      paths = ",".join(sorted(jq.explain(step, variables, x, dy, key).paths("gemm")))
    try:
      sec = bench(step, variables, x, dy, key)
    except Exception as e:  # noqa: BLE001
      print(f"  {name}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
      continue
    base = sec if base is None else base
    row = dict(case=name, ms=sec * 1e3, tflops=flops / sec / 1e12, speedup_vs_bf16=base / sec,
               gemm_paths=paths, card=card)
    results.append(row)
    print(f"  {name:34s} {sec * 1e3:8.3f} ms  {row['tflops']:6.1f} TFLOP/s  "
          f"{row['speedup_vs_bf16']:5.2f}x  {paths}", flush=True)
  for var in ("JAXQUANT_FP8_ACCUMULATION", "JAXQUANT_GEMM_AUTOTUNE"):
    os.environ.pop(var, None)
  # Where the Float8CurrentScaling step's time goes besides the three GEMMs: its quantize calls.
  fp8 = RECIPES["Float8CurrentScaling"]()
  roles = [jq.QuantizerRole("linear", r, "Dense_0") for r in ("input", "weight", "grad_output")]
  w = jnp.asarray(rng.standard_normal((k, n), np.float32) * 0.02, jnp.bfloat16)
  for role, tensor in zip(roles, (x, w.T, dy)):
    qz = fp8.quantizer(role)
    fn = jax.jit(lambda v, qz=qz: jq.ops.quantize(v, qz, rowwise=True, columnwise=True))
    sec = bench(fn, tensor)
    row = dict(case=f"quantize {role.tensor_type} (rowwise+columnwise, FP8 current)",
               ms=sec * 1e3, tflops=0.0, speedup_vs_bf16=0.0, gemm_paths="", card=card)
    results.append(row)
    print(f"  {row['case']:34s} {sec * 1e3:8.3f} ms", flush=True)
  print("\n| case | ms | effective TFLOP/s | speedup vs bf16 nn.Dense | GEMM paths |")
  print("|---|---|---|---|---|")
  for r in results:
    print(f"| {r['case']} | {r['ms']:.2f} | {r['tflops']:.0f} | {r['speedup_vs_bf16']:.2f}x | "
          f"{r['gemm_paths']} |")
  if args.json:
    with open(args.json, "w") as f:
      json.dump(results, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
