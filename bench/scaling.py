"""Scaling of `examples/train_lm.py`'s training step over device meshes (issue 8).

For one recipe, trains the same model from the same parameters on the same batches of real text
(the standard library's bytes, as train_lm.py reads them) once per mesh, in one process, and
records for each mesh:
  * the loss of every step (compared with the first mesh's, normally the 1-device run);
  * the median step time after `--warmup` steps (each step timed to its loss being ready) and
    tokens/s per device;
  * the collectives of the compiled step (`jaxquant.hlo`): count and bytes per kind, every
    all-gather / all-to-all listed, and the ones whose result holds at least one sequence of
    activations (`seq x d_model` elements) flagged as activation all-gathers.

    PYTHONPATH=examples python bench/scaling.py --recipe bf16,fp8_current \\
        --meshes 1/dp=4/tp=4/dp=2,tp=2 \\
        --d-model 4096 --layers 8 --heads 32 --seq 2048 --batch 8 --remat --scan-layers \\
        --json out.json
    PYTHONPATH=examples python bench/scaling.py --recipe fp8_current --moe 8,2 --meshes 1/ep=4 ...

Meshes are separated by '/', axes within one by ','; "1" is one device without a mesh. Several
recipes (comma-separated) run interleaved: each mesh runs every recipe before the next mesh,
so a ratio between recipes on one mesh comes from back-to-back runs. The XLA overlap flags of
`examples/lm/xla_flags.py` are set unless `--no-xla-overlap`.
With --scan-layers the HLO holds the block once (a while loop), so collective counts are per
block plus the layers outside it, not per step.
"""

from __future__ import annotations

import argparse
import gc
import gzip
import json
import os
import pathlib
import statistics
import time
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

try:  # examples/ must be on the path: PYTHONPATH=examples (bench/run.py sets it)
  from lm import data, recipes, sharding, training, xla_flags
  from lm.embedding import EMBEDDING_GRADIENTS
  from lm.model import ATTENTIONS, GPT, LMConfig
  import train_lm
except ModuleNotFoundError as err:
  if err.name not in ("lm", "train_lm", "nnx_quantize"):
    raise
  raise SystemExit(f"bench/scaling.py imports examples/ ({err}): run it as "
                   "PYTHONPATH=examples python bench/scaling.py") from err

import e2e_trace  # bench/e2e_trace.py
import lm_parts  # bench/lm_parts.py
from jaxquant import hlo
from jaxquant.explain import explain_recording


def parse_meshes(spec: str) -> list[Optional[dict[str, int]]]:
  """"1/dp=4/dp=2,tp=2" -> [None, {"dp": 4}, {"dp": 2, "tp": 2}]."""
  meshes = []
  for part in spec.split("/"):
    part = part.strip()
    meshes.append(None if part in ("1", "") else train_lm.parse_mesh(part))
  return meshes


def mesh_name(axes: Optional[dict[str, int]]) -> str:
  return "1 device" if axes is None else "x".join(f"{k}={v}" for k, v in axes.items())


def collective_report(hlo_text: str, activation_elements: int) -> dict:
  found = hlo.collectives(hlo_text)
  gathers = [c for c in found if c.op in ("all-gather", "all-to-all", "ragged-all-to-all")]
  return {
      "summary": hlo.summarize(found),
      "gathers": [str(c) for c in gathers],
      "activation_gathers": [str(c) for c in gathers if c.elements >= activation_elements],
      "all_reduces_at_least_activation": sum(
          1 for c in found if c.op == "all-reduce" and c.elements >= activation_elements),
  }


def profile_steps(compiled, state, tokens, key, logdir: pathlib.Path, steps: int,
                  devices: int) -> dict:
  """GPU kernel time per step and per device of `steps` more steps under `jax.profiler`, split
  into GEMM / quantize / collective (NCCL) / other, and by part of the model (`by_part`,
  `bench/lm_parts.py`); `wall_ms` is the traced steps' own time."""
  t0 = time.perf_counter()
  with jax.profiler.trace(str(logdir), create_perfetto_trace=True):
    for step in range(steps):
      state, loss = compiled(state, tokens, jax.random.fold_in(key, 1000 + step))
    float(loss)
  wall_ms = 1e3 * (time.perf_counter() - t0) / steps
  trace = e2e_trace.latest_trace(str(logdir))
  times, _ = e2e_trace.kernel_times(trace)
  split = e2e_trace.split(times, steps * devices)
  split["wall_ms"] = wall_ms
  split["by_part"] = lm_parts.split_trace(trace, compiled.as_text(), steps * devices)
  return split


