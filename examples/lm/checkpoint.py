"""`--checkpoint DIR`: save and resume a training run with orbax.

One orbax `CheckpointManager` per recipe, in `DIR/<recipe>/`. A checkpoint holds
- `state`: the `TrainState`'s step, its variables (`params` and the delayed-scaling `scale` /
  `amax_history` of the `"_overwrite_with_gradient"` collection, Dense and GroupedDense alike)
  and the optimizer state, saved as arrays (orbax `StandardSave`);
- `progress`: the data position (training batches consumed), the run's settings that must not
  change across a resume, and the history so far (eval rows, per-step losses and times), as JSON.

With several processes (`lm/distributed.py`) every process saves and restores together: each
writes and reads the shards its devices hold (orbax's multi-process save), process 0 the JSON;
the directory must be the same path on every host (a shared filesystem).

Batches come from a seeded stream and each step's rounding key is `fold_in(key, step)`, so a
run resumed from step `s` sees exactly the batches and keys steps `s+1...` would have seen: on
CPU its losses equal an uninterrupted run's bit for bit (tests/test_checkpoint.py; with two
processes, tests/test_multiprocess.py).
"""

from __future__ import annotations

import dataclasses
import pathlib
from typing import Any, Optional

import jax
import orbax.checkpoint as ocp
from flax.training.train_state import TrainState

from .training import History


@dataclasses.dataclass
class Restored:
  """A run's state at its latest checkpoint."""

  state: TrainState
  history: History
  batches_consumed: int

  @property
  def step(self) -> int:
    return int(self.state.step)


class Checkpointer:
  """Saves one recipe's run every `every` steps (and at its last step) and restores it.

  Args:
    directory: this recipe's folder (created if missing).
    every: steps between checkpoints.
    settings: what must match for a resume to continue the same run (recipe, model and data
      settings, total steps); a checkpoint written under other settings is refused.
    keep: how many checkpoints to keep (the latest ones).
  """

  def __init__(self, directory: pathlib.Path, every: int, settings: dict[str, Any],
               keep: int = 2):
    if every < 1:
      raise ValueError(f"every={every}: expected a positive number of steps")
    self.directory = pathlib.Path(directory).resolve()
    self.every = every
    self.settings = settings
    options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True,
                                           enable_async_checkpointing=False)
    self._manager = ocp.CheckpointManager(self.directory, options=options)

  def due(self, step: int, last_step: int) -> bool:
    return step % self.every == 0 or step == last_step

  def save(self, state: TrainState, history: History, batches_consumed: int) -> None:
    """Write the checkpoint of `state.step` (blocking: the files exist when this returns)."""
    step = int(state.step)
    progress = {"batches_consumed": batches_consumed, "settings": self.settings,
                "rows": history.rows, "step_losses": history.step_losses,
                "step_times": history.step_times, "compile_time": history.compile_time}
    self._manager.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(_arrays(state)), progress=ocp.args.JsonSave(progress)))
    self._manager.wait_until_finished()

  def restore(self, template: TrainState, recipe: str) -> Optional[Restored]:
    """The latest checkpoint restored into `template`'s structure, dtypes and shardings; None
    when the folder holds none."""
    step = self._manager.latest_step()
    if step is None:
      return None
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, _arrays(template))
    got = self._manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract), progress=ocp.args.JsonRestore()))
    progress = got["progress"]
    if progress["settings"] != self.settings:
      changed = {k: (progress["settings"].get(k), v) for k, v in self.settings.items()
                 if progress["settings"].get(k) != v}
      raise ValueError(f"--checkpoint {self.directory}: the checkpoint at step {step} was "
                       f"written by a run with other settings (saved, now): {changed}; "
                       "resume with the same settings or use another directory")
    arrays = got["state"]
    state = template.replace(step=arrays["step"], params=arrays["params"],
                             opt_state=arrays["opt_state"])
    history = History(recipe, rows=progress["rows"], step_losses=progress["step_losses"],
                      step_times=progress["step_times"], compile_time=progress["compile_time"])
    return Restored(state, history, int(progress["batches_consumed"]))

  def close(self) -> None:
    self._manager.close()


def _arrays(state: TrainState) -> dict[str, Any]:
  """The arrays of a `TrainState` (its functions `apply_fn` and `tx` are not saved)."""
  return {"step": state.step, "params": state.params, "opt_state": state.opt_state}
