"""Grouped (mixture-of-experts) forward + backward, side by side on one card:
`jaxquant.flax.GroupedDense` under each built-in recipe and the MoE hybrid recipe, and without
a recipe (the bfloat16 CUTLASS grouped GEMMs where they run), vs bf16 `jax.lax.ragged_dot` (the
same no-recipe GroupedDense traced under JAXQUANT_BACKEND=reference: ragged_dot and its
autodiff), and PyTorch's `torch._grouped_mm` (the grouped GEMM torchtitan's MoE uses; bf16,
fwd + bwd, same shapes and group sizes, same process, run first; the row is skipped with the
reason where torch or its CUDA device is missing).

    python bench/grouped.py                    # 8 and 64 experts at LLM sizes (a GPU)
    python bench/grouped.py --tiny             # smoke check at tiny sizes (runs on CPU)
    python bench/grouped.py --experts 64 --json out.json
    python bench/grouped.py --experts 8 --gemms --no-steps --formats "Float8Block 1x128 x 128x128 w"
    python bench/grouped.py --gemms --no-steps --sm90-configs all \
        --formats Float8CurrentScaling "Float8Block 1x128 x 128x128 w"
    python bench/grouped.py --gemms --no-steps --formats "bf16 (no recipe)" MXFP8 \
        --sm90-configs bf16,bf16_c2x1,bf16_pingpong,bf16:rn

Cases (rows T are routed token-expert assignments, i.e. tokens x top-k, sorted by expert):
  8 experts:  T = 16384 (8192 tokens, top-2), K = 4096 -> N = 14336 (Mixtral-8x7B's fc1)
  64 experts: T = 16384 (2048 tokens, top-8), K = 2048 -> N = 1408 (Qwen1.5-MoE-style fc1)
  128 experts: the 64-expert layer's T, K and N in 128 groups of ~128 rows (fine-grained
    experts: groups of about one 128-row tile; run only when asked, `--experts 128`)
Group sizes are a seeded multinomial draw (balanced routing, uneven groups). One step =
y, vjp = jax.vjp(apply, variables, x); vjp(dy): the forward grouped GEMM, dgrad and wgrad and
every quantize / state update the recipe needs, jitted as one program. Every step is timed with
bf16 parameters and again with float32 parameters (", float32 params": Flax's default; the
weights are quantized from float32 and get float32 gradients; without a recipe the module
casts them to bf16 each step). Time = median over
repeats of (R back-to-back steps) / R after warm-up. A delayed-scaling model is timed in the
state training runs it in from step 2 on: its `"_overwrite_with_gradient"` state after one step
(every group has a scale, so the just-in-time first scale's gated amax does not read x). The
"paths" column is what `jaxquant.explain` reports for the grouped GEMMs and quantizes ("ffi":
the grouped kernels of ffi/grouped, "ffi-cutlass" the CUTLASS Hopper grouped GEMM; "reference":
one `ragged_dot` per GEMM, with the reason printed below the table). `--gemms` also times each
grouped GEMM alone (fprop, dgrad, wgrad) next to the dense GEMMs of the same FLOPs in bf16 and
FP8 (the roofline peers), with grouped/dense ratios; `--sm90-configs` times each CUTLASS kernel
configuration (`jaxquant.backends.ffi.grouped.sm90_configs`) side by side in the same process.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxquant as jq
import grouped_quantize  # bench/grouped_quantize.py
from timing import bench  # bench/timing.py (this folder is on sys.path when run)
import jaxquant.flax  # noqa: F401
from jaxquant.backends.ffi import gemm as ffi_gemm
from jaxquant.backends.ffi.grouped import bf16, sm90_configs, support

RECIPES = {
    "Float8CurrentScaling": lambda: jq.recipes.Float8CurrentScaling(),
    "DelayedScaling": lambda: jq.recipes.DelayedScaling(),
    "Float8BlockScaling": lambda: jq.recipes.Float8BlockScaling(),
    "MXFP8BlockScaling": lambda: jq.recipes.MXFP8BlockScaling(),
    "NVFP4BlockScaling": lambda: jq.recipes.NVFP4BlockScaling(),
    "moe_nvfp4_fwd_mxfp8_bwd": lambda: jq.CustomRecipe(
        jq.factories.moe_nvfp4_forward_mxfp8_backward),
}

# (experts, routed rows T, in features K, out features N, description)
CASES = {
    8: (8, 16384, 4096, 14336, "Mixtral-8x7B fc1: 8192 tokens x top-2"),
    64: (64, 16384, 2048, 1408, "Qwen1.5-MoE-style fc1: 2048 tokens x top-8"),
    # groups of about one 128-row tile (the small-group rule of sm90_configs)
    128: (128, 16384, 2048, 1408, "fine-grained: the 64-expert layer's shape, ~128 rows a group"),
}
TINY = {8: (8, 256, 128, 256, "tiny"), 64: (64, 512, 64, 128, "tiny"),
        128: (128, 1024, 64, 128, "tiny")}


RAGGED_DOT = "bf16 jax.lax.ragged_dot"


@contextlib.contextmanager
def _env(name: str, value):
  """Environment variable `name` = value while a step is traced (None: as the environment has
  it)."""
  saved = os.environ.get(name)
  if value is not None:
    os.environ[name] = value
  try:
    yield
  finally:
    if saved is None:
      os.environ.pop(name, None)
    else:
      os.environ[name] = saved


def _backend(value):
  """JAXQUANT_BACKEND=value while a step is traced (None: as the environment has it)."""
  return _env("JAXQUANT_BACKEND", value)


@contextlib.contextmanager
def _wgrad_by_padding(on: bool):
  """`sm90_configs.WGRAD_BY_PADDING` as it is (True) or off while a step is traced."""
  saved = sm90_configs.WGRAD_BY_PADDING
  sm90_configs.WGRAD_BY_PADDING = saved and on
  try:
    yield
  finally:
    sm90_configs.WGRAD_BY_PADDING = saved


# The same-process comparisons that trace a recipe's step again under one environment setting:
# (flag, variable, value, row label). Each value is what the path was before the design decision
# named; unset, every row runs as users run it.
COMPARISONS = (
    ("compare_raw_copies", support.RAW_COPIES_ENV, "off", "codes decoded"),  # decisions 47, 49
    ("compare_along_n", support.RAW_COPIES_ENV, "transposed", "forward copy transposed"),  # 49
    ("compare_dgrad_copy", support.DGRAD_COPY_ENV, "written", "dgrad copy written"),  # 56
    ("compare_accumulation", "JAXQUANT_FP8_ACCUMULATION", "split", "split forward"),  # 57
)


def step_fn(model):
  def step(variables, x, sizes, dy, key):
    apply = lambda v, x: model.apply(v, x, sizes, rngs={"quantize": key})
    y, vjp = jax.vjp(apply, variables, x)
    return y, vjp(dy)
  return jax.jit(step)


def group_sizes(rng, tokens: int, experts: int) -> np.ndarray:
  return rng.multinomial(tokens, np.full(experts, 1.0 / experts)).astype(np.int32)


def run_case(experts: int, spec, args, card: str, torch_result=None) -> list[dict]:
  groups, t, k, n, what = spec
  rng = np.random.default_rng(args.seed)
  sizes = jnp.asarray(group_sizes(rng, t, groups))
  x = jnp.asarray(rng.standard_normal((t, k), np.float32), jnp.bfloat16)
  dy = jnp.asarray(rng.standard_normal((t, n), np.float32), jnp.bfloat16)
  key = jax.random.key(1)
  print(f"\n{groups} experts ({what}): T={t} K={k} N={n}, group sizes {int(sizes.min())}.."
        f"{int(sizes.max())}, bfloat16", flush=True)
  common = dict(features=n, num_groups=groups, use_bias=False, dtype=jnp.bfloat16,
                param_dtype=jnp.bfloat16)
  # GroupedDense without a recipe, traced under JAXQUANT_BACKEND=reference (jax.lax.ragged_dot,
  # the speedup baseline) and as users run it (the bfloat16 CUTLASS kernel where it runs)
  models = {RAGGED_DOT: jq.flax.GroupedDense(**common),
            "bf16 GroupedDense (no recipe)": jq.flax.GroupedDense(**common)}
  for name, make in RECIPES.items():
    if args.recipes and name not in args.recipes:
      continue
    models[f"jaxquant {name}"] = jq.flax.GroupedDense(**common, recipe=make())
  if not args.no_float32_params:  # Flax's default parameters: float32 kernels, bf16 compute
    for name, model in list(models.items()):
      models[f"{name}, float32 params"] = model.clone(param_dtype=jnp.float32)
  unpadded = set()  # rows traced without the wgrad's padding rule (--compare-padding)
  if args.compare_padding:
    for name, model in list(models.items()):
      if not name.startswith(RAGGED_DOT):
        models[f"{name} [wgrad tiles as before]"] = model
        unpadded.add(f"{name} [wgrad tiles as before]")
  setting = {}  # row -> (variable, value) its step is traced under (COMPARISONS)
  recipe_rows = [(name, model) for name, model in models.items()
                 if getattr(model, "recipe", None) is not None and "[" not in name]
  for flag, variable, value, label in COMPARISONS:
    if getattr(args, flag):
      for name, model in recipe_rows:
        models[f"{name} [{label}]"] = model
        setting[f"{name} [{label}]"] = (variable, value)
  flops = 3 * 2 * t * k * n
  rows, base = [], None
  timing = dict(repeats=args.repeats, calls=args.calls, warmup=args.warmup)
  dense_row = dense_step_peer(t, k, n, x, dy, timing, flops, groups, card, args.profile_dir)
  if dense_row is not None:
    rows.append(dense_row)
  if torch_result is not None:
    row = torch_row(groups, t, k, n, flops, torch_result, dense_row, card)
    if row is not None:
      rows.append(row)
  for name, model in models.items():
    variables = jax.jit(model.init)(jax.random.key(0), x, sizes)
    step = step_fn(model)
    paths = why = qpaths = ""
    backend = _backend("reference" if name.startswith(RAGGED_DOT) else None)
    # Every call of `step` (the first traces it, and jit keeps that trace) under the row's
    # settings: until session 31 a delayed-scaling row's state step ran before them, so its
    # --compare-* variants timed the program traced without them.
    compared = _env(*setting[name]) if name in setting else contextlib.nullcontext()
    with backend, _wgrad_by_padding(name not in unpadded), compared:
      if jq.flax.OVERWRITE_WITH_GRADIENT in variables:  # time step 2 on, not step 1
        state = step(variables, x, sizes, dy, key)[1][0][jq.flax.OVERWRITE_WITH_GRADIENT]
        variables = {**variables, jq.flax.OVERWRITE_WITH_GRADIENT: state}
      report = jq.explain(step, variables, x, sizes, dy, key)
      gemms = [d for d in report if d.op == "grouped_gemm"]
      paths = ",".join(sorted({d.path + ("-cutlass" if "CUTLASS" in d.detail else "")
                               for d in gemms}))  # ffi-cutlass: a CUTLASS grouped GEMM
      qpaths = ",".join(sorted({d.path for d in report if d.op == "grouped_quantize"}))
      why = "; ".join(sorted({d.reason for d in gemms if d.reason}))
      try:
        sec = bench(step, variables, x, sizes, dy, key, **timing)  # traced under `backend`
      except Exception as e:  # noqa: BLE001 - report and go on with the other rows
        print(f"  {name}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
        continue
    if args.profile_dir and not name.startswith(RAGGED_DOT):  # jaxquant's rows, bf16 included
      print_profile(step, (variables, x, sizes, dy, key), args.profile_dir, name, steps=args.calls)
    base = sec if base is None else base
    row = dict(experts=groups, case=name, tokens=t, k=k, n=n, ms=sec * 1e3,
               tflops=flops / sec / 1e12, speedup_vs_bf16=base / sec, gemm_paths=paths,
               quantize_paths=qpaths, why=why, card=card)
    if dense_row is not None:
      row["speedup_vs_dense_step"] = dense_row["ms"] / row["ms"]
    rows.append(row)
    print(f"  {name:38s} {sec * 1e3:9.3f} ms  {row['tflops']:7.1f} TFLOP/s  "
          f"{row['speedup_vs_bf16']:5.2f}x  gemm {paths or '-'} / quantize {qpaths or '-'}",
          flush=True)
  return rows


def print_profile(step, step_args, profile_dir: str, name: str, steps: int = 5) -> None:
  """GPU kernel time per step of `steps` more steps under `jax.profiler`, by kernel name
  (bench/e2e_trace.py's split): where a grouped step's time goes. Also the traced loop's
  wall time per step (host clock, first dispatch to the last result) against the GPU's span
  and busy time per step: a timed step above its kernels is idle GPU time or host time."""
  import os
  import shutil
  import time
  import e2e_trace  # bench/e2e_trace.py
  logdir = os.path.join(profile_dir, "".join(c if c.isalnum() or c in "-." else "_"
                                             for c in name))  # no glob characters ("[...]")
  shutil.rmtree(logdir, ignore_errors=True)
  with jax.profiler.trace(logdir):
    t0 = time.perf_counter()
    for _ in range(steps):
      out = step(*step_args)
    jax.block_until_ready(out)
    wall_ms = (time.perf_counter() - t0) * 1e3 / steps
  path = e2e_trace.latest_trace(logdir)
  split = e2e_trace.split(e2e_trace.kernel_times(path)[0], steps)
  events = e2e_trace.gpu_stream_events(path)[0]
  gpu = e2e_trace.occupancy(events)
  print(f"    profile {name}: gemm {split['gemm_ms']:.3f} ms, quantize {split['quantize_ms']:.3f} "
        f"ms, other {split['other_ms']:.3f} ms per step; traced loop {wall_ms:.3f} ms a step "
        f"(wall), GPU span {gpu['span_us'] / 1e3 / steps:.3f}, "
        f"busy {gpu['busy_us'] / 1e3 / steps:.3f}, longest idle gap "
        f"{gpu['longest_gap_us'] / 1e3:.3f} ms; top kernels:", flush=True)
  for kernel, ms, kind in split["top"][:20]:
    print(f"      {ms:8.3f} ms  {kind:9s} {kernel[:110]}", flush=True)
  for line in e2e_trace.gap_and_host_lines(path, events, steps):  # idle GPU, the host's side
    print(line, flush=True)


TORCH_GROUP_ALIGN = 8  # rows per token group for torch._grouped_mm bf16 (torchtitan's minimum)


def torch_grouped_mm_step(t: int, k: int, n: int, sizes: np.ndarray, seed: int,
                          timing, profile: bool = False) -> tuple[float | None, str]:
  """(seconds, note) of PyTorch's `torch._grouped_mm` bf16 step on the same shapes and group
  sizes: forward (rows x each group's `[K, N]`, the weights stored `[G, N, K]` and passed
  transposed, as torchtitan's MoE does) and both gradients through autograd (median over
  repeats of back-to-back steps, after warm-up); (None, why) where torch, its CUDA device or
  `_grouped_mm` is missing or the call fails. Timed by the host clock to each round's last
  result, as `bench/timing.py` times every JAX row; until session 20 it was timed by CUDA
  events, which leave out each round's host latency before its first kernel (the CUDA-event
  time is printed beside it). Runs before JAX starts on the
  GPU (`main`), so JAX's preallocated pool does not starve it, and frees its memory after.

  Every group is padded to a multiple of `TORCH_GROUP_ALIGN` rows first, as torchtitan pads its
  token groups for bf16 (`TOKEN_GROUP_ALIGNMENT_SIZE_M = 8`): the wgrad contracts over each
  group's tokens, whose offsets must be 16-byte aligned, and a misaligned offset trips a
  device-side assert that would end this process's CUDA context. The padded rows (at most 7 a
  group) are part of the timed work; the FLOPs stay those of the T real rows."""
  try:
    import torch
  except ImportError as e:
    return None, f"torch is not importable ({e})"
  if not torch.cuda.is_available():
    return None, f"torch {torch.__version__} sees no CUDA device"
  if not hasattr(torch, "_grouped_mm"):
    return None, f"torch {torch.__version__} has no torch._grouped_mm"
  try:
    sec, rows = _time_torch_grouped_mm(torch, t, k, n, sizes, seed, timing, profile)
  except Exception as e:  # noqa: BLE001 - report and go on with the JAX rows
    return None, f"torch._grouped_mm failed: {type(e).__name__}: {str(e)[:300]}"
  finally:
    torch.cuda.empty_cache()  # the step's tensors are gone: hand their memory back
  return sec, (f"torch {torch.__version__} on {torch.cuda.get_device_name()}; groups padded "
               f"to {TORCH_GROUP_ALIGN} rows: {rows} rows for {t}")


def _time_torch_grouped_mm(torch, t, k, n, sizes, seed, timing,
                           profile: bool = False) -> tuple[float, int]:
  """(median seconds per step, padded rows) of `torch_grouped_mm_step`'s step; with `profile`,
  also prints its CUDA kernels' time per step (torch.profiler, after the timing): the peer's
  split beside jaxquant's (`print_profile`)."""
  gen = torch.Generator(device="cuda").manual_seed(seed)
  randn = lambda *shape: torch.randn(*shape, generator=gen, device="cuda", dtype=torch.bfloat16)
  padded = -(-np.asarray(sizes, np.int64) // TORCH_GROUP_ALIGN) * TORCH_GROUP_ALIGN
  rows = int(padded.sum())
  x = randn(rows, k).requires_grad_()
  w = randn(len(sizes), n, k).requires_grad_()
  dy = randn(rows, n)
  offs = torch.as_tensor(np.cumsum(padded), dtype=torch.int32, device="cuda")

  def step():
    y = torch._grouped_mm(x, w.transpose(-2, -1), offs=offs, out_dtype=torch.bfloat16)
    return torch.autograd.grad(y, (x, w), dy)

  for _ in range(timing["warmup"]):
    step()
  torch.cuda.synchronize()
  times, events = [], []
  for _ in range(timing["repeats"]):  # bench/timing.py's rounds: host clock to the last result
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0 = time.perf_counter()
    start.record()
    for _ in range(timing["calls"]):
      step()
    end.record()
    end.synchronize()
    times.append((time.perf_counter() - t0) / timing["calls"])
    events.append(start.elapsed_time(end) / 1e3 / timing["calls"])
  print(f"    torch._grouped_mm step by CUDA events (GPU time from its first kernel): "
        f"{np.median(events) * 1e3:.3f} ms; by the host clock, as every JAX row: "
        f"{np.median(times) * 1e3:.3f} ms", flush=True)
  if profile:
    _print_torch_kernels(torch, step, timing["calls"])
  return float(np.median(times)), rows


def _print_torch_kernels(torch, step, steps: int) -> None:
  from torch.profiler import ProfilerActivity
  with torch.profiler.profile(activities=[ProfilerActivity.CUDA]) as prof:
    for _ in range(steps):
      step()
    torch.cuda.synchronize()
  kernels = []
  for e in prof.key_averages():
    us = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0.0)
    if us:
      kernels.append((us / 1e3 / steps, e.key))
  kernels.sort(reverse=True)
  print(f"    profile torch._grouped_mm step: {sum(ms for ms, _ in kernels):.3f} ms of kernels a "
        "step; top kernels:", flush=True)
  for ms, name in kernels[:8]:
    print(f"      {ms:8.3f} ms  {name[:120]}", flush=True)