def run_mesh(model, config: LMConfig, batches: np.ndarray, cfg: training.TrainConfig,
             axes: Optional[dict[str, int]], warmup: int,
             profile_dir: Optional[pathlib.Path] = None, label: str = "",
             hlo_dir: Optional[pathlib.Path] = None) -> dict:
  """Compile and run `len(batches)` steps on one mesh; losses, times and collectives (and, with
  `profile_dir`, the kernel-time split of 2 more steps; with `hlo_dir`, the compiled step's HLO
  as `<label>.hlo.txt.gz`, to name the fusions the profile lists)."""
  mesh = None if axes is None else sharding.make_mesh(axes)
  devices = 1 if mesh is None else mesh.size
  if mesh is not None:
    sharding.check_batch(mesh, batches.shape[1])
  with sharding.active(mesh):
    state = training.create_state(model, batches[0], cfg, mesh)
    train_step, _ = training.make_steps(model, state if mesh is not None else None)
    key = jax.random.key(cfg.seed + 3)
    first = sharding.put_batches(mesh, batches[0])
    t0 = time.perf_counter()
    with explain_recording() as decisions:  # which expert exchange the MoE took, and why
      lowered = train_step.lower(state, first, key)
    compiled = lowered.compile()
    compile_s = time.perf_counter() - t0
    hlo_text = compiled.as_text()
    report = collective_report(hlo_text, config.seq * config.d_model)
    if hlo_dir is not None:
      hlo_dir.mkdir(parents=True, exist_ok=True)
      with gzip.open(hlo_dir / f"{label}.hlo.txt.gz", "wt") as f:
        f.write(hlo_text)
    losses, times = [], []
    for step, tokens in enumerate(batches):
      tokens = sharding.put_batches(mesh, tokens)
      t0 = time.perf_counter()
      state, loss = compiled(state, tokens, jax.random.fold_in(key, step))
      losses.append(float(loss))  # waits for the step
      times.append(time.perf_counter() - t0)
    profile = None
    if profile_dir is not None:
      profile = profile_steps(compiled, state, tokens, key, profile_dir / label, 2, devices)
  del state, compiled
  gc.collect()
  timed = times[warmup:] or times
  step_s = statistics.median(timed)
  tokens_per_step = batches.shape[1] * config.seq
  return {"mesh": mesh_name(axes), "axes": axes or {}, "devices": devices,
          "compile_s": compile_s, "step_ms": 1e3 * step_s, "min_step_ms": 1e3 * min(timed),
          "tokens_per_s_per_device": tokens_per_step / step_s / devices,
          "losses": losses, "collectives": report, "profile": profile,
          "ep_exchange": sorted({f"{d.path}{f' ({d.reason})' if d.reason else ''}"
                                 for d in decisions if d.op == "ep-exchange"})}


def compare_losses(runs: list[dict]) -> None:
  """Add each run's largest relative loss difference from the first run of its recipe."""
  for recipe in dict.fromkeys(r.get("recipe") for r in runs):
    _compare(runs=[r for r in runs if r.get("recipe") == recipe])


