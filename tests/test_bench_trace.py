"""`bench/e2e_trace.py`'s GPU occupancy of a trace: the span, the union of the events' intervals
(overlaps counted once) and the longest idle gap, against a brute-force count on a 1 µs grid."""

from __future__ import annotations

import importlib.util
import pathlib

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _e2e_trace():
  spec = importlib.util.spec_from_file_location("e2e_trace", ROOT / "bench" / "e2e_trace.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_occupancy_counts_overlapping_kernels_once_and_finds_the_longest_gap(rng):
  occupancy = _e2e_trace().occupancy
  starts = rng.integers(0, 2000, size=60)
  durations = rng.integers(1, 80, size=60)
  events = [{"ts": float(s), "dur": float(d), "name": f"k{i}"}
            for i, (s, d) in enumerate(zip(starts, durations))]
  covered = np.zeros(2100, bool)
  for s, d in zip(starts, durations):
    covered[s:s + d] = True
  first, last = int(starts.min()), int((starts + durations).max())
  inside = covered[first:last]
  gaps, run = [0], 0
  for c in inside:
    run = 0 if c else run + 1
    gaps.append(run)
  got = occupancy(events)
  assert got["span_us"] == last - first
  assert got["busy_us"] == inside.sum()
  assert got["idle_us"] == (last - first) - inside.sum()
  assert got["longest_gap_us"] == max(gaps)


def test_occupancy_of_no_events_is_zero():
  assert _e2e_trace().occupancy([]) == {"span_us": 0.0, "busy_us": 0.0, "idle_us": 0.0,
                                        "longest_gap_us": 0.0}


def test_idle_gaps_are_the_longest_holes_with_the_kernels_around_them(rng):
  idle_gaps = _e2e_trace().idle_gaps
  # kernels laid end to end with fresh random holes between some of them; one long kernel
  # overlaps its successor, so the hole after the successor is measured from the long one's end
  durations = rng.integers(5, 50, size=40)
  # distinct even holes, so the one shortened by 1 (after the long kernel) is distinct as well
  holes = np.where(rng.random(40) < 0.5, 2 * rng.choice(np.arange(1, 400), 40, replace=False), 0)
  holes[4] = max(holes[4], 2)
  events, t = [], 0
  for i, (d, h) in enumerate(zip(durations, holes)):
    events.append({"ts": float(t), "dur": float(d), "name": f"k{i}"})
    t += int(d) + int(h)
  events.append({"ts": float(events[3]["ts"]), "name": "long",
                 "dur": float(durations[3] + holes[3] + 1 + durations[4])})
  end = {e["name"]: e["ts"] + e["dur"] for e in events}
  want = []
  for i in range(39):
    prev_end, prev = end[f"k{i}"], f"k{i}"
    if i in (3, 4):
      prev_end, prev = end["long"], "long"
    gap = events[i + 1]["ts"] - prev_end
    if gap > 0:
      want.append((gap, prev, f"k{i + 1}"))
  want.sort(key=lambda g: -g[0])
  got = idle_gaps(rng.permutation(np.array(events, dtype=object)).tolist(), top=6)
  assert [g["gap_us"] for g in got] == [g for g, _, _ in want[:6]]
  # "long" starts with k3, so the hole before them may name either as the kernel after it
  after = lambda name: "k3" if name == "long" else name  # noqa: E731
  assert [(g["before"], after(g["after"])) for g in got] == [(b, a) for _, b, a in want[:6]]
  assert ("long", "k5") in [(b, a) for _, b, a in want]


def test_gap_and_host_lines_name_the_gaps_and_the_host_events(tmp_path, rng):
  """A written trace: one GPU stream with a hole between two kernels, host events on a CPU
  thread; the lines give the hole with its kernels and each host event's time a step."""
  import gzip
  import json
  trace_module = _e2e_trace()
  hole, steps = int(rng.integers(50, 500)), 2
  host_us = rng.integers(100, 1000, size=3).astype(float)
  events = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
            {"ph": "M", "name": "thread_name", "pid": 1, "tid": 7, "args": {"name": "Stream #7"}},
            {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/host:CPU"}},
            {"ph": "X", "pid": 1, "tid": 7, "name": "kernel_a", "ts": 0.0, "dur": 10.0},
            {"ph": "X", "pid": 1, "tid": 7, "name": "kernel_b", "ts": 10.0 + hole, "dur": 5.0}]
  events += [{"ph": "X", "pid": 2, "tid": 1, "name": f"host_{i}", "ts": 0.0, "dur": float(d)}
             for i, d in enumerate(host_us)]
  path = tmp_path / "t.trace.json.gz"
  with gzip.open(path, "wt") as f:
    json.dump({"traceEvents": events}, f)
  gpu = trace_module.gpu_stream_events(str(path))[0]
  lines = trace_module.gap_and_host_lines(str(path), gpu, steps)
  assert "idle" in lines[0] and f"{float(hole):8.1f} us" in lines[0]
  assert "after kernel_a" in lines[0] and "before kernel_b" in lines[0]
  order = np.argsort(-host_us)
  for line, i in zip(lines[1:], order):
    assert f"host_{i}" in line and f"{host_us[i] / 1e3 / steps:8.3f} ms a step" in line
  assert len(lines) == 1 + len(host_us)


def _lm_parts(monkeypatch):
  monkeypatch.syspath_prepend(str(ROOT / "bench"))
  import lm_parts
  return lm_parts


def _compiled_step_text(moe) -> str:
  """The compiled HLO text of a tiny `train_lm` step under delayed scaling (1 block)."""
  import jax
  import jax.numpy as jnp
  import jaxquant as jq
  from lm import training
  from lm.model import GPT, LMConfig
  config = LMConfig(d_model=32, heads=2, layers=1, seq=16, mlp_ratio=2, moe=moe,
                    dtype=jnp.bfloat16)
  model = GPT(config, jq.DelayedScaling())
  tokens = np.random.default_rng(0).integers(0, 256, (2, 17)).astype(np.int32)
  state = training.create_state(model, tokens, training.TrainConfig(steps=2, warmup=1))
  step, _ = training.make_steps(model)
  return jax.jit(step).lower(state, tokens, jax.random.key(0)).compile().as_text()


@pytest.mark.parametrize("moe", [None, (4, 2)], ids=["dense", "moe"])
def test_lm_parts_place_every_op_of_a_train_lm_step(moe, monkeypatch):
  """Every instruction of a compiled `train_lm` step that came from the model is placed in a
  part by its op_name; each part of the model is found; jaxquant's custom calls land in the
  layer that made them (the grouped ones in the MoE experts, the dense ones in the attention
  projections, the MLP projections or the head); the MoE scope names are `lm.moe.SCOPES`."""
  import re
  from lm import moe as moe_module
  lm_parts = _lm_parts(monkeypatch)
  trace_module = _e2e_trace()
  assert set(lm_parts.MOE_SCOPES) == set(moe_module.SCOPES.values())
  text = _compiled_step_text(moe)
  names = trace_module.hlo_op_names(text)
  parts = {name: lm_parts.part_of_op(op_name) for name, op_name in names.items()}
  unplaced = sorted({op for name, op in names.items()
                     if "GPT" in op and parts[name] == "unplaced"})
  assert not unplaced, unplaced[:5]
  model_parts = {"MoE experts", "MoE router + top-k", "MoE dispatch + combine",
                 "MoE activation"} if moe else {"MLP projections", "MLP other"}
  want = model_parts | {"attention projections", "attention core", "norms", "embedding",
                        "residuals + glue",
                        "head + loss", "optimizer + rest"}
  assert want <= set(parts.values()), want - set(parts.values())
  calls = re.findall(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=.*custom_call_target=\"(jaxquant_\w+)\"",
                     text, re.M)
  assert calls
  for name, target in calls:
    if name not in names:  # a call without metadata: only the grouped GEMMs are placed so
      continue
    allowed = ({"MoE experts"} if "grouped" in target else
               {"attention projections", "MLP projections", "head + loss"})
    assert parts[name] in allowed, (name, target, names[name])


def test_lm_parts_split_sums_each_part_by_kernel_class(monkeypatch, rng):
  """`split_by_part` on written events: each event's time lands in its op's part and kernel
  class, a grouped GEMM kernel without an op in the experts, anything else without one in
  `unplaced`; ms are per step and the placed share is the placed time's."""
  lm_parts = _lm_parts(monkeypatch)
  ops = {"fusion.1": "jit(train_step)/jvp(GPT)/block_0/attn/qkv/dot_general",
         "fusion.2": "jit(train_step)/transpose(jvp(GPT))/block_0/attn/mul",
         "custom-call.3": "jit(train_step)/jvp(GPT)/block_0/mlp/moe_experts/fc1/ffi_call",
         "fusion.4": "jit(train_step)/add"}
  durations = rng.integers(1, 1000, size=6).astype(float)
  events = [
      {"name": "cutlass_gemm_kernel", "dur": durations[0], "args": {"hlo_op": "fusion.1"}},
      {"name": "loop_fusion", "dur": durations[1], "args": {"hlo_op": "fusion.2"}},
      {"name": "grouped_quantize_kernel", "dur": durations[2],
       "args": {"hlo_op": "custom-call.3"}},
      {"name": "input_reduce_fusion", "dur": durations[3], "args": {"hlo_op": "fusion.4"}},
      {"name": "cutlass::GroupProblemShape kernel", "dur": durations[4], "args": {}},
      {"name": "mystery", "dur": durations[5], "args": {}}]
  steps = int(rng.integers(1, 5))
  got = lm_parts.split_by_part(events, ops, steps)
  ms = lambda i: durations[i] / 1e3 / steps  # noqa: E731
  assert got["ms"]["attention projections"] == {"gemm": ms(0)}
  assert got["ms"]["attention core"] == {"other": ms(1)}
  assert got["ms"]["MoE experts"] == pytest.approx({"quantize": ms(2), "gemm": ms(4)})
  assert got["ms"]["optimizer + rest"] == {"other": ms(3)}
  assert got["ms"]["unplaced"] == {"other": ms(5)}
  assert got["total_ms"] == pytest.approx(durations.sum() / 1e3 / steps)
  assert got["placed_share"] == pytest.approx(1 - durations[5] / durations.sum())
  assert list(got["ms"]) == [p for p in lm_parts.PARTS if p in got["ms"]]


def test_kernel_changes_rank_by_the_change_a_step(rng):
  kernel_changes = _e2e_trace().kernel_changes
  steps = int(rng.integers(2, 5))
  names = [f"k{i}" for i in range(12)]
  a = {n: float(rng.uniform(0, 1000)) for n in names[:10]}
  b = {n: float(rng.uniform(0, 1000)) for n in names[2:]}
  got = kernel_changes(a, b, steps, top=5)
  everything = {n: (a.get(n, 0.0) - b.get(n, 0.0)) / steps for n in names}
  want = sorted(everything, key=lambda n: -abs(everything[n]))[:5]
  assert [r[0] for r in got] == want
  for name, per_a, per_b, change in got:
    assert per_a == pytest.approx(a.get(name, 0.0) / steps)
    assert per_b == pytest.approx(b.get(name, 0.0) / steps)
    assert change == pytest.approx(per_a - per_b)


def test_split_counts_xla_scatters_within_other_and_not_reduce_scatters(rng):
  e2e_trace = _e2e_trace()
  steps = int(rng.integers(1, 4))
  times = {"input_scatter_fusion_1": float(rng.uniform(100, 900)),
           "loop_add_fusion": float(rng.uniform(100, 900)),
           "ncclDevKernel_ReduceScatter_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)":
               float(rng.uniform(100, 900)),
           "nvjet_sm90_qqtst_192x192_bias_TNN": float(rng.uniform(100, 900))}
  got = e2e_trace.split(times, steps)
  assert got["scatter_ms"] == pytest.approx(times["input_scatter_fusion_1"] / 1e3 / steps)
  assert got["other_ms"] == pytest.approx(
      (times["input_scatter_fusion_1"] + times["loop_add_fusion"]) / 1e3 / steps)
  assert got["collective_ms"] > 0
