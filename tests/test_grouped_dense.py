"""`jaxquant.grouped_dense` and `jaxquant.flax.GroupedDense` equal a loop of `jaxquant.dense`
over the groups, for every built-in recipe and the MoE hybrid recipe, with empty and uneven
groups: outputs, input/weight/bias gradients within float32 accumulation-order tolerance, and
per-expert delayed-scaling states bit for bit.

Group `g` of the loop is `jaxquant.dense(x_g, W[g], b[g], quantizers, key=fold_in(key, g),
states=states[g])` on its rows zero-padded to a common length (a multiple of 16, which the RHT
of `jaxquant.dense` requires; zero rows change nothing else), so one compiled Dense serves all
groups.
"""

from __future__ import annotations

import functools
import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxquant as jq
import jaxquant.flax as jf
from jaxquant.backends.ffi import registry
from jaxquant.backends.ffi.grouped import support as kernels
from jaxquant.layers.dense import DenseQuantizers
from jaxquant.layers.grouped_dense import token_blocks
from jaxquant.ops import dispatch

# Under JAXQUANT_BACKEND=ffi a case without a grouped kernel is an error by design (never a silent
# fallback); those cases are expected to raise that RuntimeError, every other case must pass.
pytestmark = [pytest.mark.usefixtures("core_backend"),
              pytest.mark.xfail(os.environ.get("JAXQUANT_BACKEND") == "ffi", raises=RuntimeError,
                                strict=False,
                                reason="no grouped kernel for this case (ffi forced)")]

T, K, N, G = 80, 64, 32, 4
TOL = 1e-5  # relative to the largest magnitude: float32 accumulation order


def _custom_hybrid(role):
  """The corners the built-ins do not reach: row-scaled NVFP4 in the columnwise (wgrad and
  dgrad) direction, backward operands built from the dequantized forward ones, and 128x128
  tiles on the tokens' rowwise copy (a padded layout for the forward GEMM too)."""
  tensor_type = role.tensor_type if role is not None else ""
  if tensor_type == "grad_output":
    return jq.NVFP4Quantizer(row_scaled=True, stochastic_rounding=True)
  rowwise = jq.Float8BlockQuantizer((128, 128)) if tensor_type == "input" else jq.MXFP8Quantizer()
  return jq.HybridQuantizer(rowwise, jq.NVFP4Quantizer(row_scaled=True),
                            columnwise_source="rowwise_dequantized")


RECIPES = {
    **{name: make() for name, make in jq.BUILTIN_RECIPES.items()},
    "moe_nvfp4_fwd_mxfp8_bwd": jq.CustomRecipe(jq.factories.moe_nvfp4_forward_mxfp8_backward),
    "identity": jq.CustomRecipe(lambda role: jq.IdentityQuantizer()),
    "custom_hybrid": jq.CustomRecipe(_custom_hybrid),
}


def _sizes(rng):
  """Uneven sizes with one empty group, summing to T - 3 (the last rows are in no group)."""
  cuts = np.sort(rng.choice(np.arange(1, T - 3), size=2, replace=False))
  sizes = np.diff(np.concatenate([[0], cuts, [T - 3]]))
  return np.insert(sizes, rng.integers(0, G), 0).astype(np.int32)


def _step(fn, *args, dy):
  y, vjp = jax.vjp(fn, *args)
  return y, vjp(dy)


@functools.partial(jax.jit, static_argnames=("quantizers",))
def _grouped_step(x, w, b, sizes, key, states, dy, quantizers):
  return _step(lambda x, w, b, s: jq.grouped_dense(x, w, sizes, b, quantizers, key=key,
                                                   states=s), x, w, b, states, dy=dy)


@functools.partial(jax.jit, static_argnames=("quantizers",))
def _dense_step(x, w, b, key, states, dy, quantizers):
  return _step(lambda x, w, b, s: jq.dense(x, w, b, quantizers, key=key, states=s), x, w, b,
               states, dy=dy)


def _assert_close(actual, expected, msg):
  actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
  assert actual.shape == expected.shape, msg
  scale = max(np.abs(expected).max(initial=0.0), 1e-30)
  err = np.abs(actual - expected).max(initial=0.0)
  assert err <= TOL * scale, f"{msg}: max error {err:.3g} vs scale {scale:.3g}"


