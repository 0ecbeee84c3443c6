"""`bench/embed_grad.py`'s candidates compute the same embedding-table gradient: each against
float64 sums of the same bfloat16 `dy` on fresh skewed ids (rows repeat, as tokens do). The
float32 forms within (count + 1) 2^-24 sum|dy| of each row's float64 sum; Flax's (a bfloat16
scatter-add) within count 2^-8 sum|dy| (each add rounds to bfloat16)."""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
VOCAB, D = 64, 16


def _embed_grad():
  for folder in (str(ROOT / "examples"), str(ROOT / "bench")):  # lm; timing.py, e2e_model
    if folder not in sys.path:
      sys.path.insert(0, folder)
  spec = importlib.util.spec_from_file_location("embed_grad", ROOT / "bench" / "embed_grad.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


@pytest.mark.parametrize("name", ["flax", "f32", "sorted", "onehot"])
def test_each_candidate_is_the_table_gradient(rng, name):
  embed_grad = _embed_grad()
  ids = jnp.asarray(np.minimum(rng.geometric(0.1, (4, 32)) - 1, VOCAB - 1), jnp.int32)
  dy = jnp.asarray(rng.standard_normal((4, 32, D)), jnp.bfloat16)
  got = np.asarray(jax.jit(embed_grad.CANDIDATES[name], static_argnums=2)(ids, dy, VOCAB),
                   np.float64)
  rows = np.asarray(ids).reshape(-1)
  values = np.asarray(dy.astype(jnp.float32), np.float64).reshape(len(rows), D)
  want, magnitude = np.zeros((VOCAB, D)), np.zeros((VOCAB, D))
  np.add.at(want, rows, values)
  np.add.at(magnitude, rows, np.abs(values))
  count = np.bincount(rows, minlength=VOCAB)[:, None]
  assert got.shape == (VOCAB, D) and count.max() > 4
  per_add = 2.0**-8 if name == "flax" else 2.0**-24
  assert np.all(np.abs(got - want) <= (count + 1) * per_add * magnitude)
