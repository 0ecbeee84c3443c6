"""One mixture-of-experts block, forward + backward, and where its GPU time goes.

The block is `examples/lm/moe.py`'s `MoEMLP` as `train_lm --moe` builds it (bfloat16 compute,
float32 parameters, a float32 router, dropless top-k routing, `GroupedDense` experts fc1 -> GELU
-> fc2, the weighted combine), at fine- and coarse-grained sizes where the expert GEMMs are
realistic:

  8 experts, top-2:  8192 tokens, d_model 4096, expert hidden 14336 (Mixtral-8x7B's MLP)
  64 experts, top-8: 2048 tokens, d_model 2048, expert hidden 1408 (Qwen1.5-MoE-style)

    export PYTHONPATH=examples                   # `lm` (bench/run.py sets it for its jobs)
    python bench/moe_block.py                    # both cases, bf16 and FP8 (a GPU)
    python bench/moe_block.py --trace /tmp/moe   # + the GPU time of each part
    python bench/moe_block.py --experts 64 --recipes bf16 fp8_delayed --json out.json
    python bench/moe_block.py --before --trace /tmp/moe  # + the pre-issue-23 block
    python bench/moe_block.py --tiny             # smoke check at tiny sizes (CPU)

One step = `y, vjp = jax.vjp(block.apply, variables, x); vjp(dy)`, jitted (both weight and input
gradients); time = median over repeats of R back-to-back steps / R after warm-up. A delayed-
scaling block is timed in its state from step 2 on (every expert has a scale).

`--trace DIR` runs a few more steps under `jax.profiler.trace(DIR, create_perfetto_trace=True)`
(open `DIR/plugins/profile/*/perfetto_trace.json.gz` at ui.perfetto.dev) and sums the GPU
kernels of the trace by part. A kernel's part is the `jax.named_scope` of `lm.moe.SCOPES` in
the op_name metadata of the HLO instruction that launched it (the trace event's `hlo_op`, or the
kernel name matched to a fusion of the compiled program); inside the experts' scope a kernel is
an expert GEMM or quantization by its name (bench/e2e_trace.py's patterns). The share of GPU
time the mapping could not place is printed, with the largest such kernels.
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import os
import shutil
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

import e2e_trace  # bench/e2e_trace.py (this folder is on sys.path when run)
import jaxquant as jq
from lm import moe, recipes
from lm.model import LMConfig
from timing import bench  # bench/timing.py

# experts -> (top_k, tokens, d_model, expert hidden, description)
CASES = {
    8: (2, 8192, 4096, 14336, "Mixtral-8x7B MLP: 8192 tokens x top-2"),
    64: (8, 2048, 2048, 1408, "Qwen1.5-MoE-style: 2048 tokens x top-8"),
}
TINY = {8: (2, 128, 64, 128, "tiny"), 64: (8, 64, 32, 48, "tiny")}
DEFAULT_RECIPES = ("bf16", "fp8_current", "fp8_delayed")
SEQ = 2048  # tokens per sequence (train_lm's long-context runs); fewer tokens: one sequence

# The parts reported, in order. Expert GEMMs and their quantization are the work the block
# exists for; every other part should stay under TARGET_SHARE of the block's GPU time.
PARTS = ("expert GEMMs", "quantization", "experts: other", "router", "top-k / sort",
         "dispatch gather", "activation", "combine", "other")
SCOPE_PARTS = {moe.SCOPES["router"]: "router", moe.SCOPES["route"]: "top-k / sort",
               moe.SCOPES["dispatch"]: "dispatch gather", moe.SCOPES["activation"]: "activation",
               moe.SCOPES["combine"]: "combine", moe.SCOPES["experts"]: "experts"}
EXPERT_WORK = ("expert GEMMs", "quantization")
TARGET_SHARE = 0.20


class PlainPermutationMoE(moe.MoEMLP):
  """The block as it was before issue 23 (`--before`): two argsorts, the rows gathered and
  unsorted by plain indexing (autodiff's scatter-adds in the backward), a bincount, the combine
  in bf16. Same parameters as `MoEMLP`, same scopes."""

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    cfg = self.config
    experts, top_k = cfg.moe
    batch, seq, d_model = x.shape
    tokens = x.reshape(-1, d_model)
    with jax.named_scope(moe.SCOPES["router"]):
      logits = nn.Dense(experts, use_bias=False, dtype=jnp.float32, name="router")(
          tokens.astype(jnp.float32))
      probs = jax.nn.softmax(logits, axis=-1)
    with jax.named_scope(moe.SCOPES["route"]):
      weights, chosen = jax.lax.top_k(probs, top_k)
      weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
      expert_ids = chosen.reshape(-1)
      order = jnp.argsort(expert_ids, stable=True)
      group_sizes = jnp.bincount(expert_ids, length=experts).astype(jnp.int32)
    with jax.named_scope(moe.SCOPES["dispatch"]):
      routed = tokens[order // top_k]
    with jax.named_scope(moe.SCOPES["experts"]):
      h = self._experts(self._hidden(d_model), "fc1", False)(routed, group_sizes)
    with jax.named_scope(moe.SCOPES["activation"]):
      h = nn.gelu(h)
    with jax.named_scope(moe.SCOPES["experts"]):
      out = self._experts(d_model, "fc2", False)(h, group_sizes)
    with jax.named_scope(moe.SCOPES["combine"]):
      out = out[jnp.argsort(order)].reshape(-1, top_k, d_model)
      y = jnp.sum(out * weights[..., None].astype(out.dtype), axis=1)
    with jax.named_scope(moe.SCOPES["router"]):
      aux = moe.load_balancing_loss(probs, expert_ids, experts)
    return moe.add_aux_loss(y, cfg.moe_aux_weight * aux).reshape(batch, seq, d_model)


def make_block(experts: int, top_k: int, d_model: int, hidden: int, recipe_name: str,
               before: bool = False):
  config = LMConfig(d_model=d_model, heads=1, mlp_ratio=1, dtype=jnp.bfloat16,
                    moe=(experts, top_k))
  return (PlainPermutationMoE if before else moe.MoEMLP)(config, recipes.make(recipe_name),
                                                          hidden=hidden)


def step_fn(block):
  def step(variables, x, dy, key):
    apply = lambda v, x: block.apply(v, x, rngs={"quantize": key})
    y, vjp = jax.vjp(apply, variables, x)
    return y, vjp(dy)
  return jax.jit(step)


def inputs(tokens: int, d_model: int, seed: int):
  rng = np.random.default_rng(seed)
  seq = min(SEQ, tokens)
  shape = (tokens // seq, seq, d_model)
  x = jnp.asarray(rng.standard_normal(shape, np.float32), jnp.bfloat16)
  dy = jnp.asarray(rng.standard_normal(shape, np.float32) * 1e-2, jnp.bfloat16)
  return x, dy


# --------------------------------------- the split by part -------------------------------------

def scope_of(text: str) -> str | None:
  """The innermost `lm.moe.SCOPES` name in an op_name (or any other string), else None."""
  found = [(text.rfind(scope), scope) for scope in SCOPE_PARTS if scope in text]
  return max(found)[1] if found else None


# Kernel-name marks of jaxquant's grouped GEMMs (CUTLASS's grouped kernel and its setup, the
# mma.sync kernels): in this block only the experts run them.
GROUPED_GEMM_KERNELS = ("GroupProblemShape", "jqffi::sm90::", "grouped_gemm")


def part_of(kernel: str, op_name: str | None) -> tuple[str, bool]:
  """(part, placed by a scope?) of one kernel launched by the op with `op_name`."""
  scope = scope_of(op_name) if op_name else None
  kind = e2e_trace.classify(kernel)
  if scope is None:  # e.g. kernels replayed from an XLA command buffer (no op of their own)
    if kind == "quantize":  # jaxquant's kernels serve only the experts in this block
      return "quantization", False
    if any(mark in kernel for mark in GROUPED_GEMM_KERNELS):  # so do its grouped GEMMs
      return "expert GEMMs", False
    return "other", False
  part = SCOPE_PARTS[scope]
  if part != "experts":
    return part, True
  return {"gemm": "expert GEMMs", "quantize": "quantization"}.get(kind, "experts: other"), True


def split_by_part(events: list[dict], op_names: dict[str, str], steps: int) -> dict:
  """Milliseconds per step of each part, the unplaced share and the top unplaced kernels."""
  per_part = collections.Counter()
  unplaced = collections.Counter()
  placed_us = total_us = 0.0
  for e in events:
    name, us, op, op_name, args = e2e_trace.event_op(e, op_names)
    if op_name is None:  # a scope named in the event's own arguments (tf_op, long_name, ...)
      op_name = next((v for v in args.values() if scope_of(v)), None)
    part, placed = part_of(name, op_name)
    per_part[part] += us
    total_us += us
    if placed:
      placed_us += us
    else:
      unplaced[f"{name[:90]} [{op}]"] += us
  ms = {part: per_part[part] / 1e3 / steps for part in PARTS}
  return {"ms": ms, "total_ms": total_us / 1e3 / steps,
          "placed_share": placed_us / total_us if total_us else float("nan"),
          "unplaced_top": [(k, round(v / 1e3 / steps, 3)) for k, v in unplaced.most_common(8)]}


def trace_split(step, args, logdir: str, op_names: dict[str, str], steps: int = 3) -> dict:
  shutil.rmtree(logdir, ignore_errors=True)
  jax.block_until_ready(step(*args))
  with jax.profiler.trace(logdir, create_perfetto_trace=True):
    for _ in range(steps):
      out = step(*args)
    jax.block_until_ready(out)
  events, what = e2e_trace.device_events(e2e_trace.latest_trace(logdir))
  split = split_by_part(events, op_names, steps)
  split["events"] = what
  return split


def scope_coverage(op_names: dict[str, str]) -> dict[str, int]:
  """How many instructions of the compiled program carry each scope (a check that the names
  reach the HLO metadata, forward and backward)."""
  counts = collections.Counter()
  for op_name in set(op_names.values()):
    scope = scope_of(op_name)
    counts[(scope or "none") + (" (backward)" if "transpose(" in op_name else "")] += 1
  return dict(sorted(counts.items()))


# ----------------------------------------------- main ------------------------------------------

def run_case(experts: int, spec, args, card: str) -> list[dict]:
  top_k, tokens, d_model, hidden, what = spec
  x, dy = inputs(tokens, d_model, args.seed)
  key = jax.random.key(1)
  flops = 3 * 2 * 2 * tokens * top_k * d_model * hidden  # fc1 + fc2, fwd + dgrad + wgrad
  print(f"\n{experts} experts top-{top_k} ({what}): {tokens} tokens, d_model {d_model}, hidden "
        f"{hidden}; bf16 compute, float32 params", flush=True)
  rows = []
  variants = [(name, False) for name in args.recipes]
  if args.before:
    variants += [(name, True) for name in args.recipes]
  for name, before in variants:
    block = make_block(experts, top_k, d_model, hidden, name, before)
    label = f"{name} (before)" if before else name
    variables = jax.jit(block.init)(jax.random.key(0), x)
    step = step_fn(block)
    if jq.flax.OVERWRITE_WITH_GRADIENT in variables:  # time step 2 on, not step 1
      state = step(variables, x, dy, key)[1][0][jq.flax.OVERWRITE_WITH_GRADIENT]
      variables = {**variables, jq.flax.OVERWRITE_WITH_GRADIENT: state}
    try:
      compiled_text = step.lower(variables, x, dy, key).compile().as_text()
      sec = bench(step, variables, x, dy, key, **args.timing)
    except Exception as e:  # noqa: BLE001 - report and go on with the other rows
      print(f"  {label}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
      continue
    row = dict(experts=experts, top_k=top_k, tokens=tokens, d_model=d_model, hidden=hidden,
               recipe=label, ms=sec * 1e3, expert_tflops=flops / sec / 1e12, card=card)
    print(f"  {label:22s} {sec * 1e3:9.3f} ms  (expert GEMM FLOPs at {row['expert_tflops']:.0f} "
          "TFLOP/s of block time)", flush=True)
    op_names = e2e_trace.hlo_op_names(compiled_text)
    if args.tiny or args.coverage:
      print(f"    scopes in the compiled HLO's op_name metadata: {scope_coverage(op_names)}")
    if args.trace:
      logdir = os.path.join(args.trace, f"{experts}e_{name}{'_before' if before else ''}")
      split = trace_split(step, (variables, x, dy, key), logdir, op_names)
      row["split"] = split
      print_split(split)
    rows.append(row)
  return rows


def print_split(split: dict) -> None:
  total = split["total_ms"]
  print(f"    {split['events']} time {total:.3f} ms per step; by part "
        f"({split['placed_share']:.0%} placed by a scope):")
  for part in PARTS:
    ms = split["ms"][part]
    share = ms / total if total else float("nan")
    flag = "" if part in EXPERT_WORK or share <= TARGET_SHARE else f"  > {TARGET_SHARE:.0%}"
    print(f"      {part:18s} {ms:8.3f} ms  {share:6.1%}{flag}")
  if split["unplaced_top"]:
    print("    largest kernels without a scope: " +
          "; ".join(f"{k} {v} ms" for k, v in split["unplaced_top"]))


def print_table(rows: list[dict]) -> None:
  traced = [r for r in rows if "split" in r]
  print("\n| experts | recipe | block ms | " + " | ".join(PARTS) + " | largest other part |")
  print("|---|---|---:|" + "---:|" * len(PARTS) + "---|")
  for r in rows:
    if "split" not in r:
      print(f"| {r['experts']} top-{r['top_k']} | {r['recipe']} | {r['ms']:.3f} |" +
            " |" * len(PARTS) + " |")
      continue
    split = r["split"]
    total = split["total_ms"] or float("nan")
    cells = [f"{split['ms'][p]:.3f} ({split['ms'][p] / total:.0%})" for p in PARTS]
    others = {p: split["ms"][p] / total for p in PARTS if p not in EXPERT_WORK}
    worst = max(others, key=others.get)
    print(f"| {r['experts']} top-{r['top_k']} | {r['recipe']} | {r['ms']:.3f} | " +
          " | ".join(cells) + f" | {worst} {others[worst]:.0%} |")
  if traced:
    print(f"\n(ms of GPU kernel time per step and share of the block's; target: every part but "
          f"expert GEMMs and quantization <= {TARGET_SHARE:.0%})")


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--experts", type=int, nargs="+", choices=sorted(CASES),
                      default=sorted(CASES))
  parser.add_argument("--recipes", nargs="+", default=list(DEFAULT_RECIPES),
                      choices=recipes.available(), help="bf16 = no recipe")
  parser.add_argument("--tiny", action="store_true",
                      help="tiny sizes, one timed call (a CPU smoke check, not a benchmark)")
  parser.add_argument("--trace", default=None, metavar="DIR",
                      help="profile a few steps per row into DIR and print the GPU time by part")
  parser.add_argument("--before", action="store_true",
                      help="also time the block's permutation as it was before issue 23 "
                           "(argsort twice, plain indexing, bf16 combine) for comparison")
  parser.add_argument("--coverage", action="store_true",
                      help="print how many HLO instructions carry each part's scope")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--json", default=None)
  args = parser.parse_args(argv)
  args.timing = (dict(repeats=1, calls=1, warmup=1) if args.tiny
                 else dict(repeats=5, calls=5, warmup=2))
  device = jax.devices()[0]
  card = getattr(device, "device_kind", str(device))
  print(f"device: {card}; jax {jax.__version__}", flush=True)
  rows = []
  for experts in args.experts:
    rows += run_case(experts, (TINY if args.tiny else CASES)[experts], args, card)
  print_table(rows)
  if args.json:
    with open(args.json, "w") as f:
      json.dump(rows, f, indent=1, default=lambda v: None if isinstance(v, float) and
                math.isnan(v) else str(v))
  return 0


if __name__ == "__main__":
  sys.exit(main())
