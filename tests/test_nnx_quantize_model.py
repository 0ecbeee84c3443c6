"""`jaxquant.nnx.quantize_model`: an unmodified NNX model's Linear / LinearGeneral / Einsum
swapped in place, parameters untouched, numbers those of hand-built `jaxquant.dense`
contractions, and the modules `jaxquant.nnx.LinearGeneral` / `Einsum` themselves."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxquant as jq
import jaxquant.nnx as jnnx
from jaxquant.layers.dense import DenseQuantizers

IDENTITY = jq.CustomRecipe(lambda role: jq.IdentityQuantizer())
D, HEADS, HEAD_DIM = 32, 2, 16


class Attention(nnx.Module):
  """Gemma-style attention: one einsum for q, k and v, one for the output projection."""

  def __init__(self, rngs: nnx.Rngs, partitioned: bool = False):
    init = nnx.initializers.lecun_normal()
    if partitioned:  # needs a mesh with axes "tp" and "fsdp" at construction
      init = nnx.with_partitioning(init, (None, "tp", "fsdp", None))
    self.qkv_einsum = nnx.Einsum("BTD,SNDH->SBTNH", (3, HEADS, D, HEAD_DIM), kernel_init=init,
                                 rngs=rngs)
    self.attn_vec_einsum = nnx.Einsum("BTNH,NHD->BTD", (HEADS, HEAD_DIM, D), (D,), rngs=rngs)

  def __call__(self, x):
    q, k, v = self.qkv_einsum(x)
    logits = jnp.einsum("BTNH,BSNH->BNTS", q, k) / np.sqrt(HEAD_DIM)
    return self.attn_vec_einsum(jnp.einsum("BNTS,BSNH->BTNH", jax.nn.softmax(logits), v))


class Block(nnx.Module):
  def __init__(self, rngs: nnx.Rngs, shared: nnx.Linear, partitioned: bool = False):
    self.attn = Attention(rngs, partitioned)
    self.mlp = nnx.List([nnx.Linear(D, 2 * D, rngs=rngs), nnx.Linear(2 * D, D, rngs=rngs)])
    self.heads = nnx.LinearGeneral(D, (HEADS, HEAD_DIM), rngs=rngs)
    self.shared = shared

  def __call__(self, x):
    x = x + self.attn(x)
    x = x + self.mlp[1](jax.nn.gelu(self.mlp[0](x)))
    x = x + self.heads(x).reshape(x.shape)
    return self.shared(x)


class Model(nnx.Module):
  def __init__(self, rngs: nnx.Rngs, layers: int = 2, partitioned: bool = False):
    shared = nnx.Linear(D, D, rngs=rngs)  # one module used by every block
    self.layers = nnx.List([Block(rngs, shared, partitioned) for _ in range(layers)])

  def __call__(self, x):
    for layer in self.layers:
      x = layer(x)
    return x


PATHS = {f"layers/{i}/{p}" for i in range(2) for p in (
    "attn/qkv_einsum", "attn/attn_vec_einsum", "mlp/0", "mlp/1", "heads", "shared")}


def _x(rng, shape=(2, 8, D)):
  return jnp.asarray(rng.standard_normal(shape), jnp.float32)


def _assert_bitwise_equal(a, b):
  a, b = np.atleast_1d(np.asarray(a)), np.atleast_1d(np.asarray(b))
  assert a.dtype == b.dtype and a.shape == b.shape
  np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))


def _param_table(model):
  return {path: (variable, variable.shape, variable.dtype, np.asarray(variable.get_value()),
                 dict(variable.get_metadata()))
          for path, variable in nnx.to_flat_state(nnx.state(model, nnx.Param))}


# ------------------------------------------------------------------ the swap -----------------

def test_param_state_is_unchanged_by_the_swap(rng):
  with jax.set_mesh(jax.make_mesh((1, 1), ("tp", "fsdp"))):
    model = Model(nnx.Rngs(0), partitioned=True)
  before = _param_table(model)
  same, swaps = jnnx.quantize_model(model, jq.DelayedScaling(amax_history_len=4))
  assert same is model
  after = _param_table(model)
  assert list(after) == list(before)  # paths and their order
  for path, (variable, shape, dtype, value, metadata) in before.items():
    variable2, shape2, dtype2, value2, metadata2 = after[path]
    assert variable2 is variable  # the same nnx.Param objects, not copies
    assert (shape2, dtype2) == (shape, dtype)
    _assert_bitwise_equal(value2, value)
    assert metadata2 == metadata
  assert after[("layers", 0, "attn", "qkv_einsum", "kernel")][4]["out_sharding"] == (
      None, "tp", "fsdp", None)
  # what the swap added: delayed-scaling state next to the params, never a Param
  added = {p for p, _ in nnx.to_flat_state(nnx.state(model, jnnx.OverwriteWithGradient))}
  assert ("layers", 1, "attn", "qkv_einsum", "weight_amax_history") in added
  assert {s.path for s in swaps} == PATHS - {"layers/1/shared"}


def test_every_kind_at_any_depth_is_swapped_and_a_shared_module_once(rng):
  model = Model(nnx.Rngs(0))
  _, swaps = jnnx.quantize_model(model, jq.Float8CurrentScaling())
  kinds = {s.path.split("/", 2)[2]: (s.original, type(s.module)) for s in swaps
           if s.path.startswith("layers/0/")}
  assert kinds == {"attn/qkv_einsum": (nnx.Einsum, jnnx.Einsum),
                   "attn/attn_vec_einsum": (nnx.Einsum, jnnx.Einsum),
                   "mlp/0": (nnx.Linear, jnnx.Linear), "mlp/1": (nnx.Linear, jnnx.Linear),
                   "heads": (nnx.LinearGeneral, jnnx.LinearGeneral),
                   "shared": (nnx.Linear, jnnx.Linear)}
  assert model.layers[0].shared is model.layers[1].shared  # still one module
  assert isinstance(model.layers[1].shared, jnnx.Linear)
  assert all(s.quantized for s in swaps)


def test_custom_contractions_and_subclasses_are_left_alone():
  class MyLinear(nnx.Linear):
    pass

  holder = nnx.List([MyLinear(4, 4, rngs=nnx.Rngs(0)),
                     nnx.Linear(4, 4, dot_general=lambda *a, **k: jax.lax.dot_general(*a, **k),
                                rngs=nnx.Rngs(0)),
                     nnx.Einsum("bd,df->bf", (4, 4), einsum_op=lambda *a, **k: 0,
                                rngs=nnx.Rngs(0)),
                     nnx.Linear(4, 4, rngs=nnx.Rngs(0))])
  _, swaps = jnnx.quantize_model(holder, jq.Float8CurrentScaling())
  assert [s.path for s in swaps] == ["3"]
  assert [type(m) for m in holder] == [MyLinear, nnx.Linear, nnx.Einsum, jnnx.Linear]


def test_a_swapped_root_module_is_returned():
  layer = nnx.Linear(8, 4, rngs=nnx.Rngs(0))
  new, swaps = jnnx.quantize_model(layer, jq.Float8CurrentScaling())
  assert isinstance(new, jnnx.Linear) and new.kernel is layer.kernel
  assert [(s.path, s.module) for s in swaps] == [("", new)]


def test_include_and_exclude_select_by_path():
  model = Model(nnx.Rngs(0))
  _, swaps = jnnx.quantize_model(model, jq.Float8CurrentScaling(), include="*/mlp/*",
                                 exclude=["layers/1/*"])
  assert [s.path for s in swaps] == ["layers/0/mlp/0", "layers/0/mlp/1"]
  assert type(model.layers[1].mlp[0]) is nnx.Linear
  assert type(model.layers[0].attn.qkv_einsum) is nnx.Einsum


@pytest.mark.parametrize("argument", ["include", "exclude"])
def test_a_pattern_that_matches_nothing_is_an_error(argument):
  with pytest.raises(ValueError, match=rf"{argument}=.*'\*/mpl/\*' matches none of the"):
    jnnx.quantize_model(Model(nnx.Rngs(0)), jq.Float8CurrentScaling(),
                        **{argument: "*/mpl/*"})


def test_roles_carry_the_attribute_name_and_the_full_path(rng):
  seen = set()

  def factory(role):
    if role is not None:
      seen.add((role.module_type, role.tensor_type, role.name, role.path))
    return jq.IdentityQuantizer()

  model = Model(nnx.Rngs(0))
  jnnx.quantize_model(model, jq.CustomRecipe(factory))
  x = _x(rng)
  # traced only: the roles are asked for while tracing (run eagerly, op by op, ~13 CPU-s)
  nnx.eval_shape(lambda m: nnx.grad(lambda m: jnp.sum(m(x)))(m), model)
  assert ("linear", "weight", "qkv_einsum", "layers/0/attn/qkv_einsum") in seen
  assert ("linear", "grad_output", "1", "layers/1/mlp/1") in seen
  assert {path for *_, path in seen} == PATHS - {"layers/1/shared"}
  # the path takes no part in equality: short-name dispatch keeps working
  assert jq.QuantizerRole("linear", "weight", "heads", "layers/0/heads") == jq.QuantizerRole(
      "linear", "weight", "heads")


def test_an_existing_optimizer_keeps_working(rng):
  model = Model(nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)  # made before the swap
  jnnx.quantize_model(model, jq.Float8CurrentScaling())
  x = _x(rng)

  @nnx.jit
  def step(model, optimizer):
    loss, grads = nnx.value_and_grad(lambda m: jnp.mean(jnp.square(m(x) - x)))(model)
    optimizer.update(model, grads)
    return loss

  kernel = np.asarray(model.layers[0].attn.qkv_einsum.kernel[...])
  losses = [float(step(model, optimizer)) for _ in range(5)]
  assert losses[-1] < losses[0]
  assert not np.array_equal(kernel, np.asarray(model.layers[0].attn.qkv_einsum.kernel[...]))


# --------------------------------------------------------------- numerics --------------------

# name -> (module factory, input shape). GEMM rows are a multiple of 32 (NVFP4's RHT wants 16
# along the wgrad contraction).
LAYERS = {
    "linear": (lambda r: nnx.Linear(D, 24, rngs=r), (4, 8, D)),
    "linear_general": (lambda r: nnx.LinearGeneral((2, D), (4, 8), axis=(-2, -1), rngs=r),
                       (32, 2, D)),
    "linear_general_batch": (lambda r: nnx.LinearGeneral(D, (4, 8), batch_axis={0: 4},
                                                         rngs=r), (4, 32, D)),
    "einsum_qkv": (lambda r: nnx.Einsum("BTD,SNDH->SBTNH", (3, 2, D, 16), rngs=r), (4, 8, D)),
    "einsum_out": (lambda r: nnx.Einsum("BTNH,NHD->BTD", (2, 16, D), (D,), rngs=r),
                   (4, 8, 2, 16)),
    "einsum_head_batch": (lambda r: nnx.Einsum("BNTH,NHD->BNTD", (2, 32, D), rngs=r),
                          (4, 2, 8, 32)),
    "einsum_ellipsis": (lambda r: nnx.Einsum("...D,DF->...F", (D, 16), (16,), rngs=r),
                        (4, 8, D)),
}


def _swapped(make, recipe, rngs=None):
  holder = nnx.List([make(nnx.Rngs(0))])
  jnnx.quantize_model(holder, recipe, rngs=rngs)
  return holder[0]


def _forward_and_grads(module, x, c, **call):
  """(y, dx, dkernel) of `sum(module(x) * c)` from one compiled program (y its aux output)."""

  def loss(m, x):
    y = m(x, **call)
    return jnp.sum(y * c), y

  (_, y), (g, gx) = nnx.jit(nnx.value_and_grad(loss, argnums=(0, 1), has_aux=True))(module, x)
  return y, gx, g["kernel"][...]


def _param_grads(g):
  return {path: value for path, value in nnx.to_flat_state(nnx.state(g, nnx.Param))}


@pytest.mark.parametrize("layer", LAYERS)
def test_identity_recipe_equals_the_unswapped_layer(rng, core_backend, layer):
  """Bit for bit, outputs and every gradient (input, kernel, bias): an all-Identity contraction
  runs the original module's own `dot_general` / `jnp.einsum`, differentiated by JAX."""
  make, shape = LAYERS[layer]
  x = _x(rng, shape)
  flax_layer, swapped = make(nnx.Rngs(0)), _swapped(make, IDENTITY)
  c = _x(rng, nnx.eval_shape(lambda m: m(x), flax_layer).shape)

  def loss(m, x):
    y = m(x)
    return jnp.sum(y * c), y

  # y and the gradients from one program per side (two each before: ~5 CPU-s in all)
  step = nnx.jit(nnx.value_and_grad(loss, argnums=(0, 1), has_aux=True))
  ((_, y), (g, gx)), ((_, y_ref), (g_ref, gx_ref)) = step(swapped, x), step(flax_layer, x)
  _assert_bitwise_equal(y, y_ref)
  _assert_bitwise_equal(gx, gx_ref)
  got, want = _param_grads(g), _param_grads(g_ref)
  assert list(got) == list(want) and len(got) == 1 + (flax_layer.bias is not None)
  for path in want:
    _assert_bitwise_equal(got[path].get_value(), want[path].get_value())
  report = jq.explain(lambda: swapped(x))
  assert [(d.op, d.path) for d in report] == [("quantize", "high-precision")] * 3 + [
      ("gemm", "high-precision")]
  assert [d.role.tensor_type for d in report[:3]] == ["input", "weight", "grad_output"]