def torch_row(experts: int, t, k, n, flops, result, dense_row, card) -> dict | None:
  """The `torch._grouped_mm` step as a table row (None, after printing why, when skipped)."""
  sec, note = result
  label = "PyTorch torch._grouped_mm bf16"
  if sec is None:
    print(f"  {label}: skipped: {note}", flush=True)
    return None
  row = dict(experts=experts, case=label, tokens=t, k=k, n=n, ms=sec * 1e3,
             tflops=flops / sec / 1e12, speedup_vs_bf16=float("nan"), gemm_paths="torch",
             quantize_paths="", why="", card=card, note=note)
  if dense_row is not None:
    row["speedup_vs_dense_step"] = dense_row["ms"] / row["ms"]
  vs = f"{row['speedup_vs_dense_step']:.2f}x dense" if dense_row is not None else ""
  print(f"  {label:38s} {sec * 1e3:9.3f} ms  {row['tflops']:7.1f} TFLOP/s  {vs} ({note})",
        flush=True)
  return row


def dense_step_peer(t, k, n, x, dy, timing, flops, groups, card,
                    profile_dir: str | None = None) -> dict | None:
  """The step of a bf16 `flax.linen.Dense` of the same FLOPs (all T rows through one K -> N
  matrix: forward, dgrad and wgrad), the peer a grouped step is judged against."""
  import flax.linen as nn
  model = nn.Dense(n, use_bias=False, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
  variables = jax.jit(model.init)(jax.random.key(0), x)

  @jax.jit
  def step(variables, x, dy):
    y, vjp = jax.vjp(model.apply, variables, x)
    return y, vjp(dy)

  try:
    sec = bench(step, variables, x, dy, **timing)
  except Exception as e:  # noqa: BLE001 - report and go on with the grouped rows
    print(f"  bf16 nn.Dense step: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
    return None
  print(f"  {'bf16 nn.Dense step (same FLOPs)':38s} {sec * 1e3:9.3f} ms  "
        f"{flops / sec / 1e12:7.1f} TFLOP/s", flush=True)
  if profile_dir:  # the peer's own wall time against its GPU span, as for the grouped rows
    print_profile(step, (variables, x, dy), profile_dir, "bf16 nn.Dense step",
                  steps=timing["calls"])
  return dict(experts=groups, case="bf16 nn.Dense step (same FLOPs)", tokens=t, k=k, n=n,
              ms=sec * 1e3, tflops=flops / sec / 1e12, speedup_vs_bf16=float("nan"),
              gemm_paths="", quantize_paths="", why="", card=card)


# name -> (quantizer of x and dy, quantizer of the expert weights)
GEMM_FORMATS = {
    "Float8CurrentScaling": lambda: (jq.Float8CurrentScalingQuantizer(),) * 2,
    "MXFP8": lambda: (jq.MXFP8Quantizer(),) * 2,
    "NVFP4 (row-scaled x)": lambda: (jq.NVFP4Quantizer(row_scaled=True), jq.NVFP4Quantizer()),
    "Float8Block 1x128": lambda: (jq.Float8BlockQuantizer((1, 128)),) * 2,
    # Float8BlockScaling's own layout: x / dy 1x128 blocks, expert weights 128x128 tiles
    "Float8Block 1x128 x 128x128 w": lambda: (jq.Float8BlockQuantizer((1, 128)),
                                             jq.Float8BlockQuantizer((128, 128))),
}


def dense_peers(t: int, k: int, n: int, rng, timing) -> dict[str, float]:
  """Seconds of the dense GEMMs of the grouped GEMMs' FLOPs (2 T K N), the roofline peers:
  bf16 `jax.lax.dot_general` (cuBLAS through XLA), jaxquant's per-tensor FP8 GEMM (cuBLASLt)
  with split (float32-promoted) and fast accumulation, and its Float8Block GEMM (cuBLASLt's
  block scaling, 1x128 x 128x128, the dense Float8BlockScaling forward), bf16 out."""
  x = jnp.asarray(rng.standard_normal((t, k), np.float32), jnp.bfloat16)
  w = jnp.asarray(rng.standard_normal((n, k), np.float32), jnp.bfloat16)
  dot_nt = lambda a, b: jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())),
                                            preferred_element_type=jnp.bfloat16)
  peers = {"dense bf16": bench(jax.jit(dot_nt), x, w, **timing)}
  fp8 = jq.Float8CurrentScalingQuantizer()
  q = lambda m: jax.jit(lambda m: jq.ops.quantize(m, fp8, rowwise=True,
                                                  columnwise=False).rowwise)(m)
  qx, qw = q(x), q(w)
  for acc in ("split", "fast"):
    fn = jax.jit(lambda a, b, acc=acc: ffi_gemm.gemm(a, b, out_dtype=jnp.bfloat16,
                                                     accumulation=acc))
    try:
      peers[f"dense fp8 ({acc} acc)"] = bench(fn, qx, qw, **timing)
    except Exception as e:  # noqa: BLE001 - no cuBLASLt here: report, go on
      print(f"  dense fp8 ({acc} acc): FAILED {type(e).__name__}: {str(e)[:200]}", flush=True)
  rows_q, tiles_q = jq.Float8BlockQuantizer((1, 128)), jq.Float8BlockQuantizer((128, 128))
  bq = lambda m, quantizer: jax.jit(lambda m: jq.ops.quantize(
      m, quantizer, rowwise=True, columnwise=False).rowwise)(m)
  try:
    fn = jax.jit(lambda a, b: ffi_gemm.gemm(a, b, out_dtype=jnp.bfloat16))
    peers["dense fp8 block"] = bench(fn, bq(x, rows_q), bq(w, tiles_q), **timing)
  except Exception as e:  # noqa: BLE001 - no block-scaled cuBLASLt here: report, go on
    print(f"  dense fp8 block: FAILED {type(e).__name__}: {str(e)[:200]}", flush=True)
  return peers


