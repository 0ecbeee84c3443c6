"""Training one model under one recipe: optimizer, jitted train/eval steps and the loop.

The state is a `flax.training.train_state.TrainState` whose `params` is the *full* variables
dict, so delayed-scaling state (collection `"_overwrite_with_gradient"`) comes back through the
gradient and `apply_gradients` stores it; the optimizer only sees `variables["params"]`.
Stochastic rounding (NVFP4) draws from the `"quantize"` RNG stream, a fresh key every step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import time
from typing import Any, Callable, Iterator, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.training.train_state import TrainState
from tqdm.auto import tqdm

import jaxquant


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  steps: int = 250
  lr: float = 3e-3
  warmup: int = 30
  weight_decay: float = 0.1
  clip_norm: float = 1.0
  eval_every: int = 50
  seed: int = 0
  progress: bool = True
  optimizer: str = "adamw"  # or "sgd": updates linear in the gradient (bench/scaling.py's check)
  grad_accum: int = 1  # micro-batches per step (gradients summed, each weight quantized once)


@dataclasses.dataclass
class History:
  """What one run produced: eval points and per-step timings."""

  recipe: str
  rows: list[dict] = dataclasses.field(default_factory=list)  # step, train/val loss, time
  step_times: list[float] = dataclasses.field(default_factory=list)  # seconds, step 1 first
  step_losses: list[float] = dataclasses.field(default_factory=list)  # loss of each train step
  compile_time: float = 0.0  # seconds of the first train step (jit compile included)

  @property
  def final_val_loss(self) -> float:
    return self.rows[-1]["val_loss"]

  @property
  def steady_step_time(self) -> float:
    """Median step time after the first (compiling) step."""
    times = self.step_times[1:] or self.step_times
    return float(np.median(times)) if times else float("nan")


BACKENDS = ("auto", "reference", "ffi")


def default_backend() -> str:
  """`$JAXQUANT_BACKEND` if set; else "reference" on CPU, "auto" elsewhere.

  On CPU the pure-JAX reference fuses into XLA's compiled step and is several times faster than
  the FFI's CPU handlers (they exist so CI exercises the FFI path, not for speed).
  """
  env = os.environ.get("JAXQUANT_BACKEND", "").strip().lower()
  if env:
    return env
  return "reference" if jax.default_backend() == "cpu" else "auto"


@contextlib.contextmanager
def jaxquant_backend(backend: str) -> Iterator[str]:
  """Set `JAXQUANT_BACKEND` (read by jaxquant whenever an op is traced) for this block."""
  if backend not in BACKENDS:
    raise ValueError(f"backend={backend!r}; expected one of {BACKENDS}")
  previous = os.environ.get("JAXQUANT_BACKEND")
  os.environ["JAXQUANT_BACKEND"] = backend
  try:
    yield backend
  finally:
    if previous is None:
      os.environ.pop("JAXQUANT_BACKEND", None)
    else:
      os.environ["JAXQUANT_BACKEND"] = previous


def make_optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
  """AdamW with linear warmup and cosine decay to 10%, gradient clipping, no decay on 1-D params.

  `cfg.optimizer="sgd"`: plain SGD on the same schedule. Adam divides each gradient element by
  its own running RMS, so in its first steps an element whose gradient is reduction-order noise
  gets a full-size step of either sign; SGD keeps such differences as small as the gradients'.
  """
  schedule = optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=cfg.lr, warmup_steps=min(cfg.warmup, max(cfg.steps - 1, 1)),
      decay_steps=max(cfg.steps, 2), end_value=cfg.lr * 0.1)
  decay_mask = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)
  if cfg.optimizer == "sgd":
    return optax.chain(optax.clip_by_global_norm(cfg.clip_norm), optax.sgd(schedule))
  if cfg.optimizer != "adamw":
    raise ValueError(f"optimizer={cfg.optimizer!r}; expected 'adamw' or 'sgd'")
  return optax.chain(optax.clip_by_global_norm(cfg.clip_norm),
                     optax.adamw(schedule, b2=0.95, weight_decay=cfg.weight_decay,
                                 mask=decay_mask))


def next_token_loss(model: nn.Module, variables, tokens: jax.Array, key: jax.Array) -> jax.Array:
  """Mean cross-entropy of predicting `tokens[:, 1:]` from `tokens[:, :-1]`."""
  logits = model.apply(variables, tokens[:, :-1], rngs={"quantize": key})
  return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


def create_state(model: nn.Module, tokens: np.ndarray, cfg: TrainConfig,
                 mesh=None) -> TrainState:
  """Initialize parameters (and any quantizer state) from `cfg.seed`; same params per recipe.

  With a `mesh` (inside `lm.sharding.active(mesh)`) the state is created sharded: parameters
  and optimizer moments by their logical axis names, the rest replicated."""
  init_keys = {"params": jax.random.key(cfg.seed), "quantize": jax.random.key(cfg.seed + 1)}
  tokens = jnp.asarray(tokens[:, :-1])
  if mesh is None:
    variables = nn.meta.unbox(jax.jit(model.init)(init_keys, tokens))  # eager init is slow
    return TrainState.create(apply_fn=model.apply, params=dict(variables),
                             tx=make_optimizer(cfg))

  def init(tokens):
    variables = model.init(init_keys, tokens)
    return TrainState.create(apply_fn=model.apply, params=dict(variables),
                             tx=make_optimizer(cfg))

  from lm import sharding  # noqa: PLC0415 - only --mesh needs it
  shardings = sharding.state_shardings(jax.eval_shape(init, tokens), mesh)
  return nn.meta.unbox(jax.jit(init, out_shardings=shardings)(tokens))


def accumulated_value_and_grad(model: nn.Module, variables, tokens: jax.Array, key: jax.Array,
                               micro_batches: int):
  """(loss, gradients) of `next_token_loss` over `tokens`, from `micro_batches` equal
  micro-batches: the mean of their losses and gradients (the full batch's, up to float32
  summation order, where the quantization of one sequence does not depend on the others).

  Each weight is quantized once for all micro-batches (`jaxquant.flax.quantize_weights`, as
  TransformerEngine caches weights on the first micro-batch), which also advances each
  weight's delayed-scaling state once; the input and gradient states advance micro-batch by
  micro-batch, as separate steps would. Micro-batch `i` takes rows `i, i + n, ...`, so under
  data parallelism every device works on each micro-batch. Its quantize key is
  `fold_in(key, i)`.
  """
  batch = tokens.shape[0]
  if batch % micro_batches:
    raise ValueError(f"grad_accum={micro_batches} must divide the batch size {batch}")
  micro = jnp.swapaxes(tokens.reshape(batch // micro_batches, micro_batches,
                                      *tokens.shape[1:]), 0, 1)
  overwrite = jaxquant.flax.OVERWRITE_WITH_GRADIENT
  weights = jaxquant.flax.quantize_weights(model.apply, variables, micro[0, :, :-1],
                                           rngs={"quantize": key})

  def micro_step(carry, xs):
    grad_sum, loss_sum, scaling_state = carry
    tokens_i, i = xs
    current = dict(variables)
    if scaling_state is not None:
      current[overwrite] = scaling_state
    loss, grads = jax.value_and_grad(
        lambda v: next_token_loss(model, {**v, **weights}, tokens_i,
                                  jax.random.fold_in(key, i)))(current)
    grad_sum = jax.tree_util.tree_map(jnp.add, grad_sum, grads["params"])
    return (grad_sum, loss_sum + loss, grads.get(overwrite)), None

  zeros = jax.tree_util.tree_map(jnp.zeros_like, variables["params"])
  (grad_sum, loss_sum, scaling_state), _ = jax.lax.scan(
      micro_step, (zeros, jnp.float32(0.0), variables.get(overwrite)),
      (micro, jnp.arange(micro_batches)))
  grads = {"params": jax.tree_util.tree_map(lambda g: g / micro_batches, grad_sum)}
  if scaling_state is not None:
    grads[overwrite] = scaling_state
  return loss_sum / micro_batches, grads


def make_steps(model: nn.Module, state: Optional[TrainState] = None, grad_accum: int = 1,
               step_keys: bool = False) -> tuple[Callable, Callable]:
  """`(train_step, eval_loss)`, both jitted.

  train_step(state, tokens, key) -> (state, loss); eval_loss(variables, batches, key) -> loss
  averaged over `batches[num, batch, seq + 1]`. Given the (sharded) initial `state`, the new
  state keeps its shardings: otherwise XLA may pick others for the outputs (a replicated
  LayerNorm scale comes back sharded over `fsdp`, say), and the next call, compiled for the
  first state's, rejects them. With `grad_accum > 1` the step sums the gradients of that many
  micro-batches (`accumulated_value_and_grad`). The state is donated: its buffers become the
  new state's, without a copy. With `step_keys`, `key` is the run's base key and the step's
  own is `fold_in(key, state.step + 1)`, derived on the device (not by an eager op per step).
  """
  if grad_accum < 1:
    raise ValueError(f"grad_accum={grad_accum}; expected a positive number of micro-batches")
  loss_fn = lambda variables, tokens, key: next_token_loss(model, variables, tokens, key)
  out_shardings = None
  if state is not None:
    out_shardings = (jax.tree_util.tree_map(lambda a: a.sharding, state), None)

  @functools.partial(jax.jit, out_shardings=out_shardings, donate_argnums=(0,))
  def train_step(state: TrainState, tokens: jax.Array, key: jax.Array):
    if step_keys:
      key = jax.random.fold_in(key, state.step + 1)
    if grad_accum == 1:
      loss, grads = jax.value_and_grad(loss_fn)(state.params, tokens, key)
    else:
      loss, grads = accumulated_value_and_grad(model, state.params, tokens, key, grad_accum)
    return state.apply_gradients(grads=grads), loss

  @jax.jit
  def eval_loss(variables, batches: jax.Array, key: jax.Array) -> jax.Array:
    return jax.lax.map(lambda tokens: loss_fn(variables, tokens, key), batches).mean()

  return train_step, eval_loss


def explain_step(model: nn.Module, state: TrainState, tokens: np.ndarray) -> jaxquant.Report:
  """Every quantize/GEMM decision of one forward + backward step (traced, not run)."""
  grad_fn = jax.value_and_grad(lambda v, t, k: next_token_loss(model, v, t, k))
  return jaxquant.explain(grad_fn, state.params, jnp.asarray(tokens), jax.random.key(0))


def condense(report: jaxquant.Report) -> str:
  """`str(report)` with repeated lines (the same role in several blocks) folded into one."""
  counts: dict[str, int] = {}
  for decision in report:
    line = str(decision)
    counts[line] = counts.get(line, 0) + 1
  if not counts:
    return str(report)
  return "\n".join(line + (f"   [x{n}]" if n > 1 else "") for line, n in counts.items())


def train(recipe_name: str, model: nn.Module, cfg: TrainConfig, batches: Iterator[np.ndarray],
          eval_sets: dict[str, np.ndarray], state: TrainState,
          log: Callable[[str], None] = print, mesh=None, history: Optional[History] = None,
          checkpointer: Any = None) -> History:
  """Run steps `state.step + 1 ... cfg.steps`, evaluating at step 0, every `cfg.eval_every`
  steps and at the end.

  Args:
    recipe_name: label of the run.
    model: the Flax model (its recipe is already set).
    cfg: training hyperparameters.
    batches: iterator of `[batch, seq + 1]` int32 training windows (with several processes,
      this process's rows of each: `lm.sharding.process_rows`).
    eval_sets: `{"train": ..., "val": ...}` fixed `[num, batch, seq + 1]` evaluation windows
      (this process's rows, likewise).
    state: initial `TrainState` (from `create_state`).
    log: where eval lines go (tqdm-safe by default).
    mesh: with --mesh, the mesh the batches are sharded over (trace inside
      `lm.sharding.active(mesh)`).
    history: a resumed run's history up to `state.step` (None: a new run, from step 0).
    checkpointer: an `lm.checkpoint.Checkpointer` saving the run every few steps, or None.
      `batches` must then start at the checkpoint's data position (batch `state.step + 1`).
  """
  from lm.sharding import put_batches  # noqa: PLC0415
  train_step, eval_loss = make_steps(model, state if mesh is not None else None,
                                     grad_accum=cfg.grad_accum, step_keys=True)
  eval_key = jax.random.key(cfg.seed + 2)
  eval_arrays = {split: put_batches(mesh, b, leading=1) for split, b in eval_sets.items()}
  first_step = int(state.step)
  resumed = history is not None
  history = history if resumed else History(recipe_name)
  start = time.perf_counter() - (history.rows[-1]["time"] if history.rows else 0.0)

  def evaluate(step: int) -> None:
    losses = {f"{split}_loss": float(eval_loss(state.params, b, eval_key))
              for split, b in eval_arrays.items()}
    row = {"step": step, "recipe": recipe_name, **losses,
           "time": time.perf_counter() - start}
    history.rows.append(row)
    log(f"[{recipe_name}] step {step:5d}  train {row['train_loss']:.4f}  "
        f"val {row['val_loss']:.4f}  ({row['time']:.1f}s)")

  if not resumed:
    evaluate(0)
  else:
    log(f"[{recipe_name}] resumed at step {first_step} of {cfg.steps}")
  base_key = jax.random.key(cfg.seed + 3)
  bar = tqdm(range(first_step + 1, cfg.steps + 1), desc=recipe_name, disable=not cfg.progress,
             dynamic_ncols=True, leave=False, mininterval=0.5, initial=first_step,
             total=cfg.steps)
  # The loss of a step is read after the next step is dispatched, so the device always has a
  # step queued while the host waits (reading it at once left the device idle for the host's
  # dispatch of every step). Step times are the intervals between finished steps.
  pending: Optional[tuple[int, jax.Array]] = None
  last_done = time.perf_counter()

  def finish(step: int, loss: jax.Array) -> None:
    nonlocal last_done
    loss = float(loss)  # waits for that step
    now = time.perf_counter()
    history.step_times.append(now - last_done)
    last_done = now
    history.step_losses.append(loss)
    if not np.isfinite(loss):
      raise FloatingPointError(f"[{recipe_name}] loss is {loss} at step {step}")
    bar.set_postfix(loss=f"{loss:.3f}", refresh=False)

  for step in bar:
    tokens = next(batches)
    state, loss = train_step(state, put_batches(mesh, tokens), base_key)
    if pending is not None:
      finish(*pending)
    pending = (step, loss)
    due = checkpointer is not None and checkpointer.due(step, cfg.steps)
    if step % cfg.eval_every == 0 or step == cfg.steps or due:
      finish(*pending)
      pending = None
    if step % cfg.eval_every == 0 or step == cfg.steps:
      evaluate(step)
    if due:
      history.compile_time = history.step_times[0]
      checkpointer.save(state, history, batches_consumed=step)
    if pending is None:  # evaluated or saved: the next step's time starts now
      last_done = time.perf_counter()
  if pending is not None:
    finish(*pending)
  bar.close()
  history.compile_time = history.step_times[0] if history.step_times else 0.0
  return history
