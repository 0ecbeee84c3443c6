"""Small helpers shared by the tests: a jitted `ops.quantize` (one compilation per quantizer and
shape keeps the suite fast on CPU) and byte views of storages."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

import jaxquant as jq
import oracle


@functools.partial(jax.jit, static_argnames=("quantizer", "rowwise", "columnwise"))
def quantize(x, quantizer, *, rowwise=True, columnwise=True, key=None, state=None):
  return jq.ops.quantize(x, quantizer, rowwise=rowwise, columnwise=columnwise, key=key,
                         state=state)


def rowwise(x, quantizer, **kw) -> jq.ScaledTensor:
  return quantize(jnp.asarray(x), quantizer, columnwise=False, **kw).rowwise


def columnwise(x, quantizer, **kw) -> jq.ScaledTensor:
  return quantize(jnp.asarray(x), quantizer, rowwise=False, **kw).columnwise


@jax.jit
def dequantize(t):
  return t.dequantize(jnp.float32)


def data_codes(t: jq.ScaledTensor) -> np.ndarray:
  return oracle.codes(t.data)


def scale_bytes(t: jq.ScaledTensor) -> np.ndarray:
  """E8M0 / E4M3 scale codes as uint8 (float32 scales are returned as float32)."""
  if np.dtype(t.scale_inv.dtype) == np.dtype(jnp.float32):
    return np.asarray(t.scale_inv)
  return oracle.codes(t.scale_inv)


def assert_same_leaves(a, b, msg=""):
  """Pytree structure equal and every leaf bitwise equal (NaNs compared by bits)."""
  la, ta = jax.tree_util.tree_flatten(a)
  lb, tb = jax.tree_util.tree_flatten(b)
  assert ta == tb, f"{msg}: tree structures differ: {ta} vs {tb}"
  for i, (u, v) in enumerate(zip(la, lb)):
    u, v = np.asarray(u), np.asarray(v)
    assert u.dtype == v.dtype and u.shape == v.shape, f"{msg}: leaf {i}: {u.dtype}{u.shape} vs "\
        f"{v.dtype}{v.shape}"
    ub = u.view(np.uint8) if u.dtype.itemsize == 1 else u.view(f"u{u.dtype.itemsize}")
    vb = v.view(np.uint8) if v.dtype.itemsize == 1 else v.view(f"u{v.dtype.itemsize}")
    np.testing.assert_array_equal(ub, vb, err_msg=f"{msg}: leaf {i} differs")
