"""The fused producers' spec (`jaxquant.numerics.exact`, `reductions`, `normalization`,
`activations`): exact where it claims to be, accurate against float64, and free of the float
contractions a compiler may apply (the same bits at every XLA:CPU optimization level).

The kernels are checked against this spec bit for bit in `test_fused_producers.py`.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxquant.numerics import activations as act
from jaxquant.numerics import exact, normalization, reductions


def _same_bits(a, b) -> np.ndarray:
  a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
  return (a.view(np.uint32) == b.view(np.uint32)) | (np.isnan(a) & np.isnan(b))


def test_ieee_sqrt_is_correctly_rounded(rng):
  bits = rng.integers(0, 2**32, size=200_000, dtype=np.uint64).astype(np.uint32)
  x = np.concatenate([bits.view(np.float32), np.abs(bits.view(np.float32))[:50_000],
                      np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1e-45, 3.4e38, -1.0],
                               np.float32)])
  got = np.asarray(jax.jit(exact.ieee_sqrt)(x))
  with np.errstate(invalid="ignore"):
    want = np.sqrt(x.astype(np.float64)).astype(np.float32)  # f64 then f32: correctly rounded
  assert _same_bits(got, want).all()


def test_mul_rn_is_the_product_with_negative_zero_made_positive(rng):
  a = rng.standard_normal(1000).astype(np.float32)
  b = rng.standard_normal(1000).astype(np.float32)
  np.testing.assert_array_equal(np.asarray(exact.mul_rn(a, b)), a * b)
  zero = np.asarray(exact.mul_rn(np.float32(-0.0), np.float32(1.0)))
  assert zero == 0 and not np.signbit(zero)


def test_row_and_tile_sums_are_float32_sums_in_their_order(rng):
  x = rng.standard_normal((7, 1001)).astype(np.float32)
  np.testing.assert_allclose(np.asarray(reductions.row_sum(x)), x.astype(np.float64).sum(1),
                             rtol=0, atol=1e-4)
  y = rng.standard_normal((300, 9)).astype(np.float32)
  tiles = np.asarray(reductions.column_tile_sums(y))
  assert tiles.shape == (3, 9)
  np.testing.assert_allclose(tiles[2], y[256:].astype(np.float64).sum(0), atol=1e-5)
  np.testing.assert_allclose(np.asarray(reductions.pairwise_sum(tiles)),
                             y.astype(np.float64).sum(0), atol=1e-4)


@pytest.mark.parametrize("norm_type", ["layernorm", "rmsnorm"])
def test_normalization_is_within_float32_rounding_of_float64(norm_type, rng):
  x = (rng.standard_normal((33, 257)) * 4 + 3).astype(np.float32)
  scale = rng.uniform(0.5, 1.5, 257).astype(np.float32)
  bias = rng.standard_normal(257).astype(np.float32)
  y, _, _ = jax.jit(lambda x: normalization.normalize(
      x, scale, bias, norm_type=norm_type, epsilon=1e-5, out_dtype=jnp.float32))(x)
  xd = x.astype(np.float64)
  centered = xd - xd.mean(1, keepdims=True) if norm_type == "layernorm" else xd
  var = (centered ** 2).mean(1, keepdims=True)
  want = centered / np.sqrt(var + 1e-5) * scale + bias
  np.testing.assert_allclose(np.asarray(y), want, rtol=0, atol=2e-5)


def test_exp_is_within_two_ulp(rng):
  x = np.concatenate([rng.uniform(-87, 88, 100_000), np.linspace(-1, 1, 10_001)]).astype(
      np.float32)
  got = np.asarray(jax.jit(act.exp_f32)(x), np.float64)
  want = np.exp(x.astype(np.float64))
  ulp = np.spacing(want.astype(np.float32)).astype(np.float64)
  assert np.max(np.abs(got - want) / ulp) <= 2.0
  special = np.asarray(act.exp_f32(np.array([np.inf, -np.inf, np.nan, 0.0], np.float32)))
  assert special[0] == np.inf and special[1] == 0 and np.isnan(special[2]) and special[3] == 1


JAX_FORMS = {"gelu": jax.nn.gelu, "silu": jax.nn.silu, "relu": jax.nn.relu,
             "quick_gelu": lambda v: v * jax.nn.sigmoid(1.702 * v),
             "squared_relu": lambda v: jnp.square(jax.nn.relu(v))}


@pytest.mark.parametrize("name", act.ACTIVATIONS)
def test_activations_and_gradients_follow_jax_within_float32_rounding(name, rng):
  x = (rng.standard_normal(20_000) * 4).astype(np.float32)
  g = rng.standard_normal(20_000).astype(np.float32)
  f = JAX_FORMS[name]
  value = np.asarray(jax.jit(lambda v: act.activation(name, v))(x))
  grad = np.asarray(jax.jit(lambda g, v: act.activation_backward(name, g, v))(g, x))
  want_value = np.asarray(jax.jit(f)(x))
  want_grad = np.asarray(jax.jit(jax.vmap(jax.grad(f)))(x)) * g
  scale = np.maximum(np.abs(want_value), 1.0)
  assert np.max(np.abs(value - want_value) / scale) < 1e-6
  assert np.max(np.abs(grad - want_grad) / np.maximum(np.abs(want_grad), np.abs(g))) < 1e-5


_SPEC_PROGRAM = textwrap.dedent("""
    import sys, numpy as np, jax, jax.numpy as jnp
    from jaxquant.numerics import activations as A, normalization as N, reductions as R
    data = np.load(sys.argv[1])
    x, g, b, dy = data["x"], data["g"], data["b"], data["dy"]
    out = {}
    for nt in ("layernorm", "rmsnorm"):
      out[nt] = jax.jit(lambda x: N.normalize(x, g, b if nt == "layernorm" else None,
                                              norm_type=nt, epsilon=1e-5,
                                              out_dtype=jnp.float32)[0])(x)
    for name in A.ACTIVATIONS:
      out[name] = jax.jit(lambda v: A.activation(name, v))(x)
      out["d" + name] = jax.jit(lambda d, v: A.activation_backward(name, d, v))(dy, x)
      out["g" + name] = jnp.concatenate(jax.jit(
          lambda d, h0, h1: A.gated_activation_backward(name, d, h0, h1))(dy, x, x * 0.5), 1)
    out["tiles"] = jax.jit(R.column_tile_sums)(x)
    np.savez(sys.argv[2], **{k: np.asarray(v) for k, v in out.items()})
