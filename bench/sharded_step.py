"""Step time of `examples/train_lm.py`'s training step on one device vs a data-parallel mesh.

The same model, recipe and global batch; one process, so both runs share the card, the jax
version and the warm-up. Tokens are random bytes (the step time does not depend on them). Each
step is timed to the loss being ready, as train_lm.py does; the median of `--steps` steps after
`--warmup` is reported.

    PYTHONPATH=examples python bench/sharded_step.py --mesh dp=2 --recipe fp8_current \\
        --json out.json
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

try:  # examples/ must be on the path: PYTHONPATH=examples (bench/run.py sets it)
  from lm import recipes, sharding, training
  from lm.model import GPT, LMConfig
  import train_lm
except ModuleNotFoundError as err:
  if err.name not in ("lm", "train_lm", "nnx_quantize"):
    raise
  raise SystemExit(f"bench/sharded_step.py imports examples/ ({err}): run it as "
                   "PYTHONPATH=examples python bench/sharded_step.py") from err


def time_steps(model, tokens, cfg, mesh, steps: int, warmup: int) -> dict:
  with sharding.active(mesh):
    state = training.create_state(model, tokens, cfg, mesh)
    train_step, _ = training.make_steps(model, state if mesh is not None else None)
    batch = sharding.put_batches(mesh, tokens)
    key = jax.random.key(0)
    t0 = time.perf_counter()
    state, loss = train_step(state, batch, key)
    float(loss)
    compile_s = time.perf_counter() - t0
    times = []
    for step in range(warmup + steps):
      t0 = time.perf_counter()
      state, loss = train_step(state, batch, jax.random.fold_in(key, step))
      float(loss)
      if step >= warmup:
        times.append(time.perf_counter() - t0)
  return {"median_ms": 1e3 * statistics.median(times), "min_ms": 1e3 * min(times),
          "first_step_s": compile_s, "loss": float(loss)}


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--mesh", type=train_lm.parse_mesh, default={"dp": 2})
  p.add_argument("--recipe", default="fp8_current")
  p.add_argument("--d-model", type=int, default=1024)
  p.add_argument("--layers", type=int, default=4)
  p.add_argument("--heads", type=int, default=16)
  p.add_argument("--seq", type=int, default=512)
  p.add_argument("--batch", type=int, default=32, help="global batch (sequences)")
  p.add_argument("--steps", type=int, default=20)
  p.add_argument("--warmup", type=int, default=3)
  p.add_argument("--json", type=pathlib.Path, default=None)
  args = p.parse_args()
  with training.jaxquant_backend(training.default_backend()):
    config = LMConfig(seq=args.seq, d_model=args.d_model, layers=args.layers, heads=args.heads,
                      dtype=jnp.bfloat16)
    model = GPT(config, recipes.make(args.recipe))
    tokens = np.random.default_rng(0).integers(0, 256, (args.batch, args.seq + 1), np.int32)
    cfg = training.TrainConfig(steps=args.steps + args.warmup + 1)
    mesh = sharding.make_mesh(args.mesh)
    results = {"device": jax.devices()[0].device_kind, "jax": jax.__version__,
               "recipe": args.recipe, "mesh": args.mesh, "global_batch": args.batch,
               "seq": args.seq, "d_model": args.d_model, "layers": args.layers}
    results["one_device"] = time_steps(model, tokens, cfg, None, args.steps, args.warmup)
    results["mesh_run"] = time_steps(model, tokens, cfg, mesh, args.steps, args.warmup)
  one, many = results["one_device"]["median_ms"], results["mesh_run"]["median_ms"]
  results["speedup"] = one / many
  print(json.dumps(results, indent=1))
  print(f"{args.recipe}: 1 device {one:.2f} ms/step, mesh {args.mesh} {many:.2f} ms/step "
        f"({one / many:.2f}x) on {results['device']}")
  if args.json:
    args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
  main()
