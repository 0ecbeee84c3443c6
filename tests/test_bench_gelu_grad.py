"""`bench/gelu_grad.py`'s candidates compute the same gelu gradient: each `(dh, dbias)` against
float64 math on fresh random inputs. Tolerances, relative to |da| per element of dh (|gelu'| <=
1.13): 2^-5 for the candidates that differentiate `jax.nn.gelu` in bfloat16 arithmetic (JAX's
derivative rounds every intermediate to bfloat16), 2^-7 for those written in float32 (one
rounding of dh); the bias gradient, a sum over the rows in dh's dtype, within 2^-6 of the sum
of |dh|; the unfused pair's forward gelu (bfloat16 arithmetic) within 2^-5 |h|."""

from __future__ import annotations

import importlib.util
import math
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _gelu_grad():
  sys.path.insert(0, str(ROOT / "bench"))  # gelu_grad imports bench/timing.py
  spec = importlib.util.spec_from_file_location("gelu_grad", ROOT / "bench" / "gelu_grad.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


FLOAT32_WRITTEN = ("tanh_f32", "sigmoid")


@pytest.mark.parametrize("name", ["vjp", "tanh_f32", "sigmoid", "split", "unfused"])
def test_each_candidate_is_the_gelu_gradient(rng, name):
  gelu_grad = _gelu_grad()
  h = jnp.asarray(rng.standard_normal((96, 64)) * 2, jnp.bfloat16)
  da = jnp.asarray(rng.standard_normal((96, 64)), jnp.bfloat16)
  out = jax.jit(gelu_grad.CANDIDATES[name])(da, h)
  x, g = np.asarray(h, np.float64), np.asarray(da, np.float64)
  c, k = math.sqrt(2 / math.pi), 0.044715
  t = np.tanh(c * (x + k * x**3))
  dh64 = g * (0.5 * (1 + t) + 0.5 * x * (1 - t * t) * c * (1 + 3 * k * x * x))
  dh, dbias = np.asarray(out[-2], np.float64), np.asarray(out[-1], np.float64)
  bound = 2.0**-7 if name in FLOAT32_WRITTEN else 2.0**-5
  assert np.all(np.abs(dh - dh64) <= bound * 1.13 * np.abs(g) + 1e-30)
  assert np.all(np.abs(dbias - dh64.sum(0)) <= 2.0**-6 * np.abs(dh64).sum(0))
  if name == "unfused":  # also the forward gelu
    a64 = 0.5 * x * (1 + t)
    assert np.all(np.abs(np.asarray(out[0], np.float64) - a64) <= 2.0**-5 * np.abs(x))