""")


def test_the_spec_has_the_same_bits_at_every_xla_cpu_optimization_level(tmp_path, rng):
  """XLA:CPU contracts a product feeding an addition into an FMA at its default optimization
  level (2), not at 0 (this suite's): a spec that relied on separate rounding somewhere would
  give other bits there (mul_rn protects every such product)."""
  x = (rng.standard_normal((64, 200)) * 3).astype(np.float32)
  x[:, :5] *= 40
  np.savez(tmp_path / "in.npz", x=x, g=rng.uniform(0.5, 1.5, 200).astype(np.float32),
           b=rng.standard_normal(200).astype(np.float32),
           dy=rng.standard_normal((64, 200)).astype(np.float32))
  program = tmp_path / "spec.py"
  program.write_text(_SPEC_PROGRAM)
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  results = {}
  for level in (0, 2):
    env = dict(os.environ, XLA_FLAGS=f"--xla_backend_optimization_level={level}",
               JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    out = tmp_path / f"o{level}.npz"
    subprocess.run([sys.executable, str(program), str(tmp_path / "in.npz"), str(out)], env=env,
                   check=True, capture_output=True, timeout=900)
    results[level] = np.load(out)
  for name in results[0].files:
    differ = ~_same_bits(results[0][name], results[2][name])
    assert not differ.any(), f"{name}: {int(differ.sum())} values differ between O0 and O2"
