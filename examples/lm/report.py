"""Reporting: the CSV of eval points, the loss-curve plot and the printed summary table."""

from __future__ import annotations

import csv
import pathlib
from typing import Sequence

from .training import History

CSV_COLUMNS = ("step", "recipe", "train_loss", "val_loss", "time")


def write_csv(path: pathlib.Path, histories: Sequence[History]) -> pathlib.Path:
  """One row per eval point and recipe: step, recipe, train_loss, val_loss, time (seconds)."""
  path.parent.mkdir(parents=True, exist_ok=True)
  with path.open("w", newline="") as f:
    writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS)
    writer.writeheader()
    for history in histories:
      for row in history.rows:
        writer.writerow({**row, "train_loss": f"{row['train_loss']:.6f}",
                         "val_loss": f"{row['val_loss']:.6f}", "time": f"{row['time']:.3f}"})
  return path


def plot(path: pathlib.Path, histories: Sequence[History], title: str = "") -> pathlib.Path:
  """Train (left) and validation (right) loss against step, one line per recipe."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
  colors = plt.get_cmap("tab10" if len(histories) <= 10 else "tab20")
  for i, history in enumerate(histories):
    steps = [r["step"] for r in history.rows]
    for ax, split in zip(axes, ("train", "val")):
      ax.plot(steps, [r[f"{split}_loss"] for r in history.rows], marker=".",
              color=colors(i), label=history.recipe)
  for ax, split in zip(axes, ("train", "validation")):
    ax.set_title(f"{split} loss")
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
  axes[0].set_ylabel("cross-entropy (nats / byte)")
  axes[1].legend(fontsize="small", ncol=1 if len(histories) < 8 else 2)
  if title:
    fig.suptitle(title, fontsize="medium")
  fig.tight_layout()
  path.parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return path


def summary_table(histories: Sequence[History]) -> str:
  """Final losses and timings per recipe, with the gap to the bf16 baseline when it ran."""
  baseline = next((h for h in histories if h.recipe == "bf16"), None)
  header = (f"{'recipe':30s} {'start val':>9s} {'final train':>11s} {'final val':>9s} "
            f"{'vs bf16':>8s} {'step ms':>8s} {'1st step s':>10s} {'total s':>8s}")
  lines = [header, "-" * len(header)]
  for h in histories:
    first, last = h.rows[0], h.rows[-1]
    gap = f"{last['val_loss'] - baseline.final_val_loss:+.4f}" if baseline else "-"
    lines.append(f"{h.recipe:30s} {first['val_loss']:9.4f} {last['train_loss']:11.4f} "
                 f"{last['val_loss']:9.4f} {gap:>8s} {1e3 * h.steady_step_time:8.1f} "
                 f"{h.compile_time:10.1f} {last['time']:8.1f}")
  return "\n".join(lines)