def run_gemms(experts: int, spec, args, card: str) -> list[dict]:
  """The grouped GEMMs alone (operands quantized beforehand): forward (ragged rows x experts),
  dgrad (ragged rows of dy x the experts' columnwise copies) and wgrad (per-group contraction
  over tokens), vs bf16 jax.lax.ragged_dot[_general] and vs the dense GEMMs of the same FLOPs
  (bf16 and FP8, timed in this process on this card)."""
  import jaxquant.grouped as jg
  groups, t, k, n, what = spec
  rng = np.random.default_rng(args.seed)
  sizes = jnp.asarray(group_sizes(rng, t, groups))
  x = jnp.asarray(rng.standard_normal((t, k), np.float32), jnp.bfloat16)
  w = jnp.asarray(rng.standard_normal((groups, n, k), np.float32), jnp.bfloat16)
  dy = jnp.asarray(rng.standard_normal((t, n), np.float32), jnp.bfloat16)
  flops = 2 * t * k * n
  dnums = jax.lax.RaggedDotDimensionNumbers(
      dot_dimension_numbers=(([1], [1]), ([], [])), lhs_ragged_dimensions=[1],
      rhs_group_dimensions=[])
  timing = dict(repeats=args.repeats, calls=args.calls, warmup=args.warmup)
  fwd = jax.jit(lambda x, w, s: jax.lax.ragged_dot(x, jnp.swapaxes(w, 1, 2), s))
  dgr = jax.jit(lambda d, w, s: jax.lax.ragged_dot(d, w, s))
  wgr = jax.jit(lambda x, dy, s: jax.lax.ragged_dot_general(x.T, dy.T, s, dnums))
  base = {"fprop": bench(fwd, x, w, sizes, **timing), "dgrad": bench(dgr, dy, w, sizes, **timing),
          "wgrad": bench(wgr, x, dy, sizes, **timing)}
  peers = dense_peers(t, k, n, rng, timing)
  tf = lambda sec: flops / sec / 1e12
  rows = []
  print(f"\n{groups} experts, GEMMs alone (T={t} K={k} N={n}); bf16 ragged_dot fprop "
        f"{base['fprop'] * 1e3:.3f} ms, dgrad {base['dgrad'] * 1e3:.3f} ms, wgrad "
        f"{base['wgrad'] * 1e3:.3f} ms; dense peers (same FLOPs): " +
        ", ".join(f"{name} {sec * 1e3:.3f} ms = {tf(sec):.0f} TFLOP/s"
                  for name, sec in peers.items()), flush=True)
  for name, sec in peers.items():
    rows.append(dict(experts=groups, gemm="dense peer", format=name, ms=sec * 1e3,
                     tflops=tf(sec), speedup_vs_bf16=float("nan"), vs_dense_bf16=
                     peers["dense bf16"] / sec, vs_dense_fp8=float("nan"), path="", card=card))
  fp8_peer = peers.get("dense fp8 (split acc)")
  if args.formats is None or NO_RECIPE in args.formats:
    for kind, fn, ops in no_recipe_gemms(x, w, dy, sizes):
      for config in args.sm90_configs or [None]:
        row = time_gemm(jg, ops, config, timing, gemm_fn=fn)
        if row is None:
          continue
        sec, _, kernel = row
        rows.append(dict(experts=groups, gemm=kind, format=NO_RECIPE, ms=sec * 1e3,
                         tflops=tf(sec), speedup_vs_bf16=base[kind] / sec,
                         vs_dense_bf16=peers["dense bf16"] / sec,
                         vs_dense_fp8=(fp8_peer / sec) if fp8_peer else float("nan"),
                         path=kernel, bf16_ms=base[kind] * 1e3, card=card,
                         sm90_config=config or ""))
        print(f"  {kind} {NO_RECIPE} [{config or 'auto'}] {sec * 1e3:8.3f} ms "
              f"{tf(sec):7.1f} TFLOP/s {base[kind] / sec:5.2f}x vs bf16 ragged_dot ({kernel})",
              flush=True)
  for name, make in GEMM_FORMATS.items():
    if args.formats and name not in args.formats:
      continue
    q, qw = make()
    plain = q if not getattr(q, "row_scaled", False) else jq.NVFP4Quantizer()
    a = jax.jit(lambda x, s: jg.quantize(x, s, q, columnwise=True, col_block=128))(x, sizes)
    b = jax.jit(lambda w: jg.quantize_experts(w, qw))(w)
    c = jax.jit(lambda d, s: jg.quantize(d, s, plain, col_block=128))(dy, sizes)
    for kind, ops in (("fprop", (a.rowwise, b.rowwise)), ("dgrad", (c.rowwise, b.columnwise)),
                      ("wgrad", (a.columnwise, c.columnwise))):
      for config in args.sm90_configs or [None]:
        row = time_gemm(jg, ops, config, timing)
        if row is None:
          continue
        sec, path, kernel = row
        if "CUTLASS" not in kernel:  # the configurations are the CUTLASS kernel's: time once
          config = None
        label = name if config is None else f"{name} [{config}]"
        row = dict(experts=groups, gemm=kind, format=name, ms=sec * 1e3, tflops=tf(sec),
                   speedup_vs_bf16=base[kind] / sec, vs_dense_bf16=peers["dense bf16"] / sec,
                   vs_dense_fp8=(fp8_peer / sec) if fp8_peer else float("nan"),
                   path=f"{path} ({kernel})", bf16_ms=base[kind] * 1e3, card=card,
                   sm90_config=config or "")
        rows.append(row)
        print(f"  {kind} {label:24s} {sec * 1e3:8.3f} ms {row['tflops']:7.1f} TFLOP/s "
              f"{row['speedup_vs_bf16']:5.2f}x vs bf16 ragged_dot, {row['vs_dense_bf16']:4.2f}x "
              f"dense bf16, {row['vs_dense_fp8']:4.2f}x dense fp8 ({path}, {kernel})", flush=True)
        if config is None:
          break
  return rows


