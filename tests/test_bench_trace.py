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
