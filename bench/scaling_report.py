"""Markdown tables from `bench/scaling.py` JSON files (issue 8): per recipe and mesh, step time,
tokens/s per device, speedup over the same recipe's 1-device run, the largest relative loss
difference from that run over the compared steps, and what the compiled step communicates.

    python bench/scaling_report.py out/*.json  # scaling.py --json files (bench/run.py: jobs.tar.gz)
"""

from __future__ import annotations

import json
import sys

import numpy as np


def load(paths: list[str]) -> dict[str, list[dict]]:
  """`{recipe: [run, ...]}` over every file, 1-device runs first."""
  by_recipe: dict[str, list[dict]] = {}
  header = None
  files = [json.load(open(path)) for path in paths]
  for results in [r for f in files for r in (f if isinstance(f, list) else [f])]:
    header = header or results
    for run in results["runs"]:
      label = results.get("label", results["recipe"])
      by_recipe.setdefault(label, []).append({**run, "config": results["config"]})
  for runs in by_recipe.values():
    runs.sort(key=lambda r: r.get("devices", 0))
  if header:
    count = max(r["device_count"] for f in files for r in (f if isinstance(f, list) else [f]))
    print(f"device: {header['device']} x{count}, jax {header['jax']}, "
          f"backend {header['backend']}\n")
  return by_recipe


def loss_diff(run: dict, base: dict) -> tuple[float, float]:
  a, b = np.asarray(run["losses"]), np.asarray(base["losses"])
  rel = np.abs(a - b) / np.abs(b)
  return float(rel[0]), float(rel.max())


def table(by_recipe: dict[str, list[dict]]) -> str:
  lines = ["| recipe | mesh | GPUs | ms/step | tokens/s/GPU | speedup vs 1 GPU | "
           "loss step 1 / max rel diff vs 1 GPU | all-gathers (activation) | all-reduces (MB) |",
           "|---|---|---:|---:|---:|---:|---|---|---|"]
  for recipe, runs in by_recipe.items():
    base = next((r for r in runs if r.get("devices") == 1 and "losses" in r), None)
    for run in runs:
      if "error" in run:
        lines.append(f"| {recipe} | {run['mesh']} | | | | | error: {run['error'][:120]} | | |")
        continue
      speed = (base["step_ms"] / run["step_ms"]) if base else float("nan")
      first, worst = loss_diff(run, base) if base else (float("nan"),) * 2
      coll = run["collectives"]
      gathers = coll["summary"].get("all-gather", {"count": 0})["count"]
      reduces = coll["summary"].get("all-reduce", {"count": 0, "bytes": 0})
      lines.append(
          f"| {recipe} | {run['mesh']} | {run['devices']} | {run['step_ms']:.1f} | "
          f"{run['tokens_per_s_per_device']:.0f} | {speed:.2f}x | "
          f"{run['losses'][0]:.4f} / {worst:.1e} (step 1: {first:.1e}) | "
          f"{gathers} ({len(coll['activation_gathers'])}) | "
          f"{reduces['count']} ({reduces['bytes'] / 1e6:.1f}) |")
  return "\n".join(lines)


def fp8_vs_bf16(by_recipe: dict[str, list[dict]]) -> str:
  if "bf16" not in by_recipe:
    return ""
  lines = ["", "| mesh | " + " | ".join(f"{r} vs bf16" for r in by_recipe if r != "bf16") + " |",
           "|---|" + "---:|" * (len(by_recipe) - 1)]
  bf16 = {r["mesh"]: r for r in by_recipe["bf16"] if "step_ms" in r}
  for mesh, base in bf16.items():
    cells = []
    for recipe, runs in by_recipe.items():
      if recipe == "bf16":
        continue
      run = next((r for r in runs if r["mesh"] == mesh and "step_ms" in r), None)
      cells.append(f"{base['step_ms'] / run['step_ms']:.2f}x" if run else "-")
    lines.append(f"| {mesh} | " + " | ".join(cells) + " |")
  return "\n".join(lines)


def main() -> None:
  by_recipe = load(sys.argv[1:])
  print(table(by_recipe))
  print(fp8_vs_bf16(by_recipe))
  for recipe, runs in by_recipe.items():
    for run in runs:
      if run.get("collectives", {}).get("gathers"):
        print(f"\n{recipe} {run['mesh']} all-gathers: {', '.join(run['collectives']['gathers'])}")


if __name__ == "__main__":
  main()