NO_RECIPE = "bf16 (no recipe)"


def no_recipe_gemms(x, w, dy, sizes):
  """(kind, function, operands) of the three GEMMs of a GroupedDense without a recipe, as
  `jaxquant.layers.grouped_plain` runs them on the bfloat16 kernel: x and dy token-major, the
  kernel `[G, K, N]` as GroupedDense stores it (w here is `[G, N, K]`)."""
  starts = bf16.group_starts(sizes)
  kernel = jax.jit(lambda w: jnp.swapaxes(w, 1, 2))(w)
  out = jnp.bfloat16
  return [
      ("fprop", lambda x, w, s: bf16.gemm(x, w, s, mode=0, out_dtype=out, b_k_major=False),
       (x, kernel, starts)),
      ("dgrad", lambda d, w, s: bf16.gemm(d, w, s, mode=0, out_dtype=out), (dy, kernel, starts)),
      ("wgrad", lambda x, d, s: bf16.gemm(x, d, s, mode=1, out_dtype=out, a_k_major=False,
                                          b_k_major=False), (x, dy, starts)),
  ]


def time_gemm(jg, ops, config, timing, gemm_fn=None):
  """(seconds, paths, kernels) of one grouped GEMM (`jg.gemm`, or `gemm_fn` called on the bf16
  kernel directly) traced under `JAXQUANT_SM90_CONFIG=config` (None: as the environment has
  it), or None after printing why it was not timed (no instance of that configuration for
  these operands, or a failure)."""
  saved = os.environ.get(sm90_configs.ENV)
  if config is not None:
    os.environ[sm90_configs.ENV] = config
  try:
    if gemm_fn is not None:  # records no explain decision: the kernel is bf16's by construction
      gemm = jax.jit(lambda *a: gemm_fn(*a))
      sec = bench(gemm, *ops, **timing)
      on_gpu = jax.default_backend() == "gpu"
      return sec, "ffi", (f"{bf16.KERNEL} [{config or 'auto'}]" if on_gpu
                          else f"{bf16.TARGET} CPU handler")
    gemm = jax.jit(lambda a, b: jg.gemm(a, b))  # a new function: traced under this config
    report = jq.explain(gemm, *ops)
    path = ",".join(sorted({d.path for d in report}))
    kernel = ",".join(sorted({d.detail.rsplit("kernel: ", 1)[-1] for d in report
                              if "kernel: " in d.detail})) or "-"
    return bench(gemm, *ops, **timing), path, kernel
  except Exception as e:  # noqa: BLE001 - report and go on with the other rows
    no_instance = isinstance(e, ValueError) and "has instances for" in str(e)
    print(f"    [{config}] {'no instance' if no_instance else 'FAILED'}: "
          f"{type(e).__name__}: {str(e)[:300]}", flush=True)
    return None
  finally:
    if saved is None:
      os.environ.pop(sm90_configs.ENV, None)
    else:
      os.environ[sm90_configs.ENV] = saved


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--experts", type=int, nargs="+", choices=sorted(CASES),
                      default=[8, 64], help="which cases to run")
  parser.add_argument("--tiny", action="store_true",
                      help="tiny sizes and one timed call (a CPU smoke check, not a benchmark)")
  parser.add_argument("--recipes", nargs="*", default=None, choices=sorted(RECIPES),
                      help="only these recipes (default: all)")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--json", default=None)
  parser.add_argument("--gemms", action="store_true",
                      help="also time the grouped GEMMs alone (fprop, dgrad, wgrad) per format")
  parser.add_argument("--formats", nargs="*", default=None,
                      choices=sorted(GEMM_FORMATS) + [NO_RECIPE],
                      help="with --gemms: only these formats (default: all; "
                           f"'{NO_RECIPE}': the no-recipe GEMMs on the bfloat16 kernel)")
  parser.add_argument("--sm90-configs", type=lambda v: [c for c in v.split(",") if c],
                      default=None, metavar="NAME[:rn],...",
                      help="with --gemms: time each grouped GEMM under each of these CUTLASS "
                           "configurations (JAXQUANT_SM90_CONFIG, re-jitted per configuration; "
                           f"names: {', '.join(sm90_configs.CONFIGS)}; 'all' = every one and "
                           "default:rn)")
  parser.add_argument("--quantize", action="store_true",
                      help="also time the grouped NVFP4 quantize next to the single-tensor one")
  parser.add_argument("--profile-dir", default=None,
                      help="also print each jaxquant step's GPU kernel split (jax.profiler)")
  parser.add_argument("--compare-padding", action="store_true",
                      help="also time every jaxquant step with its wgrads' tiles chosen without "
                      "sm90_configs.WGRAD_BY_PADDING (as before it), same process")
  parser.add_argument("--profile-torch", action="store_true",
                      help="also print the torch._grouped_mm step's CUDA kernels (torch.profiler); "
                           "not with --profile-dir: after torch.profiler, jax.profiler's traces in "
                           "the same process come back empty")
  parser.add_argument("--compare-raw-copies", action="store_true",
                      help="also time every recipe's step with its MXFP8 copies written as codes "
                      "and decoded apart (JAXQUANT_GROUPED_RAW_COPIES=off), same process")
  parser.add_argument("--compare-along-n", action="store_true",
                      help="also time every recipe's step with its experts' raw MXFP8 forward copy "
                      "transposed, as before design decision 49 "
                      "(JAXQUANT_GROUPED_RAW_COPIES=transposed), same process")
  parser.add_argument("--compare-dgrad-copy", action="store_true",
                      help="also time every recipe's step with its raw MXFP8 experts' dgrad copy "
                      "written by the quantize kernel, as before design decision 56 "
                      "(JAXQUANT_EXPERTS_DGRAD_COPY=written), same process")
  parser.add_argument("--compare-accumulation", action="store_true",
                      help="also time each recipe's step with every FP8 GEMM's accumulation "
                           "split (JAXQUANT_FP8_ACCUMULATION=split: the forward too), same "
                           "process")
  parser.add_argument("--no-torch", action="store_true",
                      help="skip the PyTorch torch._grouped_mm bf16 row")
  parser.add_argument("--no-float32-params", action="store_true",
                      help="time the steps with bf16 parameters only (default: each row also "
                           "with float32 parameters, Flax's default, quantized from float32)")
  parser.add_argument("--calls", type=int, default=5,
                      help="back-to-back calls a timing round (bench/timing.py), every row alike")
  parser.add_argument("--no-steps", action="store_true",
                      help="skip the GroupedDense step table (with --gemms / --quantize)")
  args = parser.parse_args(argv)
  if args.profile_torch and args.profile_dir:
    parser.error("--profile-torch with --profile-dir: after torch.profiler, jax.profiler's "
                 "traces in the same process come back empty; profile them in two runs")
  if args.sm90_configs == ["all"]:
    args.sm90_configs = list(sm90_configs.CONFIGS) + ["default:rn", "bf16:rn"]
  for config in args.sm90_configs or []:
    sm90_configs.parse(config)  # an unknown name fails here, not after the first timings
  args.repeats, args.calls, args.warmup = (1, 1, 1) if args.tiny else (5, args.calls, 2)
  cases = TINY if args.tiny else CASES
  torch_results = {}  # before JAX starts on the GPU: see torch_grouped_mm_step
  if not args.no_steps and not args.no_torch:
    for experts in args.experts:
      groups, t, k, n, _ = cases[experts]
      sizes = group_sizes(np.random.default_rng(args.seed), t, groups)  # run_case's draw
      torch_results[experts] = torch_grouped_mm_step(
          t, k, n, sizes, args.seed, dict(repeats=args.repeats, calls=args.calls,
                                          warmup=args.warmup), args.profile_torch)
  device = jax.devices()[0]
  card = getattr(device, "device_kind", str(device))
  print(f"device: {card}; jax {jax.__version__}", flush=True)
  results = []
  gemm_rows = []
  quantize_rows = []
  for experts in args.experts:
    if not args.no_steps:
      results += run_case(experts, cases[experts], args, card, torch_results.get(experts))
    if args.gemms:
      gemm_rows += run_gemms(experts, cases[experts], args, card)
    if args.quantize:
      quantize_cases = grouped_quantize.TINY if args.tiny else grouped_quantize.CASES
      quantize_rows += grouped_quantize.run(
          experts, quantize_cases[experts],
          dict(repeats=args.repeats, calls=2 * args.calls, warmup=args.warmup), args.seed)
  if results:
    print("\n| experts | case | ms | effective TFLOP/s | speedup vs bf16 ragged_dot | vs bf16 "
          "nn.Dense step | grouped GEMM path | grouped quantize path |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
      vs_dense = f"{r['speedup_vs_dense_step']:.2f}x" if "speedup_vs_dense_step" in r else "-"
      vs_ragged = "-" if math.isnan(r["speedup_vs_bf16"]) else f"{r['speedup_vs_bf16']:.2f}x"
      print(f"| {r['experts']} | {r['case']} | {r['ms']:.2f} | {r['tflops']:.0f} | "
            f"{vs_ragged} | {vs_dense} | {r['gemm_paths']} | "
            f"{r['quantize_paths']} |")
  suffix, costs = ", float32 params", []
  by_case = {(r["experts"], r["case"]): r["ms"] for r in results}
  for (experts, case), ms in by_case.items():
    base = by_case.get((experts, case.removesuffix(suffix)))
    if case.endswith(suffix) and base:
      costs.append(f"{experts} experts {case.removesuffix(suffix)}: {ms / base:.3f}x")
  if costs:
    print("\nfloat32-params step / bf16-params step: " + "; ".join(costs))
  reasons = sorted({r["why"] for r in results if r["why"]})
  if reasons:
    print("\nwhy a slower path (reference, or the mma.sync kernel): " + " | ".join(reasons))
  if gemm_rows:
    print("\n| experts | GEMM | format | sm90 config | ms | TFLOP/s | vs bf16 ragged_dot | "
          "grouped/dense bf16 | grouped/dense fp8 (split acc) | path |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in gemm_rows:
      print(f"| {r['experts']} | {r['gemm']} | {r['format']} | {r.get('sm90_config') or '-'} | "
            f"{r['ms']:.3f} | "
            f"{r['tflops']:.0f} | {r['speedup_vs_bf16']:.2f}x | {r['vs_dense_bf16']:.2f} | "
            f"{r['vs_dense_fp8']:.2f} | {r['path']} |")
  if quantize_rows:
    grouped_quantize.print_table(quantize_rows)
  if args.json:
    with open(args.json, "w") as f:
      json.dump({"steps": results, "gemms": gemm_rows, "quantize": quantize_rows}, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
