"""Train a small byte-level GPT on the Python standard library's source, under any recipe.

    python examples/train_lm.py                      # bf16 vs FP8 current scaling, ~2 min on CPU
    python examples/train_lm.py --recipe all         # bf16 + every built-in + every zoo recipe
    python examples/train_lm.py --recipe bf16,mxfp8,nvfp4 --steps 1000 --d-model 256 --explain
    python examples/train_lm.py --checkpoint ckpt    # saves every 50 steps; run again to resume
    python examples/train_lm.py --mesh dp=2,tp=4 --coordinator host0:12345 --num-processes 2 \
        --process-id 0                               # on each of 2 hosts (id 1 on the other)

Every projection of the model (`qkv`, `proj`, `fc1`, `fc2`, `lm_head`) is a
`jaxquant.flax.Dense` carrying the recipe; the rest (embeddings, norms, attention scores) runs in
bfloat16 with float32 parameters. Each recipe starts from the same parameters and sees the same
batches (by default bf16 and fp8_current: FP8 should train like bf16, and the final gap is
printed). Writes `<out>/losses.csv` (step, recipe, train_loss, val_loss, time),
`<out>/steps.csv` (every training step's loss, exact, and wall time) and `<out>/losses.png`, and
prints a summary table. Recipe names accept `-` for `_`
(`--recipe fp8-current`). `--checkpoint DIR` saves each recipe's run with orbax
(`lm/checkpoint.py`: parameters, optimizer and delayed-scaling state, step, data position) and
resumes it from there when run again with the same settings. On CPU the jaxquant ops take the
pure-JAX reference path unless `--backend`/`$JAXQUANT_BACKEND` says otherwise.

Layout: `lm/data.py` (corpus and batches), `lm/model.py` (the GPT), `lm/recipes.py` (recipe
names), `lm/training.py` (optimizer, jitted steps, loop), `lm/report.py` (CSV, plot, table).
`--mesh dp=2,tp=4` (axes `dp`, `fsdp`, `tp`, any sizes) shards the model and the batches over
a device mesh (`lm/sharding.py`: Flax logical axis rules; FP8 storages stay sharded, FSDP
weights are gathered as quantized bytes where exact). `--moe 8,2` replaces every MLP by a
routed mixture of 8 experts, 2 per token (`lm/moe.py`: `jaxquant.flax.GroupedDense` experts with
roles `("grouped_linear", ..., "fc1" | "fc2")`, a float32 router, a load-balancing loss); try it
with `--recipe moe_nvfp4_fwd_mxfp8_bwd`; `--mesh ep=4` (or `dp=2,ep=4`) shards the experts over
the `ep` axis and sends tokens to them with all-to-alls (`jaxquant.expert_parallel`).

Several processes (one per host, or per GPU): `--coordinator HOST:PORT --num-processes N
--process-id I` (or `$JAX_COORDINATOR_ADDRESS`, `$JAX_NUM_PROCESSES`, `$JAX_PROCESS_ID`) join
one run through `jax.distributed` (`lm/distributed.py`); `--mesh` then spans every process's
devices, each process loads only its rows of every batch, and process 0 alone logs and writes
the CSVs and the plot. Every process must be launched with the same settings (checked at
start), and `--checkpoint` must name the same directory for all (a shared filesystem across
hosts): each process saves and restores its own shards.

On GPUs the step overlaps its collectives with compute: unless `--no-xla-overlap`, the XLA flags
of `lm/xla_flags.py` (latency-hiding scheduler, collective pipelining across the scanned
layers, double-buffered layer loop, high-priority collective stream) are added to `XLA_FLAGS`
before the backend starts.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import time
from typing import Optional, Sequence

import jax
import jax.numpy as jnp

from jaxquant.expert_parallel import EXCHANGES as MOE_EXCHANGES

from lm import checkpoint, data, distributed, recipes, report, sharding, training, xla_flags
from lm.embedding import EMBEDDING_GRADIENTS
from lm.model import ATTENTIONS, GPT, LMConfig

DEFAULT_OUT = pathlib.Path(__file__).resolve().parent / "out"
DEFAULT_RECIPES = "bf16,fp8_current"  # the claim to see first: FP8 trains like bf16


def parse_mesh(spec: str) -> dict[str, int]:
  """`"dp=2,tp=4"` -> `{"dp": 2, "tp": 4}` (axis names and positive sizes)."""
  axes = {}
  for part in spec.split(","):
    name, sep, size = part.partition("=")
    if not sep or not name.strip() or not size.strip().isdigit() or int(size) < 1:
      raise argparse.ArgumentTypeError(f"--mesh {spec!r}: expected AXIS=SIZE[,AXIS=SIZE...] "
                                       "such as dp=2,tp=4")
    axes[name.strip()] = int(size)
  return axes


def parse_moe(spec: str) -> tuple[int, int]:
  """`"8,2"` -> `(experts, top_k)` with `1 <= top_k <= experts`."""
  try:
    experts, top_k = (int(v) for v in spec.split(","))
  except ValueError:
    raise argparse.ArgumentTypeError(
        f"--moe {spec!r}: expected EXPERTS,TOPK such as 8,2") from None
  if not 1 <= top_k <= experts:
    raise argparse.ArgumentTypeError(f"--moe {spec!r}: need 1 <= TOPK <= EXPERTS")
  return experts, top_k


def build_parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  p.add_argument("--recipe", default=DEFAULT_RECIPES,
                 help=f"'all', or comma-separated names ('-' or '_') from: "
                 f"{', '.join(recipes.available())}")
  p.add_argument("--steps", type=int, default=200, help="training steps per recipe")
  p.add_argument("--batch", type=int, default=16, help="sequences per step")
  p.add_argument("--seq", type=int, default=128, help="tokens (bytes) per sequence")
  p.add_argument("--d-model", type=int, default=128)
  p.add_argument("--layers", type=int, default=2)
  p.add_argument("--heads", type=int, default=4)
  p.add_argument("--mlp-ratio", type=int, default=4)
  p.add_argument("--positions", choices=("rope", "learned"), default="rope")
  p.add_argument("--tie-embeddings", action="store_true",
                 help="project to the vocabulary with the token embedding instead of lm_head")
  p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
  p.add_argument("--warmup", type=int, default=30, help="linear warmup steps")
  p.add_argument("--weight-decay", type=float, default=0.1)
  p.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw",
                 help="sgd: plain SGD on the same schedule, updates linear in the gradient (runs "
                 "compared across meshes or process counts stay as close as their gradients; "
                 "Adam turns reduction-order noise into full-size steps)")
  p.add_argument("--seed", type=int, default=0, help="parameters, batches and rounding keys")
  p.add_argument("--eval-every", type=int, default=50, help="steps between evaluations")
  p.add_argument("--eval-batches", type=int, default=4,
                 help="batches of fixed windows per split in each evaluation")
  p.add_argument("--data-mb", type=float, default=4.0,
                 help="cap on the corpus size read from the standard library (MB)")
  p.add_argument("--data-root", default=None,
                 help="read .py files from this directory instead of the standard library")
  p.add_argument("--out", type=pathlib.Path, default=DEFAULT_OUT,
                 help="directory for losses.csv and losses.png")
  p.add_argument("--explain", action="store_true",
                 help="print jaxquant.explain (quantizer and path per role) for one step")
  p.add_argument("--no-progress", action="store_true", help="no progress bar")
  p.add_argument("--backend", choices=training.BACKENDS, default=None,
                 help="jaxquant op implementation (JAXQUANT_BACKEND); default: $JAXQUANT_BACKEND, "
                 "else 'reference' on CPU (faster there than the FFI's CPU handlers), "
                 "'auto' on GPU")
  p.add_argument("--mesh", type=parse_mesh, default=None,
                 help="device mesh such as dp=2,tp=4, fsdp=2 or ep=4 (axes dp, fsdp, tp, ep): "
                 "data, fully-sharded data, tensor and (with --moe) expert parallelism")
  p.add_argument("--moe", type=parse_moe, default=None,
                 help="EXPERTS,TOPK: a mixture-of-experts MLP (GroupedDense experts, top-k "
                 "routing) in every block instead of the dense MLP")
  p.add_argument("--moe-aux-weight", type=float, default=0.01,
                 help="weight of the MoE load-balancing loss")
  p.add_argument("--moe-capacity", type=float, default=None,
                 help="with --mesh ep=N: capacity factor of the expert all-to-all buffers "
                 "(assignments past it are dropped); default: dropless")
  p.add_argument("--moe-exchange", choices=MOE_EXCHANGES, default="auto",
                 help="with --mesh ep=N: how rows reach their experts: ragged_all_to_all of the "
                 "real rows (dropless, GPU), fixed-size all_to_all buffers, or auto (fixed-size: "
                 "XLA's ragged all-to-all measured slower; jaxquant.explain says which ran)")
  p.add_argument("--remat", action="store_true",
                 help="recompute each block's activations in the backward pass (large models); "
                 "the quantized weights are kept (jaxquant.remat_policy): each weight is "
                 "quantized once per step")
  p.add_argument("--grad-accum", type=int, default=1, metavar="N",
                 help="split each batch into N micro-batches and sum their gradients; each "
                 "weight is quantized once per step (jaxquant.flax.quantize_weights)")
  p.add_argument("--embedding-gradient", choices=EMBEDDING_GRADIENTS, default="auto",
                 help="token embedding gradient: a one-hot GEMM ('auto' up to 4096 ids), a "
                      "float32 scatter-add ('auto' above), or nn.Embed's bfloat16 scatter-add "
                      "('scatter': slow on GPUs where ids repeat)")
  p.add_argument("--scan-layers", action="store_true",
                 help="one nn.scan over the blocks (compile time independent of --layers)")
  p.add_argument("--attention", choices=ATTENTIONS, default="xla",
                 help="attention core: written in jnp ('xla', float32 scores materialized) or "
                      "cuDNN's fused flash attention ('cudnn', GPUs only)")
  p.add_argument("--checkpoint", type=pathlib.Path, default=None, metavar="DIR",
                 help="save each recipe's run to DIR/<recipe> with orbax, and resume from the "
                 "latest checkpoint there (same settings) when it exists")
  p.add_argument("--checkpoint-every", type=int, default=50,
                 help="steps between checkpoints (and one at the last step)")
  p.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                 help="several processes: process 0's address (it runs jax.distributed's "
                 "coordinator there), the same for every process; default "
                 f"${distributed.ENV['coordinator']}")
  p.add_argument("--num-processes", type=int, default=None,
                 help="several processes: how many take part in the run; default "
                 f"${distributed.ENV['num_processes']}, else 1")
  p.add_argument("--process-id", type=int, default=None,
                 help="several processes: this one's id, 0 ... N-1; default "
                 f"${distributed.ENV['process_id']}")
  p.add_argument("--init-timeout", type=float, default=distributed.DEFAULT_INIT_TIMEOUT,
                 help="several processes: seconds to wait for all of them to reach the "
                 "coordinator before failing")
  p.add_argument("--no-xla-overlap", action="store_true",
                 help="leave XLA_FLAGS alone; by default the flags of lm/xla_flags.py (async "
                 "collectives overlapped with compute: latency-hiding scheduler, collective "
                 "pipelining over the scanned layers) are added before the GPU backend starts")
  return p


def main(argv: Optional[Sequence[str]] = None) -> dict:
  """Train every requested recipe; returns `{"histories", "csv", "steps_csv", "png", "summary",
  "gaps"}` (no files, None, from processes other than process 0)."""
  parser = build_parser()
  args = parser.parse_args(argv)
  try:
    names = recipes.parse(args.recipe)
  except ValueError as err:
    parser.error(str(err))
  if min(args.steps, args.batch, args.seq, args.eval_every, args.eval_batches,
         args.checkpoint_every, args.grad_accum) < 1:
    parser.error("--steps, --batch, --seq, --eval-every, --eval-batches, "
                 "--checkpoint-every and --grad-accum must be >= 1")
  if args.batch % args.grad_accum:
    parser.error(f"--grad-accum {args.grad_accum} must divide --batch {args.batch}")
  try:
    launch = distributed.resolve_launch(args.coordinator, args.num_processes, args.process_id,
                                        args.init_timeout)
  except ValueError as err:
    parser.error(str(err))
  previous = os.environ.get("XLA_FLAGS")
  # Read when the backend starts (the first device query below); no effect once it runs.
  xla_flags.apply_overlap_flags(not args.no_xla_overlap)
  try:
    try:
      distributed.initialize(launch)  # before the backend starts
    except ValueError as err:
      parser.error(str(err))
    with training.jaxquant_backend(args.backend or training.default_backend()):
      return run(args, names, launch)
  finally:
    if previous is None:
      os.environ.pop("XLA_FLAGS", None)
    else:
      os.environ["XLA_FLAGS"] = previous


def run(args: argparse.Namespace, names: Sequence[str],
        launch: Optional[distributed.Launch] = None) -> dict:
  """Load the corpus, train each recipe in turn, write the CSVs and plot, print the summary
  (process 0 alone logs and writes; the others return their histories, no files)."""
  launch = launch or distributed.Launch()
  primary = distributed.is_primary()
  say = print if primary else _silent
  corpus = data.load_corpus(int(args.data_mb * 1e6), root=args.data_root)
  distributed.check_same_settings(shared_settings(args, launch, corpus))
  config = LMConfig(seq=args.seq, d_model=args.d_model, layers=args.layers, heads=args.heads,
                    mlp_ratio=args.mlp_ratio, positions=args.positions,
                    tie_embeddings=args.tie_embeddings, dtype=jnp.bfloat16, moe=args.moe,
                    moe_aux_weight=args.moe_aux_weight,
                    moe_capacity=args.moe_capacity, moe_exchange=args.moe_exchange,
                    remat=args.remat, scan_layers=args.scan_layers,
                    embedding_gradient=args.embedding_gradient, attention=args.attention)
  train_cfg = training.TrainConfig(steps=args.steps, lr=args.lr, warmup=args.warmup,
                                   weight_decay=args.weight_decay, eval_every=args.eval_every,
                                   seed=args.seed, progress=primary and not args.no_progress,
                                   optimizer=args.optimizer, grad_accum=args.grad_accum)
  say(corpus.describe())
  say(f"model: d_model={config.d_model} layers={config.layers} heads={config.heads} "
        f"mlp_ratio={config.mlp_ratio} positions={config.positions} seq={config.seq}"
        f"{'' if config.moe is None else ' moe=%d experts, top-%d' % config.moe}; "
        f"batch={args.batch} steps={args.steps} lr={args.lr}; jax {jax.__version__} on "
        f"{jax.devices()[0].platform} (JAXQUANT_BACKEND={os.environ['JAXQUANT_BACKEND']}); "
        f"recipes: {', '.join(names)}")

  mesh = None
  if args.mesh is None and launch.multi_process:
    raise ValueError(f"--mesh: a run of {launch.num_processes} processes needs a mesh over "
                     f"all {jax.device_count()} devices, such as --mesh dp={jax.device_count()}")
  if args.mesh is not None:
    mesh = sharding.make_mesh(args.mesh)
    sharding.check_batch(mesh, args.batch)
    say(f"mesh: {dict(mesh.shape)} over {mesh.devices.size} {jax.devices()[0].platform} "
        f"devices ({jax.process_count()} process{'es' if jax.process_count() > 1 else ''}); "
        f"batch over {sharding.batch_axes(mesh)}")
  rows = sharding.process_rows(mesh, args.batch)  # None: all rows (one process)
  eval_sets = {split: data.fixed_batches(stream, args.batch, args.seq, args.eval_batches, rows)
               for split, stream in (("train", corpus.train), ("val", corpus.val))}
  histories = []
  for name in names:
    model = GPT(config, recipes.make(name))
    batches = data.random_batches(corpus.train, args.batch, args.seq, seed=args.seed, rows=rows)
    first = sharding.put_batches(mesh, next(batches))
    with sharding.active(mesh):
      state = training.create_state(model, first, train_cfg, mesh)
    if name == names[0]:
      n_params = sum(x.size for x in jax.tree.leaves(state.params["params"]))
      say(f"parameters: {n_params / 1e6:.2f} M")
    if args.explain:
      say(f"\njaxquant.explain, one training step under {name}:")
      with sharding.active(mesh):
        say(training.condense(training.explain_step(model, state, first)), "\n")
    checkpointer = resumed = None
    if args.checkpoint is not None:
      checkpointer = checkpoint.Checkpointer(args.checkpoint / name, args.checkpoint_every,
                                             run_settings(args, name))
      with sharding.active(mesh):
        resumed = checkpointer.restore(state, name)
      if resumed is not None:
        state = resumed.state
    batches = data.random_batches(corpus.train, args.batch, args.seq, seed=args.seed,
                                  skip=resumed.batches_consumed if resumed else 0, rows=rows)
    try:
      with sharding.active(mesh):
        histories.append(training.train(name, model, train_cfg, batches, eval_sets, state,
                                        log=training.tqdm.write if primary else _silent,
                                        mesh=mesh,
                                        history=resumed.history if resumed else None,
                                        checkpointer=checkpointer))
    finally:
      if checkpointer is not None:
        checkpointer.close()

  summary = report.summary_table(histories)
  gaps = report.final_gaps(histories)
  csv_path = steps_path = png_path = None
  if primary:
    csv_path = report.write_csv(args.out / "losses.csv", histories)
    steps_path = report.write_steps_csv(args.out / "steps.csv", histories)
    title = (f"byte-level GPT d={config.d_model} L={config.layers} seq={config.seq} "
             f"batch={args.batch} on stdlib .py")
    png_path = report.plot(args.out / "losses.png", histories, title)
    say(f"\n{summary}\n" + "".join(f"\n{line}" for line in gaps)
        + f"\n\nwrote {csv_path}, {steps_path} and {png_path}")
  return {"histories": histories, "csv": csv_path, "steps_csv": steps_path, "png": png_path,
          "summary": summary, "gaps": gaps}


def _silent(*args, **kwargs) -> None:
  """Where processes other than process 0 send what process 0 prints."""


def shared_settings(args: argparse.Namespace, launch: distributed.Launch,
                    corpus: data.Corpus) -> dict:
  """What every process of a run must agree on: each flag but those naming this process's own
  id, output folder and timeouts, the launch as resolved from flags or environment, the corpus
  bytes and JAX's version."""
  own = ("process_id", "out", "no_progress", "explain", "init_timeout", "coordinator",
         "num_processes")
  settings = {"--" + k.replace("_", "-"): v for k, v in vars(args).items() if k not in own}
  settings.update({"--coordinator": launch.coordinator, "--num-processes": launch.num_processes,
                   "corpus (--data-root, --data-mb)": corpus.digest(),
                   "jax version": jax.__version__})
  return settings


def run_settings(args: argparse.Namespace, recipe: str) -> dict:
  """What a checkpoint must have been written under to be resumed (JSON-safe): everything
  that changes the model, the batches or the optimizer's schedule."""
  keep = ("steps", "batch", "seq", "d_model", "layers", "heads", "mlp_ratio", "positions",
          "tie_embeddings", "lr", "warmup", "weight_decay", "optimizer", "seed", "data_mb",
          "data_root", "moe", "moe_aux_weight", "scan_layers")
  settings = {k: getattr(args, k) for k in keep}
  settings["moe"] = list(settings["moe"]) if settings["moe"] is not None else None
  return {"recipe": recipe, **settings}


if __name__ == "__main__":
  start = time.perf_counter()
  try:
    with distributed.exit_on_error():  # several processes: no waiting on peers after an error
      main()
  except NotImplementedError as err:
    sys.exit(f"train_lm.py: {err}")
  if distributed.is_primary():
    print(f"total wall time {time.perf_counter() - start:.1f}s")