def test_identity_recipe_equals_the_unswapped_model(rng, core_backend):
  x = _x(rng)
  flax_model, model = Model(nnx.Rngs(0)), Model(nnx.Rngs(0))
  jnnx.quantize_model(model, IDENTITY)

  def loss(m, x):
    y = m(x)
    return jnp.mean(jnp.square(y)), y

  step = nnx.jit(nnx.value_and_grad(loss, argnums=(0, 1), has_aux=True))  # y and gradients
  ((_, y), (g, gx)), ((_, y_ref), (g_ref, gx_ref)) = step(model, x), step(flax_model, x)
  _assert_bitwise_equal(y, y_ref)
  _assert_bitwise_equal(gx, gx_ref)
  got, want = _param_grads(g), _param_grads(g_ref)
  assert list(got) == list(want) and len(got) == 2 * 9 + 2  # 9 per block, 2 of the shared Linear
  for path in want:
    _assert_bitwise_equal(got[path].get_value(), want[path].get_value())


def _hand_built(layer, module, recipe, x, kernel, key):
  """The layer's contraction written out with `jaxquant.dense` (no module, no plan)."""
  quantizers = DenseQuantizers.from_recipe(recipe, "linear", "0", "0")

  def dense(x, kernel, bias=None, contracting_dims=1, key=key, batch=()):
    states = None
    if quantizers.stateful:
      states = jax.tree.map(lambda s: jnp.broadcast_to(s, batch + s.shape),
                            quantizers.init_states())
    return jq.dense(x, kernel, bias, quantizers, key=key, states=states,
                    contracting_dims=contracting_dims)

  bias = module.bias[...] if module.bias is not None else None
  if layer == "linear":
    return dense(x, kernel, bias)
  if layer == "linear_general":
    return dense(x, kernel, bias, contracting_dims=2)
  if layer == "linear_general_batch":  # vmap over the batch axis, one key per element
    keys = None if key is None else jax.random.split(key, 4)
    return jax.vmap(lambda x, k, b, kk: dense(x, k, b, key=kk))(x, kernel, bias, keys)
  if layer == "einsum_qkv":  # [K=D, N=(S, N, H)], output [S, B, T, N, H]
    y = dense(x, kernel.transpose(2, 0, 1, 3))
    return y.transpose(2, 0, 1, 3, 4)
  if layer == "einsum_out":  # K = (H, N) in letter order
    y = dense(x.transpose(0, 1, 3, 2), kernel.transpose(1, 0, 2), contracting_dims=2)
    return y + bias
  if layer == "einsum_head_batch":  # N is a batch axis: [N, B, T, H] x [N, H, D]
    keys = None if key is None else jax.random.split(key, 2)
    y = jax.vmap(lambda x, k, kk: dense(x, k, key=kk))(x.transpose(1, 0, 2, 3), kernel, keys)
    return y.transpose(1, 0, 2, 3)
  if layer == "einsum_ellipsis":
    return dense(x, kernel) + bias
  raise AssertionError(layer)


