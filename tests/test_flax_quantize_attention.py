"""`quantize_dense` on `nn.DenseGeneral` and `nn.Einsum`: the attention projections of an
unmodified `nn.MultiHeadDotProductAttention` are quantized with their parameter trees unchanged,
equal the same `jaxquant.dense` contractions built by hand (bit for bit, reference path), and
are named after themselves; each layer type can be opted out; an `nn.Einsum` equation the
quantized contraction cannot express stays Flax's and `jaxquant.explain` says so."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxquant as jq
import jaxquant.flax as jf
from helpers import assert_same_leaves
from jaxquant.flax.einsum import plan_module_einsum

pytestmark = pytest.mark.usefixtures("core_backend")

B, L, D, HEADS = 2, 16, 32, 4
RECIPE = jq.Float8CurrentScaling()


class _Recorder:

  def __init__(self):
    self.roles = []

  def __call__(self, role):
    if role is not None:
      self.roles.append(role)
    return jq.IdentityQuantizer()


class _Block(nn.Module):
  """Self-attention and an MLP from plain Flax layers."""

  @nn.compact
  def __call__(self, x):
    x = x + nn.MultiHeadDotProductAttention(num_heads=HEADS, name="attention")(x)
    return x + nn.Dense(D, name="fc2")(nn.gelu(nn.Dense(2 * D, name="fc1")(x)))


def _x(rng, shape=(B, L, D)):
  return jnp.asarray(rng.standard_normal(shape), jnp.float32)


def _init(model, x, **swap):
  with jf.quantize_dense(RECIPE, **swap):
    return _jit_init(model, x)


def _jit_init(model, x):
  """`model.init` as one compiled program, traced here (inside the caller's `quantize_dense`; a
  fresh function: no trace shared with another context). An eager init runs the quantized
  forward op by op (~10 CPU-s over this file)."""
  return jax.jit(lambda key, x: model.init(key, x))(jax.random.key(0), x)


def test_parameter_trees_are_unchanged(rng):
  x = _x(rng)
  plain = _jit_init(_Block(), x)
  assert_same_leaves(_init(_Block(), x), plain, "current scaling")
  with jf.quantize_dense(jq.DelayedScaling()):
    delayed = _jit_init(_Block(), x)
  assert_same_leaves(delayed["params"], plain["params"], "delayed scaling")
  state = delayed[jf.OVERWRITE_WITH_GRADIENT]
  assert set(state["attention"]) == {"query", "key", "value", "out"}
  assert set(state["attention"]["out"]) == {f"{t}_{v}" for t in ("input", "weight", "grad_output")
                                            for v in ("scale", "amax_history")}


def _hand_built_attention(params, x):
  """The attention of `_Block` written with `jaxquant.dense` (what quantize_dense must build)."""
  def projection(name, inputs, contracting_dims=1):
    quantizers = jq.DenseQuantizers.from_recipe(RECIPE, "linear", name)
    p = params["attention"][name]
    return jq.dense(inputs, p["kernel"], p["bias"], quantizers,
                    contracting_dims=contracting_dims)

  q, k, v = (projection(name, x) for name in ("query", "key", "value"))
  return projection("out", nn.dot_product_attention(q, k, v), contracting_dims=2)


def test_attention_equals_hand_built_jaxquant_dense(rng):
  x, c = _x(rng), _x(rng)
  model = nn.MultiHeadDotProductAttention(num_heads=HEADS, name="attention")
  params = {"attention": _jit_init(_Block(), x)["params"]["attention"]}

  def swapped(p, x):
    with jf.quantize_dense(RECIPE):
      return model.apply({"params": p["attention"]}, x)

  for name, fn in (("quantize_dense", swapped), ("hand-built", _hand_built_attention)):
    loss = lambda p, x, fn=fn: jnp.sum(fn(p, x) * c)
    y = jax.jit(fn)(params, x)
    grads = jax.jit(jax.grad(loss, argnums=(0, 1)))(params, x)
    if name == "quantize_dense":
      want = (y, grads)
    else:
      assert_same_leaves((y, grads), want, "output and gradients")
  # and it is quantized: not Flax's own attention
  flax_y = model.apply({"params": params["attention"]}, x)
  assert not np.array_equal(np.asarray(want[0]), np.asarray(flax_y))


def _roles(model, x, **swap):
  recorder = _Recorder()
  with jf.quantize_dense(jq.CustomRecipe(recorder), **swap):
    variables = jax.eval_shape(model.init, jax.random.key(0), x)
    jax.eval_shape(jax.grad(lambda v: jnp.sum(model.apply(v, x))), variables)
  return recorder.roles


def test_roles_are_named_after_the_projections(rng):
  roles = _roles(_Block(), _x(rng))
  assert {r.name for r in roles} == {"query", "key", "value", "out", "fc1", "fc2"}
  assert {(r.name, r.path) for r in roles if r.name in ("query", "out")} == {
      ("query", "attention/query"), ("out", "attention/out")}
  assert {(r.module_type, r.tensor_type) for r in roles if r.name == "out"} == {
      ("linear", t) for t in ("input", "weight", "grad_output")}


@pytest.mark.parametrize("swap, names", [
    (dict(dense_general=False), {"fc1", "fc2"}),
    (dict(dense=False), {"query", "key", "value", "out"}),
    (dict(dense=False, dense_general=False), set()),
])
def test_each_layer_type_can_be_opted_out(rng, swap, names):
  assert {r.name for r in _roles(_Block(), _x(rng), **swap)} == names


def test_options_are_checked():
  with pytest.raises(TypeError, match="einsum='yes'; expected True or False"):
    with jf.quantize_dense(RECIPE, einsum="yes"):
      pass


class _Einsums(nn.Module):
  """A supported equation whose output order differs from the kernel's (bias permuted), an
  ellipsis, a per-head (batched) kernel; then an equation one GEMM cannot express."""

  @nn.compact
  def __call__(self, x):
    h = nn.Einsum((D, 8, HEADS), "bsd,dkh->bhsk", name="heads")(x)  # [B, HEADS, L, 8]
    y = nn.Einsum((8, D), "...k,kd->...d", name="merge")(h)  # [B, HEADS, L, D]
    z = nn.Einsum((HEADS, D, D), "bhsd,hde->bhse", name="per_head")(y)  # one GEMM per head
    return nn.Einsum((D, D), "bhsd,de->bhe", name="pool")(z)  # sums s: not one GEMM


def test_einsum_equals_hand_built_jaxquant_dense(rng):
  x = _x(rng)
  model = _Einsums()
  plain = _jit_init(model, x)
  with jf.quantize_dense(RECIPE):
    variables = _jit_init(model, x)
    got = jax.jit(model.apply)(variables, x)
  assert_same_leaves(variables, plain, "parameters")
  p = variables["params"]

  def hand(x):
    q = lambda name: jq.DenseQuantizers.from_recipe(RECIPE, "linear", name)
    kernel = jnp.transpose(p["heads"]["kernel"], (0, 1, 2))  # [d, k, h]: contracted d first
    bias = jnp.transpose(p["heads"]["bias"], (1, 0))  # Flax's [h, k] -> the kernel's [k, h]
    h = jq.dense(x, kernel, bias, q("heads"))  # [b, s, k, h]
    h = jnp.transpose(h, (0, 3, 1, 2))  # -> bhsk
    y = jq.dense(h, p["merge"]["kernel"], p["merge"]["bias"], q("merge"))
    per_head = p["per_head"]
    z = jax.vmap(lambda yh, kh, bh: jq.dense(yh, kh, bh, q("per_head")))(
        jnp.transpose(y, (1, 0, 2, 3)), per_head["kernel"], per_head["bias"])  # [h, b, s, e]
    z = jnp.transpose(z, (1, 0, 2, 3))
    return jnp.einsum("bhsd,de->bhe", z, p["pool"]["kernel"]) + p["pool"]["bias"]

  assert_same_leaves(got, jax.jit(hand)(x), "einsum outputs")


def test_einsum_it_cannot_express_is_reported_and_left_to_flax(rng):
  x = _x(rng)
  model = _Einsums()
  with jf.quantize_dense(RECIPE):
    variables = jax.eval_shape(model.init, jax.random.key(0), x)  # explain only traces
    report = jq.explain(model.apply, variables, x)
  skipped = [d for d in report if d.path == "not-quantized"]
  assert [d.role.name for d in skipped] == ["pool"], str(report)
  assert "input axis 's' is summed without the weight" in skipped[0].reason
  assert {d.role.name for d in report if d.op == "quantize"} == {"heads", "merge", "per_head"}


@pytest.mark.parametrize("equation, why", [
    ("bi,ii->bi", "axis 'i' repeats in the weight"),
    ("bij,jk->bk", "input axis 'i' is summed without the weight"),
    ("bj,jk->b", "weight axis 'k' is summed without the input"),
    ("bi,k->bik", "outer or elementwise product"),
    ("bi,...->bi", "ellipsis in the weight"),
])
def test_einsum_equations_that_stay_unquantized(equation, why):
  lhs, rhs = equation.split("->")[0].split(",")
  plan, reason = plan_module_einsum(equation, len(lhs), len(rhs))
  assert plan is None and why in reason


@pytest.mark.parametrize("model", [_Block(), _Einsums()], ids=["attention+mlp", "einsums"])
def test_identity_recipe_equals_the_unswapped_model_bitwise(rng, model):
  """An all-Identity recipe runs each layer's own Flax contraction, differentiated by JAX: the
  swapped model is Flax's, outputs and gradients bit for bit."""
  x = _x(rng)
  variables = _jit_init(model, x)
  value_and_grad = jax.value_and_grad(lambda v, x: jnp.mean(model.apply(v, x) ** 2),
                                      argnums=(0, 1))
  want = jax.jit(value_and_grad)(variables, x)
  with jf.quantize_dense(jq.CustomRecipe(lambda role: jq.IdentityQuantizer())):
    got = jax.jit(value_and_grad)(variables, x)
    report = jq.explain(model.apply, variables, x)
  # every contraction is Flax's own; "pool" sums an axis within one operand: never quantized
  assert ("gemm", "high-precision") in {(d.op, d.path) for d in report}
  assert {d.path for d in report} <= {"high-precision", "not-quantized"}
  for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want), strict=True):
    assert a.dtype == b.dtype and a.shape == b.shape
    np.testing.assert_array_equal(np.atleast_1d(a).view(np.uint8), np.atleast_1d(b).view(np.uint8))
