"""One process with N devices vs N processes of one device each, training the same model (issue 25).

Runs `examples/train_lm.py --mesh dp=N` twice on this machine's devices, one configuration after
the other (never side by side, so the step times are comparable):
  * 1 process that sees all N GPUs (`CUDA_VISIBLE_DEVICES=0,...,N-1`);
  * N processes joined by `jax.distributed` (`lm/launch.py`: a free local port), process i
    seeing GPU i only (`CUDA_VISIBLE_DEVICES=i`);
then reads each run's `steps.csv` (every step's loss and time, written by process 0) and prints
per recipe: the median step time after `--warmup` steps, its ratio to the 1-process run, the
final loss, the relative loss difference to the 1-process run at step 1 and the largest over
the first `--compare-steps` steps (what `--check` holds to: summation order), and, for the
record, the largest over the whole run with the first step past `--loss-rtol`.

    PYTHONPATH=examples python bench/multiprocess.py          # 2 GPUs, fp8_current, d_model 1024
    PYTHONPATH=examples python bench/multiprocess.py --check  # exit 1 past the tolerances
    PYTHONPATH=examples python bench/multiprocess.py --cpu    # host CPU devices (a quick check)
    PYTHONPATH=examples python bench/multiprocess.py --recipe bf16,fp8_current -- --d-model 2048

Arguments after `--` go to train_lm.py after this script's model defaults (the last one wins).
The two runs compile the same SPMD program and differ in who carries the collectives (NCCL
within one process or between processes; on CPU, XLA's in-process collectives or gloo), so the
losses should agree to float32 summation order (two-term sums are exact whatever the order).
Over a long run at a high learning rate such a difference grows like any perturbation of a
chaotic trajectory (and an FP8 code rounded the other way makes it a step), so only the first
steps say whether the two runs compute the same thing; later steps say how far they drift.
NCCL's NVLink multicast is left off (`NCCL_NVLS_ENABLE=0` unless set).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import tempfile
import time

try:  # examples/ must be on the path: PYTHONPATH=examples (bench/run.py sets it)
  from lm import launch, report
except ModuleNotFoundError as err:
  if err.name != "lm":
    raise
  raise SystemExit(f"bench/multiprocess.py imports examples/ ({err}): run it as "
                   "PYTHONPATH=examples python bench/multiprocess.py") from err

ROOT = pathlib.Path(__file__).resolve().parents[1]

TRAIN_LM = str(ROOT / "examples" / "train_lm.py")
# SGD: updates linear in the gradient, so a reduction-order difference stays as small as the
# gradients' (Adam makes it a full-size step in near-zero elements); `-- --optimizer adamw`.
TRAINING = ["--optimizer", "sgd", "--lr", "0.3", "--warmup", "5"]
GPU_MODEL = ["--d-model", "1024", "--layers", "4", "--heads", "8", "--seq", "1024",
             "--batch", "16", "--steps", "60", *TRAINING]
CPU_MODEL = ["--d-model", "128", "--layers", "1", "--heads", "4", "--seq", "32", "--batch", "8",
             "--steps", "12", "--data-mb", "0.3", "--eval-batches", "1", *TRAINING]


def build_parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--processes", type=int, default=2, help="N: devices, and processes of one")
  p.add_argument("--recipe", default="fp8_current", help="train_lm.py --recipe")
  p.add_argument("--cpu", action="store_true",
                 help="host CPU devices (JAX_PLATFORMS=cpu) instead of GPUs")
  p.add_argument("--warmup", type=int, default=5, help="steps left out of the median step time")
  p.add_argument("--timeout", type=float, default=500.0, help="seconds per configuration")
  p.add_argument("--compare-steps", type=int, default=4,
                 help="--check: steps whose losses must agree to --loss-rtol")
  p.add_argument("--first-rtol", type=float, default=1e-6,
                 help="--check: relative loss difference allowed at step 1 (same parameters)")
  p.add_argument("--loss-rtol", type=float, default=1e-5,
                 help="--check: relative loss difference allowed over the first --compare-steps")
  p.add_argument("--max-slowdown", type=float, default=1.05,
                 help="--check: largest step-time ratio of N processes to 1 process")
  p.add_argument("--check", action="store_true",
                 help="exit with status 1 when a recipe is past --loss-rtol or --max-slowdown")
  p.add_argument("--json", type=pathlib.Path, default=None, help="write the results here")
  p.add_argument("train_lm_args", nargs="*", help="after '--': more train_lm.py arguments")
  return p


def gpu_ids(count: int) -> list[str]:
  """The first `count` GPUs this process may use (its CUDA_VISIBLE_DEVICES, else 0 ... n-1)."""
  visible = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
  ids = visible or [str(i) for i in range(count)]
  if len(ids) < count:
    sys.exit(f"--processes {count}: CUDA_VISIBLE_DEVICES={','.join(ids)} names fewer GPUs")
  return ids[:count]


def device_env(cpu: bool, devices: list[str]) -> dict[str, str]:
  """The environment that shows one process `devices` (GPU ids, or a count of host CPUs)."""
  if cpu:
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
             if "xla_force_host_platform_device_count" not in f]
    flags.append(f"--xla_force_host_platform_device_count={len(devices)}")
    return {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": " ".join(flags)}
  return {"CUDA_VISIBLE_DEVICES": ",".join(devices)}


def run_config(argv: list[str], processes: int, env_for, timeout: float) -> None:
  with launch.LocalRun(argv, processes, env_for=env_for, cwd=str(ROOT)) as run:
    results = run.wait(timeout)
  if any(r.returncode != 0 for r in results):
    sys.exit(f"{processes} process(es) failed:\n{launch.report(results)}")


def summarize(runs: dict[str, dict], warmup: int, compare_steps: int,
              loss_rtol: float) -> list[dict]:
  """Per recipe and configuration: median step ms, ratio and loss differences to the first."""
  rows = []
  base_label = next(iter(runs))
  for recipe in runs[base_label]:
    base_losses = [loss for loss, _ in runs[base_label][recipe]]
    base_ms = None
    for label, steps in runs.items():
      losses = [loss for loss, _ in steps[recipe]]
      times = [s for _, s in steps[recipe]][warmup:] or [s for _, s in steps[recipe]]
      step_ms = 1e3 * statistics.median(times)
      base_ms = base_ms or step_ms
      rel = [abs(a - b) / abs(b) for a, b in zip(losses, base_losses, strict=True)]
      past = next((i + 1 for i, r in enumerate(rel) if r > loss_rtol), None)
      rows.append({"recipe": recipe, "config": label, "step_ms": step_ms,
                   "vs_1_process": step_ms / base_ms, "final_loss": losses[-1],
                   "first_rel_loss_diff": rel[0],
                   "early_rel_loss_diff": max(rel[:compare_steps]),
                   "max_rel_loss_diff": max(rel), "first_step_past_rtol": past,
                   "steps": len(losses), "losses": losses})
  return rows


def main() -> None:
  args = build_parser().parse_args()
  n = args.processes
  if n < 2:
    sys.exit("--processes: expected at least 2")
  kind = "CPU" if args.cpu else "GPU"
  devices = [str(i) for i in range(n)] if args.cpu else gpu_ids(n)
  base_env = {"NCCL_NVLS_ENABLE": os.environ.get("NCCL_NVLS_ENABLE", "0")}
  runs = {}
  with tempfile.TemporaryDirectory(prefix="jaxquant-multiprocess-") as tmp:
    for label, processes in ((f"1 process x {n} {kind}s", 1),
                             (f"{n} processes x 1 {kind}", n)):
      out = pathlib.Path(tmp) / f"p{processes}"
      model = CPU_MODEL if args.cpu else GPU_MODEL
      argv = [TRAIN_LM, *model, *args.train_lm_args, "--recipe", args.recipe,
              "--mesh", f"dp={n}", "--no-progress", "--out", str(out)]
      steps = next(int(v) for k, v in reversed(list(zip(argv, argv[1:]))) if k == "--steps")
      argv += ["--eval-every", str(steps)]  # evaluations at step 0 and the last step only
      if processes == 1:
        env_for = lambda i: {**base_env, **device_env(args.cpu, devices)}  # noqa: E731
      else:
        env_for = lambda i: {**base_env, **device_env(args.cpu, [devices[i]])}  # noqa: E731
      print(f"{label}: {' '.join(argv[1:])}", flush=True)
      start = time.perf_counter()
      run_config(argv, processes, env_for, args.timeout)
      print(f"  done in {time.perf_counter() - start:.0f} s", flush=True)
      runs[label] = report.read_steps_csv(out / "steps.csv")
  rows = summarize(runs, args.warmup, args.compare_steps, args.loss_rtol)
  k = args.compare_steps
  header = (f"{'recipe':14s} {'configuration':22s} {'step ms':>8s} {'vs 1 proc':>9s} "
            f"{'final loss':>10s} {'step 1':>9s} {f'steps 1-{k}':>9s} {'all steps':>9s} "
            f"{'past rtol':>9s}")
  print("\n" + header + "\n" + "-" * len(header))
  for r in rows:
    print(f"{r['recipe']:14s} {r['config']:22s} {r['step_ms']:8.2f} {r['vs_1_process']:8.3f}x "
          f"{r['final_loss']:10.6f} {r['first_rel_loss_diff']:9.1e} "
          f"{r['early_rel_loss_diff']:9.1e} {r['max_rel_loss_diff']:9.1e} "
          f"{str(r['first_step_past_rtol'] or '-'):>9s}")
  print(f"(median over steps {args.warmup + 1}-{rows[0]['steps']}; loss differences relative "
        f"to the 1-process run; 'past rtol': the first step past --loss-rtol {args.loss_rtol})")
  if args.json is not None:
    args.json.write_text(json.dumps({"rows": rows, "argv": sys.argv[1:]}, indent=1))
  failed = [r for r in rows if r["first_rel_loss_diff"] > args.first_rtol
            or r["early_rel_loss_diff"] > args.loss_rtol
            or r["vs_1_process"] > args.max_slowdown]
  if args.check and failed:
    sys.exit(f"--check: past --first-rtol {args.first_rtol}, --loss-rtol {args.loss_rtol} over "
             f"{k} steps or --max-slowdown {args.max_slowdown}: "
             f"{[(r['recipe'], r['config']) for r in failed]}")


if __name__ == "__main__":
  main()
