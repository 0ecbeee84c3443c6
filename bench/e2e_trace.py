"""GPU kernel time of a `jax.profiler` trace, summed by kernel name and split into GEMM /
quantize / other.

Reads the `*.trace.json.gz` that `jax.profiler.trace(logdir)` writes: the GPU's processes
(process name containing "GPU") hold one thread per CUDA stream ("Stream #N ...") whose complete
events ("ph": "X") are the kernels and copies; the "XLA Ops" / "XLA Modules" threads of the same
process repeat that time per HLO op and are skipped.

`hlo_op_names` and `device_events` place each kernel by the op that launched it (the op_name
metadata of its HLO instruction: the `jax.named_scope`s and Flax module path it was traced
under), for the splits by part of `bench/moe_block.py` and `bench/lm_parts.py`.
"""

from __future__ import annotations

import collections
import glob
import gzip
import json
import os
import re
from typing import Optional

GEMM = re.compile(r"gemm|nvjet|cutlass|xmma|matmul|cublas|wgmma|sm90_|triton_dot", re.I)
# jaxquant's FFI quantize / amax / transpose kernels (ffi/quantize, ffi/grouped, ffi/fused).
QUANTIZE = re.compile(r"amax_kernel|fp8_tensor_|mxfp8_kernel|fp8_block_|nvfp4_|"
                      r"transpose_kernel|grouped_quantize|jaxquant", re.I)


# XLA's scatter fusions (not NCCL's reduce-scatter, a collective).
SCATTER = re.compile(r"scatter", re.I)
# NCCL's collective kernels (all-reduce, reduce-scatter, all-gather, all-to-all) of a mesh step.
COLLECTIVE = re.compile(r"nccl", re.I)


def classify(name: str) -> str:
  if COLLECTIVE.search(name):
    return "collective"
  if QUANTIZE.search(name) and "gemm" not in name.lower():
    return "quantize"
  if GEMM.search(name):
    return "gemm"
  return "other"


def latest_trace(logdir: str) -> str:
  paths = glob.glob(os.path.join(logdir, "**", "*.trace.json.gz"), recursive=True)
  if not paths:
    raise FileNotFoundError(f"no *.trace.json.gz under {logdir}")
  return max(paths, key=os.path.getmtime)


def gpu_stream_events(path: str) -> tuple[list[dict], list[str]]:
  """(the complete events of one trace file's GPU stream threads: kernels, memsets, copies; the
  stream thread names read)."""
  with gzip.open(path, "rt") as f:
    trace = json.load(f)
  events = trace["traceEvents"] if isinstance(trace, dict) else trace
  gpu_pids, threads = set(), {}
  for e in events:
    if e.get("ph") != "M":
      continue
    if e.get("name") == "process_name" and "gpu" in str(e.get("args", {}).get("name", "")).lower():
      gpu_pids.add(e["pid"])
    if e.get("name") == "thread_name":
      threads[(e.get("pid"), e.get("tid"))] = str(e.get("args", {}).get("name", ""))
  gpu_threads = {k: v for k, v in threads.items() if k[0] in gpu_pids}
  streams = {k for k, v in gpu_threads.items() if "stream" in v.lower()}
  if not streams:  # another naming: every GPU thread but the per-op / per-module summaries
    streams = {k for k, v in gpu_threads.items()
               if not any(s in v for s in ("XLA Ops", "XLA Modules", "Steps", "TraceMe"))}
  stream_events = [e for e in events
                   if e.get("ph") == "X" and (e.get("pid"), e.get("tid")) in streams]
  return stream_events, sorted({threads[k] for k in streams})


def kernel_times(path: str) -> tuple[dict[str, float], list[str]]:
  """({kernel name: total microseconds}, the stream thread names read) of one trace file."""
  events, names = gpu_stream_events(path)
  totals: dict[str, float] = collections.defaultdict(float)
  for e in events:
    totals[e.get("name", "?")] += float(e.get("dur", 0.0))
  return dict(totals), names


def kernel_changes(times_a: dict[str, float], times_b: dict[str, float], steps: int,
                   top: int = 15) -> list[tuple[str, float, float, float]]:
  """(kernel, µs a step in A, in B, A - B) for the `top` kernels whose time changed most
  between two traces of `steps` steps each (an A/B of one model: which kernels a change added,
  removed or slowed). A kernel missing from one side counts 0 there."""
  rows = [(name, times_a.get(name, 0.0) / steps, times_b.get(name, 0.0) / steps)
          for name in set(times_a) | set(times_b)]
  rows = [(name, a, b, a - b) for name, a, b in rows]
  return sorted(rows, key=lambda r: (-abs(r[3]), r[0]))[:top]