# The swap does not depend on the format, except where the recipe needs a key (NVFP4's stochastic
# rounding and RHT), a state (delayed scaling) or whole 2-D weight blocks in the layer's kernel
# layout (NVFP4's 16x16, Float8Block's 128x128): delayed scaling takes every layer; NVFP4 the
# layers whose keys or kernel layout differ (one key per batch element, 2 contracting axes, a
# transposed 4-D kernel); Float8Block (its 128x128 block is the whole kernel at these sizes)
# the two layouts NVFP4 skips, so every layer meets 2-D weight blocks; per-tensor current
# scaling and MXFP8, which need none of that, one layer each. (NVFP4 and Float8Block on every
# layer took ~45 CPU-s more; the two NVFP4 skips are [K, N] and [N, H, D] kernels like ones it
# takes.)
FEW_LAYERS = {"fp8_current": ("einsum_head_batch",), "mxfp8": ("linear_general_batch",),
              "nvfp4": ("linear", "linear_general", "linear_general_batch", "einsum_qkv",
                        "einsum_head_batch"),
              "fp8_block": ("einsum_out", "einsum_ellipsis")}


@pytest.mark.parametrize("layer", LAYERS)
@pytest.mark.parametrize("recipe_name", sorted(jq.BUILTIN_RECIPES))
def test_swapped_layer_equals_hand_built_dense(rng, core_backend, recipe_name, layer):
  if layer not in FEW_LAYERS.get(recipe_name, LAYERS):
    pytest.skip(f"{recipe_name} runs on {FEW_LAYERS[recipe_name]} (the swap is the same code)")
  recipe = jq.BUILTIN_RECIPES[recipe_name]()
  make, shape = LAYERS[layer]
  module = _swapped(make, recipe, rngs=nnx.Rngs(quantize=0))
  x, key = _x(rng, shape), jax.random.key(int(rng.integers(1 << 30)))
  c = _x(rng, nnx.eval_shape(lambda: module(x, rngs=key)).shape)
  y, gx, gk = _forward_and_grads(module, x, c, rngs=key)

  kernel = module.kernel[...]

  def ref_loss(x, k):
    y = _hand_built(layer, module, recipe, x, k, key)
    return jnp.sum(y * c), y

  (_, y_ref), (gx_ref, gk_ref) = jax.jit(jax.value_and_grad(ref_loss, argnums=(0, 1),
                                                            has_aux=True))(x, kernel)
  _assert_bitwise_equal(y, y_ref)
  _assert_bitwise_equal(gx, gx_ref)
  _assert_bitwise_equal(gk, gk_ref)
  assert not np.array_equal(np.asarray(y), np.asarray(make(nnx.Rngs(0))(x)))  # quantized


