"""End-to-end training step of a standard Flax transformer LM, side by side in one process:
bf16, Flax's own FP8 (`Fp8DirectDotGeneralOp`, `Fp8DotGeneralOp`) on the same layers, every
jaxquant built-in recipe through `jaxquant.flax.quantize_dense` (+ `apply_gradients`) on the
unmodified model, and the same network written with jaxquant's modules (`modules_<recipe>`:
`LayerNormDense` for the norm + fused qkv projection, `LayerNormMLP`, a `LayerNormDense`
`lm_head`; `e2e_model.ModulesLM`), as TransformerEngine's users write theirs. Parameters are
float32 (Flax's default), compute bfloat16.

    PYTHONPATH=examples python bench/e2e.py --size d2048 --json out.json --trace-dir /tmp/traces
    PYTHONPATH=examples python bench/e2e.py --size d4096 --steps 30 \\
        --variants bf16,flax_fp8_direct,fp8_current
    PYTHONPATH=examples python bench/e2e.py --tiny   # CPU smoke run (tiny model, 3 steps)

Per variant: step time (mean over steps `--time-from`..`--steps` of the training run, timed
end to end with the device synchronized at both ends; the steps are dispatched back to back
and no loss is read until the end), tokens/s, trace+lower and XLA compile time of the step,
the training loss at steps 1, 25 and the last step (every variant trains on the same batches
from the same initial parameters), and the GPU kernel time per step split into GEMM / quantize
/ other from a `jax.profiler` trace of `--profile-steps` further steps (`e2e_trace`). A variant
name may end in `@<path>` (`PATHS`: `@ffi`, `@xla`, `@reference`, ...): the quantize
implementation is forced to it while the step is traced; and in `+fetch`: the loss is read
(`float(loss)`) after every step, as Flax's examples log it, so the host's dispatch of each
step is no longer hidden behind the previous step. `--attention off` leaves the attention
projections (`nn.DenseGeneral`) in bf16 in every variant; `--attention-core cudnn` runs every
variant's softmax core on cuDNN's fused kernel.

Measurement options (session 35): `--rounds R` builds every variant first and times them in R
interleaved rounds (a row's time is its median round's), so a drift of the card's clocks
reaches every row alike; `--seed` draws another initialization and data order (an FP8 run
repeats its trajectory from process to process, so loss comparisons need seeds: design
decision 59); `--warmup` warms the learning rate up linearly; `--amax-report N` lists the N
delayed-scaling histories whose scale is stalest after the run.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gzip
import json
import os
import shutil
import statistics
import sys
import time
from typing import Optional

import jax
import jax.numpy as jnp
import optax
from flax.linen import fp8_ops

import jaxquant as jq
import jaxquant.flax as jqf
from e2e_model import DATA, SIZES, Config, ModulesLM, StandardLM
import e2e_trace

def _delayed_for(tensor_types: tuple) -> jq.Recipe:
  """Delayed scaling for the roles of `tensor_types`, current scaling for the others."""
  delayed, current = jq.DelayedScaling().factory(), jq.Float8CurrentScaling().factory()
  def factory(role):
    return (delayed if role is not None and role.tensor_type in tensor_types else current)(role)
  return jq.CustomRecipe(factory)


RECIPES = {
    "fp8_current": jq.Float8CurrentScaling,
    "fp8_delayed": jq.DelayedScaling,
    "fp8_delayed_one": lambda: jq.DelayedScaling(first_scale="one"),  # TE's scale-1 start
    # Delayed scaling's scale from the last step's amax alone, and from the last 16 steps' largest
    # (the default takes the largest of 1024, as TransformerEngine's): the loss at step 100.
    "fp8_delayed_recent": lambda: jq.DelayedScaling(amax_compute_algo="most_recent"),
    "fp8_delayed_h16": lambda: jq.DelayedScaling(amax_history_len=16),
    "fp8_delayed_m1": lambda: jq.DelayedScaling(margin=1),  # a factor 2 of headroom
    # Delayed scaling for some tensors only (current scaling for the rest): which tensors' stale
    # scales cost delayed scaling its loss.
    "fp8_delayed_xw": lambda: _delayed_for(("input", "weight")),
    "fp8_delayed_grad": lambda: _delayed_for(("grad_output",)),
    "fp8_delayed_x": lambda: _delayed_for(("input",)),
    "fp8_delayed_w": lambda: _delayed_for(("weight",)),
    "fp8_block": jq.Float8BlockScaling,
    "mxfp8": jq.MXFP8BlockScaling,
    "nvfp4": jq.NVFP4BlockScaling,
    "identity": lambda: jq.CustomRecipe(lambda role: jq.IdentityQuantizer()),
}
FLAX_FP8 = {"flax_fp8_direct": fp8_ops.Fp8DirectDotGeneralOp,
            "flax_fp8_qdq": fp8_ops.Fp8DotGeneralOp}
# Issue 24's table: the unmodified model (Flax's FP8, quantize_dense) and the modules model, in
# both timing modes for the rows its targets compare.
# The modules rows run `jaxquant.flax.Embed`; `flax_fp8_direct_jqembed` is their Flax peer with
# the same embedding (the unmodified rows keep `nn.Embed`).
DEFAULT_VARIANTS = ("bf16,flax_fp8_direct,fp8_delayed,fp8_current,fp8_block,"
                    "modules_bf16,flax_fp8_direct_jqembed,modules_fp8_delayed,modules_fp8_current,"
                    "modules_fp8_block,bf16+fetch,flax_fp8_direct+fetch,fp8_delayed+fetch,"
                    "modules_bf16+fetch,flax_fp8_direct_jqembed+fetch,modules_fp8_delayed+fetch")
FETCH = "+fetch"


def quantize_dense_context(recipe, attention: bool):
  """`quantize_dense(recipe)`; `nn.DenseGeneral` (the attention projections) left alone unless
  `attention`."""
  return jqf.quantize_dense(recipe, dense_general=attention)


# `<variant>@<path>`: the environment the step is traced under. The keys are those that pick
# a quantize implementation (jaxquant.ops.dispatch, jaxquant.backends.xla, jaxquant.backends.ffi).
PATHS = {
    "auto": {},
    "reference": {"JAXQUANT_BACKEND": "reference"},
    "ffi": {"JAXQUANT_BACKEND": "ffi", "JAXQUANT_FFI_AMAX": "kernel"},
    "ffi_xamax": {"JAXQUANT_BACKEND": "ffi", "JAXQUANT_FFI_AMAX": "xla"},
    "xla": {"JAXQUANT_BACKEND": "xla"},
    "xla_top": {"JAXQUANT_BACKEND": "xla", "JAXQUANT_XLA_COLUMNWISE": "transpose-op"},
    "xla_fused": {"JAXQUANT_BACKEND": "xla", "JAXQUANT_XLA_COLUMNWISE": "fused"},
    # FP8 GEMMs with fast accumulation in every direction (the default is fast fprop and split
    # dgrad/wgrad, as TransformerEngine): what XLA's own FP8 GEMMs use.
    "fastacc": {"JAXQUANT_FP8_ACCUMULATION": "fast"},
    # The fused producers in the modules model (opt-in: docs/design.md decision 20) and off.
    "fused": {"JAXQUANT_FUSE_PRODUCERS": "on"},
    "fused_norms": {"JAXQUANT_FUSE_PRODUCERS": "norms"},  # the normalizations alone
    "unfused": {"JAXQUANT_FUSE_PRODUCERS": "off"},
    # The MLP's gelu in fc1's GEMM epilogue (docs/design.md decision 60; on by default on CUDA)
    # off, for the A/B row.
    "noepi": {"JAXQUANT_GEMM_EPILOGUE": "off"},
}
ENV_KEYS = sorted({k for env in PATHS.values() for k in env})
# The loss compared besides the last step's: the mean of the last LOSS_TAIL steps' losses (each
# step trains on its own batch, the same batch for every variant; one step's loss moves with the
# trajectory's noise, e.g. the embedding gradient's scatter-add, which adds in no fixed order).
LOSS_TAIL = 10


# `<base>_<embed>`: the model's token and position embeddings (e2e_model.EMBEDS) forced, for
# the same-embedding comparisons; without it StandardLM keeps `nn.Embed` and ModulesLM takes
# `jaxquant.flax.Embed`.
EMBED_SUFFIXES = {"_flaxembed": "flax", "_jqembed": "jaxquant"}


def split_variant(name: str) -> tuple[str, Optional[str], str]:
  """(base, forced embedding or None, path) of a variant name."""
  base, _, path = name.removesuffix(FETCH).partition("@")
  for suffix, embed in EMBED_SUFFIXES.items():
    if base.endswith(suffix):
      return base.removesuffix(suffix), embed, path
  return base, None, path


def embedding_of(name: str) -> str:
  """The embedding module a variant's model runs ("flax" or "jaxquant")."""
  base, embed, _ = split_variant(name)
  return embed or ("jaxquant" if base.startswith("modules_") else "flax")