def host_times(path: str, top: int = 12) -> list[tuple[str, int, float]]:
  """The host side of a trace: (event name, count, total microseconds) of the complete events
  on threads of processes that are not GPUs (the Python thread's dispatch, XLA's thunk
  launches, CUDA driver calls), most time first: where a loop's host time goes."""
  with gzip.open(path, "rt") as f:
    trace = json.load(f)
  events = trace["traceEvents"] if isinstance(trace, dict) else trace
  gpu_pids = {e["pid"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"
              and "gpu" in str(e.get("args", {}).get("name", "")).lower()}
  count: dict[str, int] = collections.defaultdict(int)
  total: dict[str, float] = collections.defaultdict(float)
  for e in events:
    if e.get("ph") == "X" and e.get("pid") not in gpu_pids:
      count[e.get("name", "?")] += 1
      total[e.get("name", "?")] += float(e.get("dur", 0.0))
  return sorted(((n, count[n], total[n]) for n in total), key=lambda r: -r[2])[:top]


def occupancy(events: list[dict]) -> dict:
  """The GPU span of `events` (first start to last end), the time some event runs (the union
  of their intervals, overlaps counted once) and the idle rest, in microseconds, with the
  longest idle gap: whether a traced loop kept the GPU busy."""
  intervals = sorted((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0))) for e in events)
  if not intervals:
    return {"span_us": 0.0, "busy_us": 0.0, "idle_us": 0.0, "longest_gap_us": 0.0}
  busy, longest = 0.0, 0.0
  start, end = intervals[0]
  for lo, hi in intervals[1:]:
    if lo > end:  # a gap: close the current run of overlapping events
      busy += end - start
      longest = max(longest, lo - end)
      start, end = lo, hi
    else:
      end = max(end, hi)
  busy += end - start
  span = max(hi for _, hi in intervals) - intervals[0][0]
  return {"span_us": span, "busy_us": busy, "idle_us": span - busy, "longest_gap_us": longest}


def idle_gaps(events: list[dict], top: int = 5) -> list[dict]:
  """The `top` longest idle gaps between `events` (overlaps counted as busy), longest first, each
  with the event that ran last before it and the one that starts it: what the GPU waited on."""
  ordered = sorted(events, key=lambda e: float(e["ts"]))
  gaps = []
  if not ordered:
    return gaps
  end, last = float(ordered[0]["ts"]) + float(ordered[0].get("dur", 0.0)), ordered[0]
  for e in ordered[1:]:
    lo, hi = float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0))
    if lo > end:
      gaps.append({"gap_us": lo - end, "before": last.get("name", ""), "after": e.get("name", "")})
    if hi > end:
      end, last = hi, e
  return sorted(gaps, key=lambda g: -g["gap_us"])[:top]


def gap_and_host_lines(path: str, events: list[dict], steps: int, gaps: int = 6,
                       host: int = 12, indent: str = "      ") -> list[str]:
  """Printable lines of a traced loop of `steps` steps: its `gaps` longest GPU idle gaps
  (`idle_gaps` of `events`, the trace's GPU stream events) and its `host` costliest host
  events a step (`host_times`): what the GPU waited on, and where the host's time went."""
  lines = [f"{indent}idle {g['gap_us']:8.1f} us  after {g['before'][:60]}  before "
           f"{g['after'][:60]}" for g in idle_gaps(events, top=gaps)]
  lines += [f"{indent}host {us / 1e3 / steps:8.3f} ms a step  x{count:<6d} {event[:90]}"
            for event, count, us in host_times(path, top=host)]
  return lines


def split(times: dict[str, float], steps: int) -> dict:
  """Milliseconds per step by class and the top kernels (summed over every GPU in the trace:
  divide by the device count for a mesh step)."""
  by_class = collections.Counter()
  for name, us in times.items():
    by_class[classify(name)] += us
  top = sorted(times.items(), key=lambda kv: -kv[1])[:40]
  # XLA's scatter kernels (an embedding's gradient: nn.Embed's scatter-add varies by ~1 ms a
  # d2048 step from step to step, more than many A/B differences), within "other".
  scatter = sum(us for name, us in times.items()
                if SCATTER.search(name) and classify(name) == "other")
  return {
      "scatter_ms": scatter / 1e3 / steps,
      "gemm_ms": by_class["gemm"] / 1e3 / steps,
      "quantize_ms": by_class["quantize"] / 1e3 / steps,
      "other_ms": by_class["other"] / 1e3 / steps,
      "collective_ms": by_class["collective"] / 1e3 / steps,
      "total_ms": sum(by_class.values()) / 1e3 / steps,
      "top": [(name[:120], round(us / 1e3 / steps, 3), classify(name)) for name, us in top],
  }