def _hand_built_model(model, recipe, x, key):
  """`Model`'s forward written out with `jaxquant.dense`, one contraction per module, each with
  its module's roles (name and path) and fresh delayed-scaling states."""

  def dense(module, path, x, kernel, bias=None, contracting_dims=1):
    quantizers = DenseQuantizers.from_recipe(recipe, "linear", path.rsplit("/", 1)[-1], path)
    states = quantizers.init_states() if quantizers.stateful else None
    return jq.dense(x, kernel, bias, quantizers, key=key, states=states,
                    contracting_dims=contracting_dims)

  for i, block in enumerate(model.layers):
    p, attn = f"layers/{i}", block.attn
    q, k, v = dense(attn.qkv_einsum, f"{p}/attn/qkv_einsum", x,
                    attn.qkv_einsum.kernel[...].transpose(2, 0, 1, 3)).transpose(2, 0, 1, 3, 4)
    logits = jnp.einsum("BTNH,BSNH->BNTS", q, k) / np.sqrt(HEAD_DIM)
    mixed = jnp.einsum("BNTS,BSNH->BTNH", jax.nn.softmax(logits), v)
    out = attn.attn_vec_einsum
    x = x + (dense(out, f"{p}/attn/attn_vec_einsum", mixed.transpose(0, 1, 3, 2),
                   out.kernel[...].transpose(1, 0, 2), contracting_dims=2) + out.bias[...])
    fc1, fc2 = block.mlp
    h = jax.nn.gelu(dense(fc1, f"{p}/mlp/0", x, fc1.kernel[...], fc1.bias[...]))
    x = x + dense(fc2, f"{p}/mlp/1", h, fc2.kernel[...], fc2.bias[...])
    x = x + dense(block.heads, f"{p}/heads", x, block.heads.kernel[...],
                  block.heads.bias[...]).reshape(x.shape)
    x = dense(block.shared, "layers/0/shared", x, block.shared.kernel[...],
              block.shared.bias[...])
  return x


