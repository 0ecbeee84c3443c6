"""Every built-in recipe through `jaxquant.flax.Dense`: gradients (and outputs) against float64
math within the formats' error, and bit-for-bit against the same GEMMs done by hand.

Tolerance (`test_..._within_the_formats_error_of_float64`). A GEMM `G = A B` whose operands are
quantized element-wise with relative errors `d_a`, `d_b` (|d| <= u, u = the format's unit
roundoff: 2^-(m+1) for round-to-nearest with m mantissa bits, one full step 2^-m for stochastic
rounding) has the error `dG_mn = sum_k a_mk b_kn (d_a + d_b + d_a d_b)`. The rounding errors
are zero-mean and independent across elements for random operands, so
    E ||dG||_F^2 <= (u_a^2 + u_b^2) * S^2,   S^2 = sum_mn sum_k a_mk^2 b_kn^2,
(the d_a d_b term is second order). The bound holds for every K (each output's error and its
scale S both grow like sqrt(K)); the per-tensor, 1x32, 1x128, 128x128 and 1x16 scales all keep
the elements in the formats' normal range for Gaussian data (a power-of-two block scale
changes no relative error), and the random Hadamard transform of NVFP4's wgrad operands is
orthogonal, so it leaves the same bound in the rotated basis. We assert
||dG||_F <= sqrt(u_a^2 + u_b^2) * S: the measured ratio is 0.3-0.46 (the RMS of a uniform
rounding error is u/sqrt(3), less near powers of two), so the test has about 2x headroom and
still fails for any real mistake (a wrong scale or transposition gives ||dG|| ~ S, at least
1.8x the bound for NVFP4 and 7x for FP8).
  E4M3: u = 2^-4    E5M2: u = 2^-3    E2M1 (NVFP4): u = 2^-2, stochastic rounding 2^-1
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxquant as jq
import jaxquant.flax as jf

M, K, N = 32, 64, 32  # NVFP4's RHT needs M % 16 == 0; MXFP8 blocks of 32 divide K, N and M

U_E4M3, U_E5M2, U_E2M1 = 2.0**-4, 2.0**-3, 2.0**-2
# unit roundoff of (input, weight, grad_output) under each built-in recipe's defaults
UNIT_ROUNDOFF = {
    "fp8_current": (U_E4M3, U_E4M3, U_E5M2),  # HYBRID: E4M3 forward, E5M2 gradients
    "fp8_delayed": (U_E4M3, U_E4M3, U_E5M2),
    "mxfp8": (U_E4M3, U_E4M3, U_E4M3),
    "fp8_block": (U_E4M3, U_E4M3, U_E4M3),
    "nvfp4": (U_E2M1, U_E2M1, 2 * U_E2M1),  # stochastic rounding of grad_output
}
RECIPES = sorted(jq.BUILTIN_RECIPES)


def _dense_run(recipe_name, rng):
  """Jitted y and the gradients of sum(y * c) for a bias-free Dense under a built-in recipe."""
  x = rng.standard_normal((M, K)).astype(np.float32)
  c = rng.standard_normal((M, N)).astype(np.float32)
  module = jf.Dense(N, use_bias=False, recipe=jq.BUILTIN_RECIPES[recipe_name]())
  variables = module.init(jax.random.key(int(rng.integers(2**31))), jnp.asarray(x))
  rngs = {"quantize": jax.random.key(int(rng.integers(2**31)))}

  def loss(v, x):
    y = module.apply(v, x, rngs=rngs)
    return jnp.sum(y * c), y

  (_, y), (gv, gx) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(
      variables, jnp.asarray(x))
  kernel = np.asarray(variables["params"]["kernel"])
  return dict(module=module, rngs=rngs, x=x, c=c, kernel=kernel, y=np.asarray(y),
              dx=np.asarray(gx), dkernel=np.asarray(gv["params"]["kernel"]))


def _relative_to_bound(got, a, b, u_a, u_b):
  a, b = a.astype(np.float64), b.astype(np.float64)
  scale = np.sqrt(np.sum((a * a) @ (b * b)))
  return np.linalg.norm(got.astype(np.float64) - a @ b) / (np.hypot(u_a, u_b) * scale)


@pytest.mark.parametrize("recipe_name", RECIPES)
def test_output_and_gradients_within_the_formats_error_of_float64(rng, recipe_name):
  run = _dense_run(recipe_name, rng)
  u_x, u_w, u_g = UNIT_ROUNDOFF[recipe_name]
  x, w, c = run["x"], run["kernel"], run["c"]
  ratios = {
      "y = x W": _relative_to_bound(run["y"], x, w, u_x, u_w),
      "dx = dy W^T": _relative_to_bound(run["dx"], c, w.T, u_g, u_w),
      "dW = x^T dy": _relative_to_bound(run["dkernel"], x.T, c, u_x, u_g),
  }
  assert all(r <= 1.0 for r in ratios.values()), ratios
  # and the quantization did happen: a float32 GEMM would be ~1000x below the bound
  assert all(r > 0.05 for r in ratios.values()), ratios


class _KeyProbe(nn.Module):
  """Draws from the "quantize" stream at the same place (a top-level module's first draw) as the
  Dense under test, so the hand reference uses the key the module used."""

  @nn.compact
  def __call__(self):
    return self.make_rng(jf.QUANTIZE_RNG)


@pytest.mark.parametrize("recipe_name", RECIPES)
def test_output_and_gradients_equal_the_hand_quantized_gemms_bitwise(rng, recipe_name):
  run = _dense_run(recipe_name, rng)
  recipe = run["module"].recipe
  quantizers = jq.DenseQuantizers.from_recipe(recipe, "linear", "Dense")
  key = _KeyProbe().apply({}, rngs=run["rngs"])

  @jax.jit
  def by_hand(x, kernel, dy, key):
    # jaxquant.dense folds the module's key with 0, 1, 2 for input, weight and grad_output
    k_x, k_w, k_g = (jax.random.fold_in(key, i) for i in range(3))
    states = quantizers.init_states()  # delayed scaling: the first step uses scale 1
    qx = jq.ops.quantize(x, quantizers.input, key=k_x, state=states[0])
    qw = jq.ops.quantize(kernel.T, quantizers.weight, key=k_w, state=states[1])
    qdy = jq.ops.quantize(dy, quantizers.grad_output, key=k_g, state=states[2])
    y = jq.ops.gemm(qx.rowwise, qw.rowwise, out_dtype=jnp.float32)
    dx = jq.ops.gemm(qdy.rowwise, qw.columnwise, out_dtype=jnp.float32)
    dkernel = jq.ops.gemm(qx.columnwise, qdy.columnwise, out_dtype=jnp.float32)
    return y, dx, dkernel

  want = by_hand(jnp.asarray(run["x"]), jnp.asarray(run["kernel"]), jnp.asarray(run["c"]), key)
  for name, expected in zip(("y", "dx", "dkernel"), want):
    np.testing.assert_array_equal(run[name].view(np.uint32),
                                  np.asarray(expected).view(np.uint32), err_msg=name)