def build_variant(name: str, cfg: Config, attention: bool):
  """(model, context factory for init/trace, environment) of a variant name."""
  base, embed, path = split_variant(name)
  if path and path not in PATHS:
    raise ValueError(f"variant {name!r}: unknown path {path!r}; expected one of {sorted(PATHS)}")
  env = PATHS[path or "auto"]
  cfg = dataclasses.replace(cfg, embed=embed)
  if base == "bf16":
    return StandardLM(cfg), contextlib.nullcontext, env
  if base in FLAX_FP8:
    return StandardLM(cfg, FLAX_FP8[base], attention), contextlib.nullcontext, env
  if base == "modules_bf16":  # the modules model's own baseline (its parameters differ)
    return ModulesLM(cfg), contextlib.nullcontext, env
  if base.startswith("modules_"):
    recipe = RECIPES[base[len("modules_"):]]()
    return ModulesLM(cfg), lambda: jq.autocast(recipe), env
  if base in RECIPES:
    recipe = RECIPES[base]()
    return StandardLM(cfg), lambda: quantize_dense_context(recipe, attention), env
  raise ValueError(f"variant {name!r}: expected one of bf16, {sorted(FLAX_FP8)}, "
                   f"{sorted(RECIPES)}, modules_bf16, modules_<recipe>, optionally with "
                   f"one of {sorted(EMBED_SUFFIXES)}, then @<path>, then optionally {FETCH}")