# The whole model under delayed scaling (a state per module, the shared module's once). The
# forward uses no key (NVFP4 draws random bits for its gradients only), so an NVFP4 model (~30
# CPU-s) checked nothing the layers do not: NVFP4 meets the layer kinds, with gradients, in
# test_swapped_layer_equals_hand_built_dense.
@pytest.mark.parametrize("recipe_name", ["fp8_delayed"])
def test_swapped_model_equals_hand_built_dense(rng, core_backend, recipe_name):
  """The whole swapped model (lists, a shared module, einsum / Linear / LinearGeneral layouts,
  roles named by path) computes its hand-built `jaxquant.dense` contractions bit for bit."""
  recipe = jq.BUILTIN_RECIPES[recipe_name]()
  seen = []
  recording = jq.CustomRecipe(lambda role: seen.append(role) or recipe.quantizer(role))
  model = Model(nnx.Rngs(0))
  jnnx.quantize_model(model, recording, rngs=nnx.Rngs(quantize=0))
  x, key = _x(rng), jax.random.key(int(rng.integers(1 << 30)))
  y = nnx.jit(lambda m, x: m(x))(model, x)
  y_ref = jax.jit(lambda x: _hand_built_model(model, recipe, x, key))(x)
  _assert_bitwise_equal(y, y_ref)
  assert not np.array_equal(np.asarray(y), np.asarray(Model(nnx.Rngs(0))(x)))  # quantized
  assert {r.path for r in seen} == PATHS - {"layers/1/shared"}


