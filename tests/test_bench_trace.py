"""`bench/e2e_trace.py`'s GPU occupancy of a trace: the span, the union of the events' intervals
(overlaps counted once) and the longest idle gap, against a brute-force count on a 1 µs grid."""

from __future__ import annotations

import importlib.util
import pathlib

import numpy as np

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
  assert [(g["before"], g["after"]) for g in got] == [(b, a) for _, b, a in want[:6]]
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