@contextlib.contextmanager
def path_env(env: dict):
  """`env` set (and every other path-selecting variable unset) while the step is traced."""
  old = {k: os.environ.get(k) for k in ENV_KEYS}
  for k in ENV_KEYS:
    os.environ.pop(k, None)
  os.environ.update(env)
  try:
    yield
  finally:
    for k, v in old.items():
      if v is None:
        os.environ.pop(k, None)
      else:
        os.environ[k] = v


def make_step(model, tx):
  def loss_fn(variables, tokens, key):
    logits = model.apply(variables, tokens[:, :-1], rngs={"quantize": key})
    labels = tokens[:, 1:]
    return optax.softmax_cross_entropy_with_integer_labels(
        logits.astype(jnp.float32), labels).mean()

  def step(state, batches, i):
    variables, opt_state = state
    tokens = jax.lax.dynamic_index_in_dim(batches, i, keepdims=False)
    key = jax.random.fold_in(jax.random.key(7), i)
    loss, grads = jax.value_and_grad(loss_fn)(variables, tokens, key)
    variables, opt_state = jqf.apply_gradients(tx, variables, grads, opt_state)
    return (variables, opt_state), loss

  return jax.jit(step, donate_argnums=(0,))


class PhaseLog:
  """Prints each phase of a variant's run as it ends (seconds since the previous one), so a
  job stopped by its timeout shows which phase it was in."""

  def __init__(self, name: str):
    self.name, self.last = name, time.perf_counter()

  def __call__(self, phase: str) -> None:
    now = time.perf_counter()
    print(f"    {self.name}: {phase} done in {now - self.last:.1f} s", flush=True)
    self.last = now


