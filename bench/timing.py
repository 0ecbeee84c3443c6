"""The one timing loop of the benchmarks (median seconds per call of a jitted function), and the
card line they print."""

from __future__ import annotations

import statistics
import subprocess
import time

import jax


def bench(fn, *args, repeats: int = 5, calls: int = 5, warmup: int = 2) -> float:
  """Median over `repeats` rounds of the mean time of `calls` back-to-back calls of `fn(*args)`
  (after `warmup` calls), each round timed until its last result is ready."""
  for _ in range(warmup):
    jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    out = None
    for _ in range(calls):
      out = fn(*args)
    jax.block_until_ready(out)
    times.append((time.perf_counter() - t0) / calls)
  return statistics.median(times)


def card() -> str:
  """The first GPU's name, memory and max SM clock from nvidia-smi (else jax's device kind)."""
  try:
    out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,clocks.max.sm",
                          "--format=csv,noheader"], capture_output=True, text=True).stdout
    return out.strip().splitlines()[0] if out.strip() else jax.devices()[0].device_kind
  except OSError:
    return jax.devices()[0].device_kind
