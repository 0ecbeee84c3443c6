"""Where a `train_lm` step's GPU time goes, by part of the model.

Each kernel of a `jax.profiler` trace is placed by the op that launched it: the op_name metadata
of its HLO instruction (`e2e_trace.hlo_op_names`) holds the Flax module path it was traced under
(`GPT/block_0/attn/qkv/...`, in the forward and, under `transpose(...)`, the backward) and the
MoE block's `jax.named_scope`s (`lm.moe.SCOPES`). Kernels with no op of their own (replayed from
an XLA command buffer) are placed by their name where only one part launches such kernels (the
grouped GEMMs: the experts), else counted as unplaced. `bench/scaling.py --profile-dir` prints
this split for every run it profiles; the MoE block alone is `bench/moe_block.py`.

Parts, in order: the attention projections (`attn/qkv`, `attn/proj`) and the attention core
(the rest of `attn`: scores, softmax, the weighted sum); the dense MLP's projections (`mlp/fc1`,
`mlp/fc2`) and the rest of it (the activation); the MoE block's experts (`GroupedDense` fc1 and
fc2), router with top-k, dispatch with combine, and activation; the norms; the embedding; the
residual adds and other ops of a block or of the model itself in no submodule; the head and
the loss (`lm_head` and the ops of the loss outside the model); the optimizer and the
rest of the step (ops outside the model and its loss: the optimizer's update, the gradient's
global norm); and what could not be placed. Within every part the GEMM / quantize / other split
of `e2e_trace.classify` is kept, so a part's quantization is visible too.
"""

from __future__ import annotations

import collections
import re
from typing import Optional

import e2e_trace  # bench/e2e_trace.py (this folder is on sys.path when run)

PARTS = ("attention projections", "attention core", "MLP projections", "MLP other",
         "MoE experts", "MoE router + top-k", "MoE dispatch + combine", "MoE activation",
         "norms", "embedding", "residuals + glue", "head + loss", "optimizer + rest",
         "unplaced")

# lm.moe.SCOPES values (repeated here so this module needs no jax; tests/test_bench_trace.py
# checks they match).
MOE_SCOPES = {"moe_experts": "MoE experts", "moe_router": "MoE router + top-k",
              "moe_route": "MoE router + top-k", "moe_dispatch": "MoE dispatch + combine",
              "moe_combine": "MoE dispatch + combine", "moe_activation": "MoE activation"}
# Kernel-name marks of jaxquant's grouped GEMMs: only the experts launch them.
GROUPED_GEMM_KERNELS = ("GroupProblemShape", "jqffi::sm90::", "grouped_gemm")

# (pattern over the op_name, part), the first match wins; the MoE scopes are checked before.
_MODULE_PARTS = ((r"/attn/(qkv|proj)(/|$)", "attention projections"),
                 (r"/attn(/|$)", "attention core"),
                 (r"/mlp/(fc1|fc2)(/|$)", "MLP projections"),
                 (r"/mlp(/|$)", "MLP other"),
                 (r"/(ln1|ln2|ln_f)(/|$)", "norms"),
                 (r"/(embed|pos_embed)(/|$)", "embedding"),
                 (r"/lm_head(/|$)", "head + loss"),
                 # ops of a block or of GPT itself, in no submodule: the residual adds, the
                 # logits' float32 cast, the learned positions' add
                 (r"GPT\)*/((block_\d+|blocks(/block)?)/)?[^/]+$", "residuals + glue"))


def part_of_op(op_name: Optional[str], kernel: str = "") -> str:
  """The part of the model (one of `PARTS`) an op with `op_name` belongs to; `kernel` (its
  kernel's name) places ops without metadata."""
  if not op_name:
    if any(mark in kernel for mark in GROUPED_GEMM_KERNELS):
      return "MoE experts"
    return "unplaced"
  found = [(op_name.rfind(f"/{scope}"), part) for scope, part in MOE_SCOPES.items()
           if re.search(rf"/{scope}(/|$)", op_name)]
  if found:
    return max(found)[1]
  for pattern, part in _MODULE_PARTS:
    if re.search(pattern, op_name):
      return part
  if "GPT" in op_name:
    return "unplaced"
  # Outside the model: the loss (differentiated, so under jvp / transpose) or the optimizer.
  return "head + loss" if re.search(r"(^|/)(jvp|transpose)\(", op_name) else "optimizer + rest"


def split_by_part(events: list[dict], op_names: dict[str, str], steps: int) -> dict:
  """{"ms": {part: {"gemm"|"quantize"|"other"|"collective": ms a step}}, "total_ms",
  "placed_share", "unplaced_top"} of a trace's device events (`e2e_trace.device_events`)."""
  per_part = collections.defaultdict(collections.Counter)
  unplaced = collections.Counter()
  total_us = placed_us = 0.0
  for e in events:
    name, us, op, op_name, _ = e2e_trace.event_op(e, op_names)
    part = part_of_op(op_name, name)
    per_part[part][e2e_trace.classify(name)] += us
    total_us += us
    if part == "unplaced":
      unplaced[f"{name[:90]} [{op}]"] += us
    else:
      placed_us += us
  ms = {part: {kind: us / 1e3 / steps for kind, us in per_part[part].items()}
        for part in PARTS if part in per_part}
  return {"ms": ms, "total_ms": total_us / 1e3 / steps,
          "placed_share": placed_us / total_us if total_us else float("nan"),
          "unplaced_top": [(k, round(v / 1e3 / steps, 3)) for k, v in unplaced.most_common(6)]}


def split_trace(trace_path: str, hlo_text: str, steps: int) -> dict:
  """`split_by_part` of one trace file and the compiled step's HLO text."""
  events, what = e2e_trace.device_events(trace_path)
  result = split_by_part(events, e2e_trace.hlo_op_names(hlo_text), steps)
  result["events"] = what
  return result


def lines(split: dict, indent: str = "  ") -> list[str]:
  """The split as text: one line a part (ms a step, share, GEMM / quantize / other)."""
  total = split["total_ms"] or float("nan")
  out = [f"{indent}{'part':24s} {'ms':>8s} {'share':>6s}   gemm / quantize / other"]
  for part, kinds in split["ms"].items():
    ms = sum(kinds.values())
    out.append(f"{indent}{part:24s} {ms:8.3f} {ms / total:6.1%}   "
               f"{kinds.get('gemm', 0.0):.3f} / {kinds.get('quantize', 0.0):.3f} / "
               f"{kinds.get('other', 0.0) + kinds.get('collective', 0.0):.3f}")
  out.append(f"{indent}placed {split['placed_share']:.1%} of {split['total_ms']:.3f} ms a step "
             f"({split.get('events', 'GPU')} events)")
  out += [f"{indent}unplaced {ms:.3f} ms  {name}" for name, ms in split["unplaced_top"]]
  return out
