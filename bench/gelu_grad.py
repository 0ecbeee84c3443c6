"""The gelu gradient behind fc1's GEMM epilogue: which formulation XLA runs fastest.

With the gelu in fc1's GEMM (`jaxquant.ops.gemm_gelu`, design decision 60) the backward has no
residual of a forward gelu in XLA, and its fusion (`dh = da * gelu'(h)` with fc1's bias
gradient, the sum of `dh` over the rows) measured 74 µs a layer slower than the unfused MLP's
at the d2048 shape (bench/RESULTS.md "Session 36"). Each candidate below computes that pair,
`(dh, dbias)` from `da` and `h` (both `[M, N]` bfloat16), and the table gives its time per call
and its bytes' rate:

  vjp        JAX's derivative of `jax.nn.gelu` at `h` (`jax.vjp`), the bias gradient reduced in
             dh's dtype: what `ActivationEpilogue.gradient` ran until session 37.
  tanh_f32   the derivative written out in float32 from one `tanh`:
             0.5 (1 + t) + 0.5 x (1 - t^2) c (1 + 3 k x^2),  t = tanh(c (x + k x^3)):
             `jaxquant.layers.fused_activation.gelu_gradient`, what it runs since (the
             fastest here on an H200, job s37b).
  sigmoid    the same function through a sigmoid (`jax.nn.sigmoid`) of v = 2 c (x + k x^3),
             as jaxquant's spec writes gelu: s + x s (1 - s) v'.
  split      `vjp`'s dh in one fusion and the bias reduction in another (an optimization
             barrier between them).
  unfused    for reference, the unfused MLP's pair: the forward gelu (which may keep a residual
             for its backward) and its backward, timed together.

    PYTHONPATH=. python bench/gelu_grad.py --json out.json   [--m 16384 --n 8192]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Callable

import jax
import jax.numpy as jnp

from jaxquant.layers.fused_activation import gelu_gradient
from timing import bench, card

C = math.sqrt(2.0 / math.pi)
K = 0.044715


def _bias_grad(dh: jax.Array) -> jax.Array:
  """fc1's bias gradient as the unfused dense reduces it: over the rows, in dh's dtype."""
  return jax.lax.reduce(dh, jnp.zeros((), dh.dtype), jax.lax.add, (0,)).astype(jnp.float32)


def vjp(da, h):
  _, pullback = jax.vjp(lambda v: jax.nn.gelu(v), h)
  (dh,) = pullback(da)
  return dh, _bias_grad(dh)


def tanh_f32(da, h):
  dh = gelu_gradient(da, h)
  return dh, _bias_grad(dh)


def sigmoid(da, h):
  x = h.astype(jnp.float32)
  s = jax.nn.sigmoid(2.0 * C * (x + K * x * x * x))
  dv = 2.0 * C * (1.0 + 3.0 * K * x * x)
  dh = (da.astype(jnp.float32) * (s + x * s * (1.0 - s) * dv)).astype(h.dtype)
  return dh, _bias_grad(dh)


def split(da, h):
  _, pullback = jax.vjp(lambda v: jax.nn.gelu(v), h)
  (dh,) = pullback(da)
  dh = jax.lax.optimization_barrier(dh)
  return dh, _bias_grad(dh)


def unfused(da, h):
  a, pullback = jax.vjp(lambda v: jax.nn.gelu(v), h)
  (dh,) = pullback(da)
  return a, dh, _bias_grad(dh)


CANDIDATES: dict[str, Callable] = {"vjp": vjp, "tanh_f32": tanh_f32, "sigmoid": sigmoid,
                                   "split": split, "unfused": unfused}
# Bytes each candidate must move at least: reads da and h, writes dh (unfused: and a).
BYTES = {name: 3 for name in CANDIDATES} | {"unfused": 4}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--m", type=int, default=16384)
  parser.add_argument("--n", type=int, default=8192)
  parser.add_argument("--json", default=None)
  args = parser.parse_args()
  key_h, key_da = jax.random.split(jax.random.key(0))
  h = (jax.random.normal(key_h, (args.m, args.n), jnp.float32) * 2).astype(jnp.bfloat16)
  da = (jax.random.normal(key_da, (args.m, args.n), jnp.float32) * 1e-3).astype(jnp.bfloat16)
  want = jax.jit(vjp)(da, h)
  rows = []
  for name, fn in CANDIDATES.items():
    compiled = jax.jit(fn)
    out = compiled(da, h)
    dh, dbias = out[-2], out[-1]
    err = float(jnp.max(jnp.abs(dh.astype(jnp.float32) - want[0].astype(jnp.float32))))
    seconds = bench(compiled, da, h, repeats=7, calls=10)
    moved = BYTES[name] * args.m * args.n * 2
    rows.append(dict(candidate=name, us=seconds * 1e6, tb_s=moved / seconds / 1e12,
                     max_dh_difference_from_vjp=err,
                     dbias_relative_difference=float(jnp.linalg.norm(dbias - want[1])
                                                     / jnp.linalg.norm(want[1]))))
  print(f"{card()}; jax {jax.__version__}; [{args.m}, {args.n}] bfloat16")
  print("| candidate | µs | TB/s (minimum bytes) | max |dh - vjp's| | dbias rel. diff |")
  print("|---|---:|---:|---:|---:|")
  for r in rows:
    print(f"| {r['candidate']} | {r['us']:.1f} | {r['tb_s']:.2f} | "
          f"{r['max_dh_difference_from_vjp']:.3g} | {r['dbias_relative_difference']:.3g} |")
  if args.json:
    with open(args.json, "w") as f:
      json.dump(dict(card=card(), m=args.m, n=args.n, rows=rows), f, indent=1)


if __name__ == "__main__":
  sys.exit(main())
