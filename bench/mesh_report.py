"""Markdown tables of `bench/scaling.py` JSON files (issue 14): per mesh, each recipe's step
time, its speedup over its own 1-device run, the ratio of every recipe to the first one on the
same mesh, and the collectives of the compiled step (all-reduce + reduce-scatter MB, all-to-all
count, all-gathers).

    python bench/mesh_report.py dense.json moe.json > table.md
"""

from __future__ import annotations

import json
import sys


_TO_ALL = ("all-to-all", "ragged-all-to-all")

def _mb(summary: dict, *ops: str) -> float:
  return sum(summary.get(op, {}).get("bytes", 0.0) for op in ops) / 1e6


def table(results: dict) -> str:
  runs = [r for r in results["runs"] if "step_ms" in r]
  names = list(dict.fromkeys(r["recipe"] for r in results["runs"]))
  one = {r["recipe"]: r["step_ms"] for r in runs if r["devices"] == 1}
  lines = [f"{results['device']} x{results['device_count']}, jax {results['jax']}, backend "
           f"{results['backend']}, config {json.dumps(results['config'])}", "",
           "| mesh | recipe | ms/step | vs 1 GPU | vs " + names[0] + " same mesh | "
           "all-reduce + reduce-scatter MB | all-to-alls (ragged too) | all-gathers | "
           "max rel loss diff |",
           "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
  for r in results["runs"]:
    if "step_ms" not in r:
      lines.append(f"| {r['mesh']} | {r.get('recipe')} | error: {r.get('error', '')[:120]} |"
                   " | | | | | |")
      continue
    peer = [p for p in runs if p["mesh"] == r["mesh"] and p["recipe"] == names[0]]
    ratio = f"{peer[0]['step_ms'] / r['step_ms']:.2f}x" if peer else "-"
    base = one.get(r["recipe"])
    scale = f"{base / r['step_ms']:.2f}x" if base else "-"
    summary = r["collectives"]["summary"]
    lines.append(
        f"| {r['mesh']} | {r['recipe']} | {r['step_ms']:.1f} | {scale} | {ratio} | "
        f"{_mb(summary, 'all-reduce', 'reduce-scatter'):.1f} | "
        f"{sum(int(summary.get(op, {}).get('count', 0)) for op in _TO_ALL)} | "
        f"{len(r['collectives']['gathers'])} | {r.get('max_rel_loss_diff', float('nan')):.1e} |")
  return "\n".join(lines)


if __name__ == "__main__":
  for path in sys.argv[1:]:
    try:
      print(table(json.load(open(path))), "\n")
    except (OSError, ValueError, KeyError) as err:
      print(f"{path}: {type(err).__name__}: {err}\n")
