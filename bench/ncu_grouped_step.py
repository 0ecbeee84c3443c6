"""One GroupedDense step of bench/grouped.py, compiled, warmed up and then run once, for Nsight
Compute.

    ncu --clock-control none -k device_kernel --launch-skip 3 --launch-count 3 \
        --section SpeedOfLight --section WarpStateStats python bench/ncu_grouped_step.py \
        --experts 8 --recipe DelayedScaling

The step is bench/grouped.py's (same shapes, drawn group sizes, bf16 params and tokens). The
warm-up run launches every kernel of the step once, so `--launch-skip` with the step's count of
matching kernels makes the profiler read the second run's launches. `--tiny` runs small shapes
(a CPU smoke check). Timings come from bench/grouped.py; this script only gives a profiler the
step's kernels to read.
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np

import grouped  # bench/grouped.py (this folder is on sys.path when run)
import jaxquant as jq
import jaxquant.flax  # noqa: F401


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--experts", type=int, choices=sorted(grouped.CASES), default=8)
  parser.add_argument("--recipe", choices=sorted(grouped.RECIPES), default=None,
                      help="a recipe of bench/grouped.py (none: the bf16 GroupedDense)")
  parser.add_argument("--tiny", action="store_true", help="small shapes (runs on CPU)")
  args = parser.parse_args(argv)
  groups, t, k, n, what = (grouped.TINY if args.tiny else grouped.CASES)[args.experts]
  rng = np.random.default_rng(0)
  sizes = jnp.asarray(grouped.group_sizes(rng, t, groups))
  x = jnp.asarray(rng.standard_normal((t, k), np.float32), jnp.bfloat16)
  dy = jnp.asarray(rng.standard_normal((t, n), np.float32), jnp.bfloat16)
  recipe = grouped.RECIPES[args.recipe]() if args.recipe else None
  model = jq.flax.GroupedDense(features=n, num_groups=groups, use_bias=False,
                               dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, recipe=recipe)
  variables = jax.jit(model.init)(jax.random.key(0), x, sizes)
  step = grouped.step_fn(model)
  key = jax.random.key(1)
  for run in ("warm-up", "profiled"):
    out = step(variables, x, sizes, dy, key)
    jax.block_until_ready(out)
    print(f"{run}: {groups} experts ({what}), {args.recipe or 'bf16'}: y {out[0].shape}",
          flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
