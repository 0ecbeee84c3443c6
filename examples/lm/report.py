"""Reporting: the CSV of eval points, the loss-curve plot and the printed summary table."""

from __future__ import annotations

import csv
import pathlib
from typing import Sequence

from .training import History

CSV_COLUMNS = ("step", "recipe", "train_loss", "val_loss", "time")
STEP_COLUMNS = ("step", "recipe", "loss", "seconds")


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


def write_steps_csv(path: pathlib.Path, histories: Sequence[History]) -> pathlib.Path:
  """One row per training step and recipe: step, recipe, loss (Python's shortest repr, which
  reads back to the same float: runs compare bit for bit), seconds (the step's wall time)."""
  path.parent.mkdir(parents=True, exist_ok=True)
  with path.open("w", newline="") as f:
    writer = csv.DictWriter(f, fieldnames=STEP_COLUMNS)
    writer.writeheader()
    for history in histories:
      steps = zip(history.step_losses, history.step_times, strict=True)
      for i, (loss, seconds) in enumerate(steps):
        writer.writerow({"step": i + 1, "recipe": history.recipe, "loss": repr(loss),
                         "seconds": f"{seconds:.6f}"})
  return path


def read_steps_csv(path: pathlib.Path) -> dict[str, list[tuple[float, float]]]:
  """`write_steps_csv`'s file as `{recipe: [(loss, seconds), ...]}` in step order."""
  runs: dict[str, list[tuple[float, float]]] = {}
  with pathlib.Path(path).open(newline="") as f:
    for row in csv.DictReader(f):
      runs.setdefault(row["recipe"], []).append((float(row["loss"]), float(row["seconds"])))
  return runs


def smooth(values: Sequence[float], beta: float = 0.9) -> list[float]:
  """Bias-corrected exponential moving average (what TensorBoard's smoothing shows)."""
  out, avg = [], 0.0
  for i, v in enumerate(values, start=1):
    avg = beta * avg + (1 - beta) * v
    out.append(avg / (1 - beta**i))
  return out


def plot(path: pathlib.Path, histories: Sequence[History], title: str = "") -> pathlib.Path:
  """Train and validation loss against step, one line per recipe; with the bf16 baseline and
  other recipes, a third panel shows each recipe's validation loss minus the baseline's."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  baseline = next((h for h in histories if h.recipe == "bf16"), None)
  with_gap = baseline is not None and len(histories) > 1
  fig, axes = plt.subplots(1, 3 if with_gap else 2, figsize=(17 if with_gap else 12, 4.5))
  axes[1].sharey(axes[0])
  colors = plt.get_cmap("tab10" if len(histories) <= 10 else "tab20")
  for i, history in enumerate(histories):
    steps = [r["step"] for r in history.rows]
    if history.step_losses:  # every step's training-batch loss, smoothed, underneath
      axes[0].plot(range(1, len(history.step_losses) + 1), smooth(history.step_losses),
                   color=colors(i), alpha=0.35, linewidth=1)
    for ax, split in zip(axes, ("train", "val")):
      ax.plot(steps, [r[f"{split}_loss"] for r in history.rows], marker=".",
              color=colors(i), label=history.recipe)
    if with_gap:
      base = {r["step"]: r["val_loss"] for r in baseline.rows}
      gap = [(r["step"], r["val_loss"] - base[r["step"]]) for r in history.rows
             if r["step"] in base]
      axes[2].plot([g[0] for g in gap], [g[1] for g in gap], marker=".", color=colors(i),
                   label=history.recipe)
  axes[0].set_title("train loss (points: fixed eval windows; faint: batch loss, smoothed)",
                    fontsize="medium")
  axes[1].set_title("validation loss")
  axes[0].set_ylabel("cross-entropy (nats / byte)")
  if with_gap:
    axes[2].set_title("validation loss minus bf16")
    axes[2].axhline(0.0, color="black", linewidth=0.8)
  for ax in axes:
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
  axes[-1].legend(fontsize="small", ncol=1 if len(histories) < 8 else 2)
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


def final_gaps(histories: Sequence[History]) -> list[str]:
  """One line per quantized recipe: its final validation loss minus the bf16 baseline's (empty
  without a baseline)."""
  baseline = next((h for h in histories if h.recipe == "bf16"), None)
  if baseline is None:
    return []
  base = baseline.final_val_loss
  return [f"final validation loss, {h.recipe} - bf16: {h.final_val_loss - base:+.4f} nats/byte "
          f"({100 * (h.final_val_loss - base) / base:+.2f}%; bf16 {base:.4f}, "
          f"{h.recipe} {h.final_val_loss:.4f})"
          for h in histories if h is not baseline]