def test_delayed_scaling_advances_under_nnx_jit(rng):
  history, steps = 3, 4
  holder = nnx.List([nnx.Einsum("BNTH,NHD->BNTD", (2, 16, D), rngs=nnx.Rngs(0))])
  jnnx.quantize_model(holder, jq.DelayedScaling(amax_history_len=history))
  layer = holder[0]
  optimizer = nnx.Optimizer(holder, optax.sgd(0.05), wrt=nnx.Param)

  @nnx.jit
  def step(model, optimizer, x, c):
    grads = nnx.grad(lambda m: jnp.sum(m[0](x) * c), argnums=jnnx.diff_state(0))(model)
    jnnx.apply_gradients(optimizer, model, grads)

  amaxes = {"input": [], "weight": [], "grad_output": []}  # per head (the batch axis N)
  for s in rng.uniform(0.5, 4.0, steps):
    x, c = _x(rng, (4, 2, 6, 16)) * s, _x(rng, (4, 2, 6, D)) * s
    amaxes["input"].append(np.abs(np.asarray(x)).max(axis=(0, 2, 3)))
    amaxes["weight"].append(np.abs(np.asarray(layer.kernel[...])).max(axis=(1, 2)))
    amaxes["grad_output"].append(np.abs(np.asarray(c)).max(axis=(0, 2, 3)))
    step(holder, optimizer, x, c)

  fmax = {"input": 448.0, "weight": 448.0, "grad_output": 57344.0}
  for tensor, values in amaxes.items():  # docs/design.md §5 "Numerics", by hand, each head
    hist, scale = np.zeros((2, history), np.float32), np.ones(2, np.float32)
    for amax in values:
      hist[:, 0] = amax
      scale = (np.float32(fmax[tensor]) / hist.max(axis=1)).astype(np.float32)
      hist = np.roll(hist, -1, axis=1)
      hist[:, 0] = 0.0
    np.testing.assert_array_equal(getattr(layer, f"{tensor}_amax_history")[...], hist)
    np.testing.assert_array_equal(getattr(layer, f"{tensor}_scale")[...], scale)