# ------------------------- kernels placed by the op that launched them -------------------------

_COMPUTATION = re.compile(r"^\s*(?:ENTRY\s+)?%?([\w.\-]+)\s*\(.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=")
_OP_NAME = re.compile(r"op_name=\"([^\"]*)\"")
_CALLS = re.compile(r"(?:calls|to_apply)=%?([\w.\-]+)")


def hlo_op_names(hlo_text: str) -> dict[str, str]:
  """{instruction name: its op_name metadata} of a compiled program's text, also under the
  kernel-name spelling (`.` and `-` as `_`) that XLA:GPU gives the kernel of a fusion. A fusion
  without metadata of its own takes its fused computation's (the root's, else the first)."""
  own, calls, computation_names = {}, {}, {}
  current = None
  for line in hlo_text.splitlines():
    header = _COMPUTATION.match(line)
    if header and "=" not in line.split("(")[0]:
      current = header.group(1)
      continue
    match = _INSTRUCTION.match(line)
    if not match:
      continue
    root, name = match.groups()
    op_name = _OP_NAME.search(line)
    called = _CALLS.search(line)
    if op_name:
      own[name] = op_name.group(1)
      if current is not None and (root or current not in computation_names):
        computation_names[current] = op_name.group(1)
    elif called:
      calls[name] = called.group(1)
  names = dict(own)
  for name, computation in calls.items():
    if computation in computation_names:
      names[name] = computation_names[computation]
  for name, op_name in list(names.items()):
    names.setdefault(re.sub(r"[.\-]", "_", name), op_name)
  return names


def device_events(path: str) -> tuple[list[dict], str]:
  """(events, what): the complete events of a trace's GPU stream threads (kernels, memsets,
  copies); without a GPU in the trace, XLA:CPU's thunk events (those naming an `hlo_op`), so
  the split can be checked on a CPU."""
  gpu, _ = gpu_stream_events(path)
  if gpu:
    return gpu, "GPU"
  with gzip.open(path, "rt") as f:
    trace = json.load(f)
  events = trace["traceEvents"] if isinstance(trace, dict) else trace
  return [e for e in events
          if e.get("ph") == "X" and "hlo_op" in (e.get("args") or {})], "host (no GPU events)"


def event_op(event: dict, op_names: dict[str, str]) -> tuple[str, float, str, Optional[str], dict]:
  """(kernel name, microseconds, the op that launched it, that op's op_name or None, the event's
  arguments as strings) of one device event, the op_name looked up by the op, else by the
  kernel's own name (a fusion's kernel)."""
  name, us = event.get("name", "?"), float(event.get("dur", 0.0))
  args = {k: str(v) for k, v in (event.get("args") or {}).items()}
  op = args.get("hlo_op") or args.get("name") or name
  return name, us, op, op_names.get(op.lstrip("%")) or op_names.get(name), args


def main() -> None:
  """`python bench/e2e_trace.py A B --steps N`: the kernels that changed most between the
  traces kept under folders A and B (`e2e.py --trace-dir D --keep-traces` writes one folder a
  variant), as a table in µs a step."""
  import argparse
  parser = argparse.ArgumentParser(description=main.__doc__)
  parser.add_argument("a")
  parser.add_argument("b")
  parser.add_argument("--steps", type=int, required=True, help="profiled steps in each trace")
  parser.add_argument("--top", type=int, default=15)
  args = parser.parse_args()
  times = [kernel_times(latest_trace(folder))[0] for folder in (args.a, args.b)]
  print(f"| kernel | {args.a} | {args.b} | change |\n|---|---:|---:|---:|")
  for name, a, b, change in kernel_changes(*times, args.steps, args.top):
    print(f"| `{name[:90]}` | {a:.1f} | {b:.1f} | {change:+.1f} |")
  for folder, t in zip((args.a, args.b), times):
    print(f"{folder}: {sum(t.values()) / args.steps / 1e3:.2f} ms of kernels a step")


if __name__ == "__main__":
  main()