class VariantRun:
  """One variant of the step: built, compiled and run to `--time-from` on construction; then
  `timed(n)` runs and times its next `n` steps (inside the variant's context, so rounds of
  several variants can interleave) and `row()` reads its losses and profile."""

  def __init__(self, name, cfg, args, batches, tx):
    self.name, self.cfg, self.args, self.batches = name, cfg, args, batches
    model, self.context, self.env = build_variant(name, cfg, args.attention == "on")
    self.fetch = name.endswith(FETCH)
    phase = self.phase = PhaseLog(name)
    with self.scope():
      variables = jax.jit(model.init)(jax.random.key(args.seed), batches[0, :, :-1])
      variables = dict(variables)
      opt_state = jqf.init_optimizer(tx, variables)
      jax.block_until_ready(opt_state)
      phase("init")
      step = make_step(model, tx)
      self.paths = ""
      base = name.removesuffix(FETCH)
      if base != "bf16" and not base.startswith("flax"):
        report = jq.explain(step, (variables, opt_state), batches, 0)
        self.paths = ";".join(f"{op}:{','.join(sorted(report.paths(op)))}"
                              for op in ("quantize", "gemm") if report.paths(op))
        phase("explain")
      state = (variables, opt_state)
      t0 = time.perf_counter()
      lowered = step.lower(state, batches, 0)
      t1 = time.perf_counter()
      self.compiled = lowered.compile()  # the loop calls it: one compilation, timed on its own
      t2 = time.perf_counter()
      phase("lower + compile")
      self.lower_s, self.compile_s = t1 - t0, t2 - t1
      if args.hlo_dir:  # the optimized HLO of the step: which ops XLA fused with which
        os.makedirs(args.hlo_dir, exist_ok=True)
        path = os.path.join(args.hlo_dir, name.replace("@", "_") + ".hlo.txt.gz")
        with gzip.open(path, "wt") as f:
          f.write(self.compiled.as_text())
      self.state, loss = self.compiled(state, batches, 0)
      jax.block_until_ready(loss)
      phase("first step")
      self.losses, self.next_step = [loss], 1
      self._run(args.time_from - 1)
      jax.block_until_ready(self.state)
    self.seconds: list[float] = []  # a step's time in each timed round

  @contextlib.contextmanager
  def scope(self):
    """The variant's quantize-path environment and model context, around each of its phases."""
    with path_env(self.env), self.context():
      yield

  def _run(self, n: int) -> None:
    for i in range(self.next_step, self.next_step + n):
      self.state, loss = self.compiled(self.state, self.batches, i)
      self.losses.append(float(loss) if self.fetch else loss)  # +fetch: wait for each loss
    self.next_step += n

  def timed(self, n: int) -> float:
    """Runs the next `n` steps; returns and records their time a step (seconds)."""
    with self.scope():
      jax.block_until_ready(self.state)
      t0 = time.perf_counter()
      self._run(n)
      jax.block_until_ready(self.state)
      seconds = (time.perf_counter() - t0) / n
    self.seconds.append(seconds)
    self.phase(f"{n} timed steps")
    return seconds

  def row(self) -> dict:
    """The variant's table row (the median round's step time); profiles it if asked, then
    frees its state."""
    args, name = self.args, self.name
    losses = [float(loss) for loss in self.losses]
    if args.amax_report:
      print_amax_report(name, self.state[0], args.amax_report)
    split = None
    if args.trace_dir and args.profile_steps:
      with self.scope():
        split = self._profile()
    self.state = None
    seconds = statistics.median(self.seconds)
    return dict(variant=name, step_ms=seconds * 1e3, tokens_per_s=self.cfg.tokens / seconds,
                round_ms=[round(t * 1e3, 3) for t in self.seconds],
                lower_s=self.lower_s, compile_s=self.compile_s, loss_1=losses[0],
                loss_25=losses[min(24, len(losses) - 1)], loss_last=losses[-1],
                loss_tail=sum(losses[-LOSS_TAIL:]) / len(losses[-LOSS_TAIL:]), steps=len(losses),
                paths=self.paths, split=split)

  def _profile(self):
    args, name = self.args, self.name
    logdir = os.path.join(args.trace_dir, name.replace("@", "_").replace("+", "_"))
    shutil.rmtree(logdir, ignore_errors=True)
    with jax.profiler.trace(logdir):
      for i in range(args.profile_steps):
        self.state, loss = self.compiled(self.state, self.batches, i % args.steps)
        if self.fetch:
          float(loss)
      jax.block_until_ready(self.state)
    trace = e2e_trace.latest_trace(logdir)
    times, streams = e2e_trace.kernel_times(trace)
    split = e2e_trace.split(times, args.profile_steps) if times else None
    if split is not None:
      split["streams"] = streams
      print_occupancy(name, trace, args.profile_steps)
    if not args.keep_traces:
      shutil.rmtree(logdir, ignore_errors=True)
    return split