def test_autocast_reaches_modules_swapped_without_a_recipe(rng, core_backend):
  seen = []
  recording = jq.CustomRecipe(lambda r: seen.append(r) or jq.IdentityQuantizer())
  model, flax_model = Model(nnx.Rngs(0)), Model(nnx.Rngs(0))
  jnnx.quantize_model(model, None)
  x = _x(rng)
  y_flax = nnx.jit(lambda m: m(x))(flax_model)
  _assert_bitwise_equal(nnx.jit(lambda m: m(x))(model), y_flax)
  assert not seen
  # The recipe is read while tracing: the recording traced only, the FP8 model in one compiled
  # program inside the context (both ran eagerly before, op by op: ~10 CPU-s).
  with jq.autocast(recording):
    nnx.eval_shape(lambda m: m(x), model)
  assert {r.path for r in seen if r is not None} == PATHS - {"layers/1/shared"}
  fp8 = jq.Float8CurrentScaling()
  with jq.autocast(fp8):
    y_fp8 = nnx.jit(lambda m: m(x))(model)
  assert not np.array_equal(np.asarray(y_fp8), np.asarray(y_flax))


def test_stochastic_rounding_draws_from_the_quantize_stream_given_to_the_swap(rng):
  make = lambda r: nnx.Linear(D, 16, rngs=r)
  x = _x(rng, (16, D))
  c = jnp.cos(jnp.arange(16 * 16, dtype=jnp.float32) * 0.37).reshape(16, 16)
  grad = lambda m: nnx.grad(lambda m: jnp.sum(m(x) * c))(m)["kernel"][...]
  with pytest.raises(ValueError, match=r"quantize_model\(rngs=...\).*stochastically"):
    _swapped(make, jq.NVFP4BlockScaling())
  same = [grad(_swapped(make, jq.NVFP4BlockScaling(), nnx.Rngs(quantize=1))) for _ in range(2)]
  _assert_bitwise_equal(same[0], same[1])
  other = grad(_swapped(make, jq.NVFP4BlockScaling(), nnx.Rngs(quantize=2)))
  assert not np.array_equal(np.asarray(same[0]), np.asarray(other))


