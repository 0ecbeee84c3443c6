"""The embedding table's gradient: which formulation XLA runs fastest on the e2e model's tokens.

`nn.Embed`'s gradient is XLA's scatter-add of `dy` (bfloat16, the compute dtype) into the table
(promoted to bfloat16 for the gather), then cast to the float32 parameter: on the d2048 model's
byte-pair tokens (~1200 distinct ids in 16384) that scatter is 6.6-8.2 ms of every step
(bench/RESULTS.md, sessions 35-36), the largest kernel of the step and its largest noise. Each
candidate below computes the float32 table gradient `[vocab, d]` from the ids `[B, S]` and `dy`
`[B, S, d]` bfloat16:

  flax       `jax.vjp` of `nn.Embed`'s lookup (`jnp.take` of the bfloat16-promoted table).
  f32        a scatter-add of `dy` cast to float32 into a float32 table (native float32 atomics;
             the sum itself in float32).
  sorted     the ids sorted first (`argsort`), `dy`'s rows gathered in that order, then a
             float32 `segment_sum` told its indices are sorted.
  onehot     `one_hot(ids)^T @ dy` in bfloat16 with a float32 accumulator (a dense GEMM of
             2 T V d FLOPs: no atomics, 2.1 TFLOP at d2048).

    PYTHONPATH=examples:bench python bench/embed_grad.py --json out.json [--size d2048]
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from e2e_model import SIZES, text_batches
from timing import bench, card


def flax(ids, dy, vocab):
  table = jnp.zeros((vocab, dy.shape[-1]), jnp.float32)
  _, pullback = jax.vjp(lambda t: jnp.take(t.astype(dy.dtype), ids, axis=0), table)
  return pullback(dy)[0]


def f32(ids, dy, vocab):
  table = jnp.zeros((vocab, dy.shape[-1]), jnp.float32)
  return table.at[ids.reshape(-1)].add(dy.reshape(-1, dy.shape[-1]).astype(jnp.float32))


def sorted_segments(ids, dy, vocab):
  flat = ids.reshape(-1)
  order = jnp.argsort(flat)
  rows = jnp.take(dy.reshape(-1, dy.shape[-1]), order, axis=0).astype(jnp.float32)
  return jax.ops.segment_sum(rows, flat[order], vocab, indices_are_sorted=True)


def onehot(ids, dy, vocab):
  hot = jax.nn.one_hot(ids.reshape(-1), vocab, dtype=dy.dtype)
  return jnp.einsum("tv,td->vd", hot, dy.reshape(-1, dy.shape[-1]),
                    preferred_element_type=jnp.float32)


CANDIDATES: dict[str, Callable] = {"flax": flax, "f32": f32, "sorted": sorted_segments,
                                   "onehot": onehot}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--size", default="d2048", choices=sorted(SIZES))
  parser.add_argument("--batches", type=int, default=3, help="token batches timed, each apart")
  parser.add_argument("--json", default=None)
  args = parser.parse_args()
  cfg = SIZES[args.size]
  tokens = text_batches(cfg, args.batches)
  dy = (jax.random.normal(jax.random.key(0), (cfg.batch, cfg.seq, cfg.d_model), jnp.float32)
        * 1e-3).astype(jnp.bfloat16)
  rows = []
  for b in range(args.batches):
    ids = tokens[b][:, :-1]  # the inputs (the last column is the last target)
    counts = np.bincount(np.asarray(ids).reshape(-1), minlength=cfg.vocab)
    x64 = np.zeros((cfg.vocab, cfg.d_model))
    np.add.at(x64, np.asarray(ids).reshape(-1), np.asarray(dy.astype(jnp.float32), np.float64)
              .reshape(-1, cfg.d_model))
    for name, fn in CANDIDATES.items():
      compiled = jax.jit(fn, static_argnums=2)
      got = np.asarray(compiled(ids, dy, cfg.vocab), np.float64)
      seconds = bench(compiled, ids, dy, cfg.vocab, repeats=5, calls=5)
      rows.append(dict(batch=b, candidate=name, ms=seconds * 1e3,
                       distinct_ids=int((counts > 0).sum()), most_repeated=int(counts.max()),
                       relative_error=float(np.linalg.norm(got - x64) / np.linalg.norm(x64))))
  print(f"{card()}; jax {jax.__version__}; {args.size}: {cfg.batch}x{cfg.seq} ids, "
        f"vocab {cfg.vocab}, d {cfg.d_model}")
  print("| batch | distinct ids | most repeated | candidate | ms | rel. error vs float64 |")
  print("|---:|---:|---:|---|---:|---:|")
  for r in rows:
    print(f"| {r['batch']} | {r['distinct_ids']} | {r['most_repeated']} | {r['candidate']} | "
          f"{r['ms']:.3f} | {r['relative_error']:.2e} |")
  if args.json:
    with open(args.json, "w") as f:
      json.dump(dict(card=card(), size=args.size, rows=rows), f, indent=1)


if __name__ == "__main__":
  sys.exit(main())
