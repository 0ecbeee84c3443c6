"""`examples/train_lm.py --checkpoint DIR`: a run stopped mid-way and resumed from its latest
orbax checkpoint continues exactly as if it had never stopped.

The interruption is a pre-emption: the training batch stream raises after a few batches, so the
step in flight is lost and the run resumes from the last checkpoint before it. On CPU the resumed
run's per-step losses, eval losses and final variables (parameters and delayed-scaling state) and
optimizer state must equal an uninterrupted run's bit for bit — which holds only if parameters,
optimizer state, delayed-scaling state, step and data position all came back. Tiny models, four
steps, one checkpoint every two.
"""

from __future__ import annotations

import importlib
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax.training.train_state import TrainState

TINY_LM = ["--d-model", "32", "--layers", "1", "--heads", "2", "--seq", "32", "--batch", "8",
           "--data-mb", "0.3", "--eval-batches", "1", "--no-progress", "--steps", "4",
           "--eval-every", "2", "--checkpoint-every", "2", "--lr", "1e-2", "--warmup", "1"]
# Delayed scaling keeps scale and amax history in the "_overwrite_with_gradient" collection,
# per Dense and per expert of a GroupedDense. The MoE model has both (its attention projections
# are Dense layers); a dense-MLP model added nothing it lacks and ~2 CPU-minutes to the suite.
# On the FFI kernels' CPU handlers (`--backend auto`, as test_multiprocess.py): the three runs'
# MoE steps compile in a third of the reference path's time (~1 CPU-minute less); what resumes
# (parameters, optimizer and scaling state, step, data position) does not depend on the backend.
MODELS = {"moe": ["--recipe", "fp8_delayed", "--moe", "4,2", "--backend", "auto"]}
STATE = "_overwrite_with_gradient"


class Preempted(Exception):
  """Stands for the job being killed between two steps."""


def _example(name: str):
  """An example module (`train_lm`, `lm.data`, ...): pytest puts examples/ on the path
  (pyproject.toml, `pythonpath`)."""
  return importlib.import_module(name)


class _BatchSpy:
  """Wraps `lm.data.random_batches`: records each stream's `skip` and how many batches it gave,
  and raises `Preempted` instead of a stream's batch number `fail_at` (1-based) if set."""

  def __init__(self, random_batches, fail_at=None):
    self.random_batches, self.fail_at, self.streams = random_batches, fail_at, []

  def __call__(self, *args, skip=0, **kwargs):
    record = {"skip": skip, "yielded": 0}
    self.streams.append(record)
    for batch in self.random_batches(*args, skip=skip, **kwargs):
      if self.fail_at is not None and record["yielded"] + 1 == self.fail_at:
        raise Preempted(f"killed before batch {self.fail_at}")
      record["yielded"] += 1
      yield batch


def _final_checkpoint(directory: pathlib.Path, step: int) -> dict:
  with ocp.CheckpointManager(directory) as manager:
    assert manager.latest_step() == step
    return manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore()))[
        "state"]


def _assert_bitwise_equal(got, want):
  got_leaves, got_tree = jax.tree.flatten_with_path(got)
  want_leaves, want_tree = jax.tree.flatten_with_path(want)
  assert [p for p, _ in got_leaves] == [p for p, _ in want_leaves]
  for (path, g), (_, w) in zip(got_leaves, want_leaves):
    g, w = np.asarray(g), np.asarray(w)
    assert g.dtype == w.dtype and g.shape == w.shape, jax.tree_util.keystr(path)
    assert g.tobytes() == w.tobytes(), f"{jax.tree_util.keystr(path)} differs"


@pytest.mark.parametrize("model", list(MODELS))
def test_resumed_run_equals_the_uninterrupted_run_bit_for_bit(tmp_path, seed, monkeypatch, model):
  train_lm, data = _example("train_lm"), _example("lm.data")
  random_batches = data.random_batches
  args = [*MODELS[model], "--seed", str(seed % 10_000), *TINY_LM]
  whole = train_lm.main([*args, "--checkpoint", str(tmp_path / "whole"),
                         "--out", str(tmp_path / "out")])["histories"][0]

  # Killed before the 3rd training batch: step 3 never finishes, the latest checkpoint is step 2.
  spy = _BatchSpy(random_batches, fail_at=3)
  monkeypatch.setattr(data, "random_batches", spy)
  with pytest.raises(Preempted):
    train_lm.main([*args, "--checkpoint", str(tmp_path / "broken"), "--out",
                   str(tmp_path / "out")])
  spy = _BatchSpy(random_batches)
  monkeypatch.setattr(data, "random_batches", spy)
  resumed = train_lm.main([*args, "--checkpoint", str(tmp_path / "broken"),
                           "--out", str(tmp_path / "out")])["histories"][0]

  # The resumed invocation trained steps 3 and 4 only, from data position 2.
  training_stream = spy.streams[-1]
  assert training_stream == {"skip": 2, "yielded": 2}, spy.streams
  assert len(whole.step_losses) == len(resumed.step_losses) == 4
  assert resumed.step_losses == whole.step_losses  # float equality: bit for bit
  assert [(r["step"], r["train_loss"], r["val_loss"]) for r in resumed.rows] == [
      (r["step"], r["train_loss"], r["val_loss"]) for r in whole.rows]
  got = _final_checkpoint(tmp_path / "broken" / "fp8_delayed", 4)
  want = _final_checkpoint(tmp_path / "whole" / "fp8_delayed", 4)
  _assert_bitwise_equal(got, want)
  histories = [leaf for path, leaf in jax.tree.flatten_with_path(want["params"][STATE])[0]
               if "amax_history" in jax.tree_util.keystr(path)]
  assert histories and all(np.any(np.asarray(h) > 0) for h in histories)  # the state is live
  if model == "moe":  # one history per expert: leading axis 4
    assert any(np.asarray(h).shape[0] == 4 for h in histories)


def test_a_checkpoint_of_other_settings_is_refused(tmp_path, rng):
  checkpoint, training = _example("lm.checkpoint"), _example("lm.training")
  params = {"params": {"w": jnp.asarray(rng.normal(size=(3, 2)), jnp.float32)}}
  state = TrainState.create(apply_fn=None, params=params, tx=optax.adam(1e-3))
  saver = checkpoint.Checkpointer(tmp_path, every=1, settings={"recipe": "bf16", "lr": 0.01})
  saver.save(state, training.History("bf16"), batches_consumed=0)
  saver.close()
  restored = checkpoint.Checkpointer(tmp_path, 1, {"recipe": "bf16", "lr": 0.01}).restore(
      state, "bf16")
  _assert_bitwise_equal(restored.state.params, params)
  other = checkpoint.Checkpointer(tmp_path, every=1, settings={"recipe": "bf16", "lr": 0.02})
  with pytest.raises(ValueError, match=r"other settings .*'lr': \(0\.01, 0\.02\)"):
    other.restore(state, "bf16")