# ----------------------------------------------------------- einsums that do not fit ---------

@pytest.mark.parametrize("equation, kernel_shape, x_shape, why", [
    ("BTD,DH->BT", (D, 4), (2, 3, D), "weight axis 'H' is summed without the input"),
    ("BTD,DH->BH", (D, 4), (2, 3, D), "input axis 'T' is summed without the weight"),
    ("BDD,DH->BH", (D, 4), (2, D, D), "axis 'D' repeats in the input"),
    ("BT,HF->BTHF", (4, 5), (2, 3), "no axis of the input is contracted with the weight"),
    ("BTD,D...->BT...", (D, 4), (2, 3, D), "an ellipsis in the weight"),
])
def test_an_einsum_the_contraction_cannot_express_is_a_clear_error(equation, kernel_shape,
                                                                   x_shape, why):
  with pytest.raises(ValueError, match=rf"einsum '{equation.replace('.', '[.]')}' cannot run as "
                                       rf"a quantized contraction: {why}"):
    jnnx.Einsum(equation, kernel_shape, recipe=jq.Float8CurrentScaling(), rngs=nnx.Rngs(0))
  # given at the call instead
  layer = jnnx.Einsum(None, kernel_shape, recipe=jq.Float8CurrentScaling(), rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=why):
    layer(jnp.ones(x_shape), equation)


def test_quantize_model_keeps_an_unfitting_einsum_in_high_precision_and_says_why(rng):
  make = lambda r: nnx.Einsum("BTD,DH->BT", (D, 4), rngs=r)
  flax_layer = make(nnx.Rngs(0))
  holder = nnx.List([make(nnx.Rngs(0))])
  _, swaps = jnnx.quantize_model(holder, jq.Float8CurrentScaling())
  assert not swaps[0].quantized and "weight axis 'H' is summed" in swaps[0].reason
  x = _x(rng, (2, 3, D))
  _assert_bitwise_equal(nnx.jit(lambda m: m(x))(holder[0]), nnx.jit(lambda m: m(x))(flax_layer))
  report = jq.explain(lambda: holder[0](x))
  assert [(d.op, d.path) for d in report] == [("einsum", "high-precision")]
  assert "weight axis 'H' is summed" in report[0].reason and "0" in str(report[0].role)


# ------------------------------------------------------ the modules themselves ---------------

def test_same_rngs_give_flax_parameters():
  pairs = [(nnx.LinearGeneral, jnnx.LinearGeneral, ((6, D), (4, 8)), dict(axis=(-2, -1))),
           (nnx.LinearGeneral, jnnx.LinearGeneral, (D, (4, 8)), dict(batch_axis={0: 4})),
           (nnx.Einsum, jnnx.Einsum, ("BTD,SNDH->SBTNH", (3, 2, D, 8), (3, 2, 8)), {})]
  for flax_cls, ours_cls, args, kwargs in pairs:
    ref, ours = flax_cls(*args, **kwargs, rngs=nnx.Rngs(3)), ours_cls(*args, **kwargs,
                                                                    rngs=nnx.Rngs(3))
    assert set(nnx.state(ours, nnx.Param)) == {"kernel", "bias"}
    _assert_bitwise_equal(ours.kernel[...], ref.kernel[...])
    _assert_bitwise_equal(ours.bias[...], ref.bias[...])


def test_per_head_delayed_state_has_the_batch_shape():
  layer = jnnx.Einsum("BNTH,NHD->BNTD", (2, 16, D), recipe=jq.DelayedScaling(
      amax_history_len=5), rngs=nnx.Rngs(0))
  assert layer.input_amax_history.shape == (2, 5) and layer.weight_scale.shape == (2,)
  general = jnnx.LinearGeneral(D, 8, batch_axis={0: 3}, recipe=jq.DelayedScaling(
      amax_history_len=5), rngs=nnx.Rngs(0))
  assert general.grad_output_amax_history.shape == (3, 5)