# Per-tensor FP8 once, with a state (delayed scaling): current scaling's grouped quantize and
# GEMMs are the same kernels (tests/test_grouped_ffi.py and test_grouped_ops.py check them).
# MXFP8 as the MoE recipe's backward and custom_hybrid's weights (all-MXFP8 took ~12 CPU-s).
@pytest.mark.parametrize("name", [n for n in RECIPES if n not in ("fp8_current", "mxfp8")])
def test_grouped_dense_equals_a_loop_of_dense(rng, prng_key, name):
  quantizers = DenseQuantizers.from_recipe(RECIPES[name], "grouped_linear", "experts")
  sizes = _sizes(rng)
  x = jnp.asarray(rng.standard_normal((T, K)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((G, K, N)) * 0.1, jnp.float32)
  b = jnp.asarray(rng.standard_normal((G, N)), jnp.float32)
  dy = jnp.asarray(rng.standard_normal((T, N)), jnp.float32)
  states = None
  if quantizers.stateful:  # random per-expert scales, so a mix-up of experts shows
    states = jax.tree_util.tree_map(
        lambda a: jnp.asarray(rng.uniform(0.1, 50.0, a.shape), jnp.float32),
        jq.grouped_dense_states(quantizers, G))
  y, (dx, dw, db, new_states) = _grouped_step(x, w, b, jnp.asarray(sizes), prng_key, states, dy,
                                              quantizers)
  length = max(16, *(-(-n // 16) * 16 for n in sizes))
  start = 0
  for g, n in enumerate(sizes):
    pad = lambda a: jnp.zeros((length, a.shape[1]), a.dtype).at[:n].set(a[start:start + n])
    group_states = jax.tree_util.tree_map(lambda a: a[g], states)
    y_g, (dx_g, dw_g, db_g, states_g) = _dense_step(
        pad(x), w[g], b[g], jax.random.fold_in(prng_key, g), group_states, pad(dy), quantizers)
    rows = slice(start, start + n)
    _assert_close(y[rows], y_g[:n], f"{name} y, group {g}")
    _assert_close(dx[rows], dx_g[:n], f"{name} dx, group {g}")
    _assert_close(dw[g], dw_g, f"{name} dW, group {g} of {n} rows")
    _assert_close(db[g], db_g, f"{name} db, group {g}")
    for a, e in zip(jax.tree_util.tree_leaves(jax.tree_util.tree_map(lambda a: a[g], new_states)),
                    jax.tree_util.tree_leaves(states_g)):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(e), err_msg=f"state, group {g}")
    start += n
  assert np.all(np.asarray(y[start:]) == 0) and np.all(np.asarray(dx[start:]) == 0)


def test_wgrad_operands_share_one_token_block():
  moe = DenseQuantizers.from_recipe(RECIPES["moe_nvfp4_fwd_mxfp8_bwd"], "grouped_linear", "e")
  assert token_blocks(moe) == (1, 1, 32)  # MXFP8 columnwise x and dy
  nvfp4 = DenseQuantizers.from_recipe(RECIPES["nvfp4"], "grouped_linear", "e")
  assert token_blocks(nvfp4) == (1, 1, 16)  # RHT chunks and 1x16 blocks
  block = DenseQuantizers.from_recipe(RECIPES["fp8_block"], "grouped_linear", "e")
  assert token_blocks(block) == (1, 1, 128)
  current = DenseQuantizers.from_recipe(RECIPES["fp8_current"], "grouped_linear", "e")
  # per-tensor: packed everywhere, except the wgrad copies where the CUTLASS Hopper kernel runs
  # (it needs 16-aligned group starts; the reference backend, the suite's default, never runs it)
  sm90 = (kernels._sm90_device_reason() is None and registry.unserved_reason("cuda") is None
          and dispatch.requested_backend() != "reference")
  assert token_blocks(current) == (1, 1, 16 if sm90 else 1)
  custom = DenseQuantizers.from_recipe(RECIPES["custom_hybrid"], "grouped_linear", "e")
  assert token_blocks(custom) == (128, 1, 16)  # 2-D tiles on x's rows


def test_without_a_recipe_it_is_ragged_dot(rng):
  sizes = jnp.asarray([30, 0, 25, 20], jnp.int32)
  x = jnp.asarray(rng.standard_normal((T, K)), jnp.bfloat16)
  model = jf.GroupedDense(N, num_groups=G, dtype=jnp.bfloat16)
  variables = model.init(jax.random.key(0), x, sizes)
  kernel, bias = variables["params"]["kernel"], variables["params"]["bias"]
  assert kernel.shape == (G, K, N) and bias.shape == (G, N)

  def ours(v, x):
    return jnp.sum(model.apply(v, x, sizes).astype(jnp.float32) ** 2)

  def plain(v, x):
    p = v["params"]
    y = jax.lax.ragged_dot(x, p["kernel"].astype(x.dtype), sizes)
    group = jnp.searchsorted(jnp.cumsum(sizes), jnp.arange(T), side="right")
    bias = p["bias"].astype(x.dtype)
    # The bias added in float32 and rounded once; cast before the gather, so the gradient's
    # scatter-add sums in float32.
    bias_rows = jnp.concatenate([bias, jnp.zeros((1, N), bias.dtype)]).astype(jnp.float32)[group]
    y = (y.astype(jnp.float32) + bias_rows).astype(y.dtype)
    return jnp.sum(y.astype(jnp.float32) ** 2)

  ours_out = jax.jit(jax.value_and_grad(ours, argnums=(0, 1)))(variables, x)
  plain_out = jax.jit(jax.value_and_grad(plain, argnums=(0, 1)))(variables, x)
  # Bit for bit on XLA:CPU. On a GPU the two programs sum differently (XLA:GPU fuses the ragged
  # dots of each program its own way): within two bf16 roundings of the largest element.
  exact = jax.default_backend() == "cpu"
  for a, e in zip(jax.tree_util.tree_leaves(ours_out), jax.tree_util.tree_leaves(plain_out)):
    a, e = np.asarray(a, np.float32), np.asarray(e, np.float32)
    if exact:
      np.testing.assert_array_equal(a, e)
    else:
      np.testing.assert_allclose(a, e, rtol=0, atol=2**-7 * np.abs(e).max())


class _Recorder:
  def __init__(self):
    self.roles = []

  def __call__(self, role):
    self.roles.append(role)
    return jq.IdentityQuantizer()


def test_a_recording_factory_sees_the_grouped_linear_roles():

  class MoE(nn.Module):

    @nn.compact
    def __call__(self, x, sizes):
      h = jf.GroupedDense(48, num_groups=G, name="fc1")(x, sizes)
      return jf.GroupedDense(K, num_groups=G)(h, sizes)

  class Model(nn.Module):

    @nn.compact
    def __call__(self, x, sizes):
      return MoE(name="moe")(x, sizes)

  recorder = _Recorder()
  x = jax.ShapeDtypeStruct((T, K), jnp.float32)
  sizes = jax.ShapeDtypeStruct((G,), jnp.int32)
  with jq.autocast(jq.CustomRecipe(recorder)):
    variables = jax.eval_shape(Model().init, jax.random.key(0), x, sizes)
    jax.eval_shape(jax.grad(lambda v, x, s: jnp.sum(Model().apply(v, x, s))), variables, x,
                   sizes)
  triples = {(r.module_type, r.tensor_type, r.name) for r in recorder.roles}
  assert triples == {("grouped_linear", t, n) for t in ("input", "weight", "grad_output")
                     for n in ("fc1", "GroupedDense_0")}
  assert {r.name: r.path for r in recorder.roles} == {"fc1": "moe/fc1",
                                                      "GroupedDense_0": "moe/GroupedDense_0"}


def test_flax_delayed_scaling_keeps_a_state_per_expert(rng):
  history = 4
  model = jf.GroupedDense(N, num_groups=G, recipe=jq.DelayedScaling(amax_history_len=history))
  sizes = jnp.asarray([30, 0, 25, 20], jnp.int32)
  x = jnp.asarray(rng.standard_normal((T, K)) * rng.uniform(0.5, 4.0), jnp.float32)
  x = x * jnp.repeat(jnp.asarray([1.0, 1.0, 8.0, 0.25]), jnp.asarray([30, 0, 25, 25]),
                     total_repeat_length=T)[:, None]
  variables = jax.jit(model.init)(jax.random.key(0), x, sizes)
  state = variables[jf.OVERWRITE_WITH_GRADIENT]
  assert state["input_scale"].shape == (G,) and state["input_amax_history"].shape == (G, history)
  grads = jax.jit(jax.grad(lambda v: jnp.sum(model.apply(v, x, sizes))))(variables)
  new = grads[jf.OVERWRITE_WITH_GRADIENT]
  # After one step each expert's history ends with its own amax (0 for the empty expert).
  x_amax = [np.abs(np.asarray(x[s:s + n])).max() if n else 0.0
            for s, n in ((0, 30), (30, 0), (30, 25), (55, 20))]
  np.testing.assert_array_equal(np.asarray(new["input_amax_history"])[:, -1],
                                np.asarray(x_amax, np.float32))
  w_amax = np.abs(np.asarray(variables["params"]["kernel"])).reshape(G, -1).max(axis=1)
  np.testing.assert_array_equal(np.asarray(new["weight_amax_history"])[:, -1], w_amax)
  scale = np.asarray(new["input_scale"])
  # The empty expert has seen no usable amax: it still has no scale (0, the fresh state's).
  assert scale[1] == 0.0 and len(set(scale[[0, 2, 3]].tolist())) == 3


def test_stochastic_rounding_needs_the_quantize_rng_stream(rng):
  model = jf.GroupedDense(N, num_groups=G, recipe=jq.NVFP4BlockScaling())
  x = jax.ShapeDtypeStruct((T, K), jnp.float32)
  sizes = jnp.asarray([T, 0, 0, 0], jnp.int32)
  variables = jax.eval_shape(model.init, jax.random.key(0), x, sizes)
  with pytest.raises(ValueError, match="'quantize'"):
    jax.eval_shape(lambda v: model.apply(v, jnp.zeros((T, K)), sizes), variables)
  out = jax.eval_shape(lambda v: model.apply(v, jnp.zeros((T, K)), sizes,
                                             rngs={"quantize": jax.random.key(1)}), variables)
  assert out.shape == (T, N)


@pytest.mark.parametrize("args, error, match", [
    (dict(sizes=np.array([40, 40, 0], np.int32)), ValueError, r"does not match the 4 groups"),
    (dict(sizes=np.array([40.0, 40, 0, 0])), TypeError, "not an integer dtype"),
    (dict(x_shape=(2, T // 2, K)), ValueError, "2-D tokens"),
    (dict(w_shape=(G, K + 1, N)), ValueError, "kernel: expected"),
    (dict(b_shape=(N,)), ValueError, "bias: expected shape"),
])
def test_bad_arguments_are_rejected(args, error, match):
  x = jax.ShapeDtypeStruct(args.get("x_shape", (T, K)), jnp.float32)
  w = jax.ShapeDtypeStruct(args.get("w_shape", (G, K, N)), jnp.float32)
  b = jax.ShapeDtypeStruct(args.get("b_shape", (G, N)), jnp.float32)
  sizes = args.get("sizes", np.array([T, 0, 0, 0], np.int32))
  quantizers = DenseQuantizers.from_recipe(jq.MXFP8BlockScaling(), "grouped_linear", "e")
  with pytest.raises(error, match=match):
    jax.eval_shape(lambda x, w, b: jq.grouped_dense(x, w, sizes, b, quantizers), x, w, b)


@pytest.mark.parametrize("name", ["fp8_current", "fp8_delayed", "mxfp8", "fp8_block"])
def test_swappable_experts_are_the_transposed_kernels_quantize(rng, prng_key, name):
  """A weight format whose copies swap with the transpose (per-tensor FP8, MXFP8, Float8Block,
  NVFP4 without RHT or stochastic rounding on the weight: tests/test_param_dtype.py) quantizes
  the `[G, K, N]` kernel as it is and swaps its copies (no transpose of the weights first): the
  step is bit for bit the one built from `quantize_experts` of the transposed kernel
  `[G, N, K]`, forward and both gradients."""
  quantizers = DenseQuantizers.from_recipe(RECIPES[name], "grouped_linear", "experts")
  sizes = jnp.asarray(_sizes(rng))
  x = jnp.asarray(rng.standard_normal((T, K)), jnp.bfloat16)
  w = jnp.asarray(rng.standard_normal((G, K, N)) * 0.1, jnp.bfloat16)
  dy = jnp.asarray(rng.standard_normal((T, N)), jnp.bfloat16)
  states = None
  if quantizers.stateful:
    states = jax.tree_util.tree_map(
        lambda a: jnp.asarray(rng.uniform(0.1, 50.0, a.shape), jnp.float32),
        jq.grouped_dense_states(quantizers, G))
  y, (dx, dw, _, new_states) = _grouped_step(x, w, None, sizes, prng_key, states, dy, quantizers)

  @jax.jit
  def transposed_step(x, w, sizes, states, dy):
    blocks = token_blocks(quantizers)
    s = (None, None, None) if states is None else states
    qx = jq.grouped.quantize(x, sizes, quantizers.input, columnwise=True, row_block=blocks[0],
                             col_block=blocks[2], state=s[0])
    qw = jq.grouped.quantize_experts(jnp.swapaxes(w, 1, 2), quantizers.weight, state=s[1])
    qdy = jq.grouped.quantize(dy, sizes, quantizers.grad_output, columnwise=True,
                              row_block=blocks[1], col_block=blocks[2], state=s[2])
    y = jq.grouped.to_tokens(jq.grouped.gemm(qx.rowwise, qw.rowwise, out_dtype=x.dtype),
                             qx.rowwise)
    dx = jq.grouped.to_tokens(jq.grouped.gemm(qdy.rowwise, qw.columnwise, out_dtype=x.dtype),
                              qdy.rowwise)
    dw = jq.grouped.gemm(qx.columnwise, qdy.columnwise, out_dtype=w.dtype)
    return y, dx, dw, qw.rowwise.amax

  y_t, dx_t, dw_t, w_amax = transposed_step(x, w, sizes, states, dy)
  np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(y_t, np.float32))
  np.testing.assert_array_equal(np.asarray(dx, np.float32), np.asarray(dx_t, np.float32))
  np.testing.assert_array_equal(np.asarray(dw, np.float32), np.asarray(dw_t, np.float32))
  if states is not None:  # the weight state recorded the same per-expert amax
    np.testing.assert_array_equal(np.asarray(new_states[1].amax_history[:, -1]),
                                  np.asarray(w_amax, np.float32))
