"""Small helpers shared by the tests: a jitted `ops.quantize` (one compilation per quantizer and
shape keeps the suite fast on CPU), byte views of storages, and a Flax module's loss and
gradients compared with another's."""

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


def module_loss(module):
  """The mean square of `module`'s output, as a function of (variables, x)."""
  def loss(variables, x):
    y, _ = module.apply(variables, x, mutable=[k for k in variables if k != "params"])
    return jnp.mean(jnp.square(y.astype(jnp.float32)))
  return loss


def module_grads(module, x):
  """`(loss, (variable gradients, x's gradient))` of `module_loss` at fresh variables (key 0)."""
  variables = jax.jit(module.init)(jax.random.key(0), x)
  return jax.jit(jax.value_and_grad(module_loss(module), argnums=(0, 1)))(variables, x)


def assert_trains_alike(got, want, *, loss_rtol: float = 0.02, grad_rtol: float = 0.1):
  """Two `module_grads` results: the same variables, the loss within `loss_rtol`, and each
  parameter's and x's gradient within `grad_rtol` (relative norm of the difference), none zero."""
  (loss, (g_vars, g_x)), (loss0, (g_vars0, g_x0)) = got, want
  assert jax.tree_util.tree_structure(g_vars) == jax.tree_util.tree_structure(g_vars0)
  np.testing.assert_allclose(float(loss), float(loss0), rtol=loss_rtol)
  for a, b in zip(jax.tree_util.tree_leaves(g_vars["params"]) + [g_x],
                  jax.tree_util.tree_leaves(g_vars0["params"]) + [g_x0]):
    a = np.asarray(jnp.asarray(a, jnp.float32), np.float64)
    b = np.asarray(jnp.asarray(b, jnp.float32), np.float64)
    assert np.abs(a).max() > 0
    rel = np.linalg.norm(a - b) / np.linalg.norm(b)
    assert rel < grad_rtol, rel