def _compare(runs: list[dict]) -> None:
  base = np.asarray(runs[0]["losses"])
  for run in runs:
    rel = np.abs(np.asarray(run["losses"]) - base) / np.abs(base)
    run["max_rel_loss_diff"] = float(rel.max())
    run["first_step_rel_loss_diff"] = float(rel[0])


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--recipe", default="fp8_current",
                 help="bf16, a built-in or a zoo recipe; comma-separated: run interleaved")
  p.add_argument("--meshes", type=parse_meshes, default=parse_meshes("1/dp=2"))
  p.add_argument("--d-model", type=int, default=4096)
  p.add_argument("--layers", type=int, default=8)
  p.add_argument("--heads", type=int, default=32)
  p.add_argument("--mlp-ratio", type=int, default=4)
  p.add_argument("--seq", type=int, default=2048)
  p.add_argument("--batch", type=int, default=8, help="global batch (sequences)")
  p.add_argument("--steps", type=int, default=8, help="steps per mesh (losses compared)")
  p.add_argument("--warmup", type=int, default=2, help="steps left out of the timing")
  p.add_argument("--lr", type=float, default=3e-4)
  p.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw",
                 help="sgd keeps the meshes' reduction-order differences at gradient size (the "
                 "loss check); adamw amplifies them in its first steps")
  p.add_argument("--moe", type=train_lm.parse_moe, default=None)
  p.add_argument("--moe-capacity", type=float, default=None,
                 help="capacity factor of the expert all-to-all buffers (default dropless)")
  p.add_argument("--moe-exchange", choices=train_lm.MOE_EXCHANGES, default="auto",
                 help="expert exchange under ep (auto: ragged_all_to_all when dropless on "
                 "GPU, else fixed-size all_to_all buffers)")
  p.add_argument("--no-xla-overlap", action="store_true",
                 help="do not add lm/xla_flags.py's collective-overlap flags to XLA_FLAGS")
  p.add_argument("--remat", action="store_true")
  p.add_argument("--embedding-gradient", choices=EMBEDDING_GRADIENTS, default="auto")
  p.add_argument("--scan-layers", action="store_true")
  p.add_argument("--attention", choices=ATTENTIONS, default="xla",
                 help="attention core: jnp with float32 scores, or cuDNN's fused kernel")
  p.add_argument("--data-mb", type=float, default=8.0)
  p.add_argument("--backend", choices=training.BACKENDS, default=None)
  p.add_argument("--json", type=pathlib.Path, default=None)
  p.add_argument("--hlo-dir", type=pathlib.Path, default=None,
                 help="write each run's compiled HLO here (gzip text)")
  p.add_argument("--profile-dir", type=pathlib.Path, default=None,
                 help="trace 2 more steps per run there and report the per-device kernel split")
  args = p.parse_args()
  flags = xla_flags.apply_overlap_flags(not args.no_xla_overlap)  # before the backend starts
  names = recipes.parse(args.recipe)

  with training.jaxquant_backend(args.backend or training.default_backend()) as backend:
    config = LMConfig(seq=args.seq, d_model=args.d_model, layers=args.layers, heads=args.heads,
                      mlp_ratio=args.mlp_ratio, dtype=jnp.bfloat16, moe=args.moe,
                      moe_capacity=args.moe_capacity, moe_exchange=args.moe_exchange,
                      remat=args.remat, scan_layers=args.scan_layers,
                      embedding_gradient=args.embedding_gradient, attention=args.attention)
    models = {name: GPT(config, recipes.make(name)) for name in names}
    corpus = data.load_corpus(int(args.data_mb * 1e6))
    batches = data.fixed_batches(corpus.train, args.batch, args.seq, args.steps)
    cfg = training.TrainConfig(steps=args.steps, lr=args.lr, warmup=max(args.steps // 2, 1),
                               optimizer=args.optimizer)
    results = {"device": jax.devices()[0].device_kind, "device_count": jax.device_count(),
               "jax": jax.__version__, "backend": backend, "recipe": args.recipe,
               "label": args.recipe + ("" if args.optimizer == "adamw" else f" ({args.optimizer}"
                                       f", {os.environ.get('JAXQUANT_FP8_ACCUMULATION', 'default')}"
                                       " FP8 accumulation)"),
               "fp8_accumulation": os.environ.get("JAXQUANT_FP8_ACCUMULATION", "default"),
               "attention": args.attention,
               "xla_flags": flags,
               "config": {k: v for k, v in vars(args).items()
                          if k not in ("meshes", "json", "backend", "profile_dir", "hlo_dir")},
               "runs": []}
    for axes, name in ((a, n) for a in args.meshes for n in names):
      print(f"[{name}] {mesh_name(axes)} ...", flush=True)
      try:
        label = f"{name}_{mesh_name(axes).replace(' ', '').replace('=', '')}"
        run = run_mesh(models[name], config, batches, cfg, axes, args.warmup,
                       args.profile_dir, label, args.hlo_dir)
      except Exception as err:  # a mesh that fails (e.g. out of memory) is reported, not fatal
        run = {"mesh": mesh_name(axes), "axes": axes or {}, "error": f"{type(err).__name__}: "
               f"{str(err)[:2000]}"}
      run["recipe"] = name
      results["runs"].append(run)
      print(json.dumps({k: v for k, v in run.items() if k != "collectives"}), flush=True)
      if "collectives" in run:
        print("  collectives:", json.dumps(run["collectives"]["summary"]),
              "| activation all-gathers:", run["collectives"]["activation_gathers"], flush=True)
      if args.json:
        args.json.write_text(json.dumps(results, indent=1))
  ok = [r for r in results["runs"] if "losses" in r]
  if ok:
    compare_losses(ok)
  for r in ok:
    print(f"{r['recipe']:24s} {r['mesh']:12s} {r['step_ms']:9.1f} ms/step "
          f"{r['tokens_per_s_per_device']:9.0f} tok/s/dev  compile {r['compile_s']:5.1f}s  "
          f"max rel loss diff {r['max_rel_loss_diff']:.2e}  "
          f"act gathers {len(r['collectives']['activation_gathers'])}"
          + (f"  ep exchange {', '.join(r['ep_exchange'])}" if r.get("ep_exchange") else ""))
    if r.get("profile"):
      prof = r["profile"]
      print(f"  per device: wall {prof['wall_ms']:.1f} ms | kernels: gemm {prof['gemm_ms']:.1f} "
            f"quantize {prof['quantize_ms']:.1f} collective {prof['collective_ms']:.1f} "
            f"other {prof['other_ms']:.1f} ms")
      for name, ms, kind in prof["top"][:14]:
        print(f"    {ms:8.3f} ms  {kind:10s} {name[:100]}")
      print("\n".join(lm_parts.lines(prof["by_part"], indent="    ")))
  if args.json:
    args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
  main()