def run_variant(name, cfg, args, batches, tx) -> dict:
  """One variant alone: built, run to `--time-from`, then its remaining steps timed at once."""
  run = VariantRun(name, cfg, args, batches, tx)
  run.timed(args.steps - args.time_from)
  return run.row()


def measure(names, cfg, args, batches, tx):
  """The rows of `names`: one variant after another, or in interleaved rounds (`--rounds`)."""
  if args.rounds > 1:
    yield from run_rounds(names, cfg, args, batches, tx)
    return
  for name in names:
    try:
      row = run_variant(name, cfg, args, batches, tx)
    except Exception as e:  # noqa: BLE001 - one failing variant must not hide the others
      print(f"  {name}: FAILED {type(e).__name__}: {str(e)[:400]}", flush=True)
      continue
    yield row


def run_rounds(names, cfg, args, batches, tx) -> list:
  """Every variant built and run to `--time-from` first; then `--rounds` rounds, each timing
  every variant's next share of the steps in turn, so slow drifts of the card (clocks,
  temperature) reach every row alike; a row's step time is its median round's. Rows whose
  variant failed to build are left out, as in `run_variant`'s loop."""
  runs = []
  for name in names:
    try:
      runs.append(VariantRun(name, cfg, args, batches, tx))
    except Exception as e:  # noqa: BLE001 - one failing variant must not hide the others
      print(f"  {name}: FAILED {type(e).__name__}: {str(e)[:400]}", flush=True)
  timed = args.steps - args.time_from
  shares = [timed // args.rounds + (r < timed % args.rounds) for r in range(args.rounds)]
  for share in shares:
    for run in runs:
      run.timed(share)
  return [run.row() for run in runs]


def print_amax_report(name: str, variables: dict, top: int) -> None:
  """Delayed scaling's amax histories after the run: for the `top` tensors whose history maximum
  (the scale's source) most exceeds their last amax, that ratio (a stale scale: the bits the
  tensor's values lose to it), the step of the maximum and the amax at a few steps. A history of
  1024 holds every amax of a run of up to 1024 steps, oldest first."""
  rows = []
  for path, hist in jax.tree_util.tree_flatten_with_path(variables)[0]:
    key = jax.tree_util.keystr(path)
    if not key.endswith("amax_history']"):
      continue
    h = jax.device_get(hist).reshape(-1)
    seen = h[h > 0]
    if seen.size < 2:
      continue
    ratio = float(seen.max() / seen[-1])
    rows.append((ratio, key, int(seen.argmax()) + 1, seen))
  rows.sort(key=lambda row: -row[0])
  print(f"    {name}: {len(rows)} amax histories; max/last over all: "
        + (f"median {sorted(r[0] for r in rows)[len(rows) // 2]:.2f}" if rows else "-"))
  for ratio, key, at, seen in rows[:top]:
    marks = ", ".join(f"{i + 1}:{seen[i]:.3g}" for i in sorted({0, 4, 9, 24, 49, seen.size - 1})
                      if i < seen.size)
    print(f"      {ratio:7.2f}x  max at step {at:4d}  {key}  amax {marks}")


def print_occupancy(name: str, trace: str, steps: int) -> None:
  """The profiled steps' GPU span and busy time a step, their longest idle gaps with the kernels
  around them, and the host events of the same steps: where a step's idle GPU time goes (with
  the loss fetched every step, the host's work between two steps is exposed)."""
  events = e2e_trace.gpu_stream_events(trace)[0]
  gpu = e2e_trace.occupancy(events)
  print(f"  {name}: profiled GPU span {gpu['span_us'] / 1e3 / steps:.2f} ms a step, busy "
        f"{gpu['busy_us'] / 1e3 / steps:.2f}", flush=True)
  for line in e2e_trace.gap_and_host_lines(trace, events, steps, gaps=8, host=25, indent="    "):
    print(line, flush=True)


def peer_rows(r: dict, rows: list[dict]):
  """(bf16 row, Flax FP8 row, loss baseline row) of row `r`, each None where absent.

  The step peers run the same timing mode and the same embedding module (`embedding_of`), the
  path left at its default: the bf16 row of r's own model (`modules_bf16` for a modules row,
  else `bf16`) and `flax_fp8_direct`. The loss baseline is r's own model's bf16 row timed
  without a fetch, with the same embedding."""
  fetch, embed = r["variant"].endswith(FETCH), embedding_of(r["variant"])
  same = [x for x in rows if x["variant"].endswith(FETCH) == fetch
          and embedding_of(x["variant"]) == embed and not split_variant(x["variant"])[2]]
  base = lambda x: split_variant(x["variant"])[0]
  first = lambda pool, name: next((x for x in pool if base(x) == name), None)
  own_bf16 = "modules_bf16" if base(r).startswith("modules_") else "bf16"
  bf16 = first(same, own_bf16) or first(same, "bf16")
  plain = [x for x in rows if not x["variant"].endswith(FETCH)
           and embedding_of(x["variant"]) == embed and not split_variant(x["variant"])[2]]
  return bf16, first(same, "flax_fp8_direct"), first(plain, own_bf16)


def print_table(rows, card, cfg, attention, data):
  print(f"\n{card}; data {data}; d_model {cfg.d_model}, {cfg.layers} layers, {cfg.heads} heads, "
        f"MLP "
        f"{cfg.mlp}, seq {cfg.seq}, batch {cfg.batch}, vocab {cfg.vocab}; attention "
        f"projections quantized: {attention}; attention core {cfg.attention}")
  print("Step ratios: against the bf16 / Flax FP8 rows of the same timing mode (+fetch: the loss "
        "read every step) and the same embedding module (a modules row against modules_bf16 "
        "where present); loss: against the same model's bf16 (bf16, modules_bf16).")
  print("| variant | ms/step | tokens/s | vs bf16 | vs Flax FP8 | loss@1 | loss@25 | "
        f"loss@{rows[0]['steps']} | vs bf16 loss | same, last {LOSS_TAIL} steps' mean | GEMM ms | "
        "quantize ms | other ms | of which scatter ms | lower s | compile s |")
  print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
  for r in rows:
    s = r["split"] or {}
    # Step ratios against the same timing mode's rows; the loss against the same model's bf16.
    base_row, flax_row, own = peer_rows(r, rows)
    ratio = lambda ref: f"{ref['step_ms'] / r['step_ms']:.3f}x" if ref else "-"
    dloss = lambda k: f"{(r[k] / own[k] - 1) * 100:+.2f}%" if own else "-"
    fmt = lambda k: f"{s[k]:.2f}" if k in s else "-"
    print(f"| {r['variant']} | {r['step_ms']:.2f} | {r['tokens_per_s']:,.0f} | "
          f"{ratio(base_row)} | {ratio(flax_row)} | {r['loss_1']:.4f} | "
          f"{r['loss_25']:.4f} | {r['loss_last']:.4f} | {dloss('loss_last')} | "
          f"{dloss('loss_tail')} | {fmt('gemm_ms')} | "
          f"{fmt('quantize_ms')} | {fmt('other_ms')} | {fmt('scatter_ms')} | {r['lower_s']:.1f} | "
          f"{r['compile_s']:.1f} |")


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--size", choices=sorted(SIZES), default="d2048")
  parser.add_argument("--tiny", action="store_true", help="CPU smoke run: --size tiny, 3 steps")
  parser.add_argument("--batch", type=int, default=None)
  parser.add_argument("--seq", type=int, default=None)
  parser.add_argument("--variants", default=DEFAULT_VARIANTS)
  parser.add_argument("--attention", choices=("on", "off"), default="on",
                      help="quantize the attention projections (nn.DenseGeneral) too")
  parser.add_argument("--attention-core", choices=("xla", "cudnn"), default="xla",
                      help="attention's softmax core in every variant: Flax's (xla) or cuDNN's "
                           "fused kernel (GPU only), as TransformerEngine's users run theirs")
  parser.add_argument("--steps", type=int, default=100)
  parser.add_argument("--rounds", type=int, default=1,
                      help="time the variants in this many interleaved rounds (every variant "
                           "built first; a row's step time is its median round's)")
  parser.add_argument("--time-from", type=int, default=10)
  parser.add_argument("--profile-steps", type=int, default=3)
  parser.add_argument("--trace-dir", default=None)
  parser.add_argument("--keep-traces", action="store_true")
  parser.add_argument("--lr", type=float, default=3e-4)
  parser.add_argument("--warmup", type=int, default=0,
                      help="steps of linear learning-rate warmup (0: --lr from the first step, "
                           "as every timed table so far)")
  parser.add_argument("--data", choices=sorted(DATA), default="pairs",
                      help="token source (e2e_model.DATA): stdlib text as byte pairs or bytes, "
                           "or a random Markov chain")
  parser.add_argument("--json", default=None)
  parser.add_argument("--seed", type=int, default=0,
                      help="the initialization's key and the data's offsets: an FP8 run repeats "
                           "its trajectory from process to process, so loss comparisons need seeds")
  parser.add_argument("--amax-report", type=int, default=0, metavar="N",
                      help="after each run, the N delayed-scaling tensors whose scale is stalest")
  parser.add_argument("--hlo-dir", default=None,
                      help="write each variant's compiled (optimized) HLO text, gzipped, here")
  args = parser.parse_args(argv)
  if args.tiny:
    args.size, args.steps, args.time_from = "tiny", 3, 1
  cfg = SIZES[args.size]
  overrides = {k: v for k, v in (("batch", args.batch), ("seq", args.seq)) if v}
  cfg = Config(**{**cfg.__dict__, **overrides, "attention": args.attention_core})
  if not 0 < args.time_from < args.steps:
    parser.error(f"--time-from {args.time_from} must be in [1, --steps={args.steps})")
  if not 1 <= args.rounds <= args.steps - args.time_from:
    parser.error(f"--rounds {args.rounds} must be in [1, --steps - --time-from = "
                 f"{args.steps - args.time_from}] (every round times at least one step)")
  device = jax.devices()[0]
  card = getattr(device, "device_kind", str(device))
  print(f"device: {card}; jax {jax.__version__}; {cfg}; ~{cfg.params_count() / 1e6:.0f}M "
        f"params; {cfg.matmul_flops() / 1e12:.2f} TFLOP of matmuls per step", flush=True)
  batches = DATA[args.data](cfg, args.steps, args.seed)
  lr = args.lr if not args.warmup else optax.join_schedules(
      [optax.linear_schedule(0.0, args.lr, args.warmup), optax.constant_schedule(args.lr)],
      [args.warmup])
  tx = optax.adamw(lr, b1=0.9, b2=0.95, weight_decay=0.1)
  rows = []
  names = [v.strip() for v in args.variants.split(",") if v.strip()]
  for row in measure(names, cfg, args, batches, tx):
    row.update(card=card, size=args.size, attention=args.attention, data=args.data,
               config=cfg.__dict__ | {"dtype": "bfloat16"})
    rows.append(row)
    s = row["split"] or {}
    name = row["variant"]
    print(f"  {name:24s} {row['step_ms']:8.2f} ms  {row['tokens_per_s']:10,.0f} tok/s  loss "
          f"{row['loss_1']:.4f} -> {row['loss_last']:.4f}  lower {row['lower_s']:.1f}s "
          f"compile {row['compile_s']:.1f}s  "
          f"gemm {s.get('gemm_ms', 0):.2f} quant {s.get('quantize_ms', 0):.2f} other "
          f"{s.get('other_ms', 0):.2f}  {row['paths']}", flush=True)
    if args.json:  # written after every variant, so a run cut short keeps what it measured
      with open(args.json, "w") as f:
        json.dump(rows, f, indent=1, default=str)
  if rows:
    print_table(rows, card, cfg, args.attention, args.data)
  return 0 if rows else 1


if __name__ == "__main__":
  sys.exit(main())
