"""Each weight quantized once per optimizer step, and one input's quantization shared (issue 24).

The counts come from the compiled training step of `examples/lm` on the FFI path (its CPU
handlers): every `jaxquant_quantize_*` custom call whose operand is a kernel `[K, N]` (quantized
as stored, its copies swapped: `copies_swap_with_transpose`) or a transposed one `[N, K]` is a
weight quantization, counted as many times as it runs (`jaxquant.hlo`: a call in
a `while` body runs its trip count times: `nn.scan` over layers, `lax.scan` over micro-batches).
The model's sizes keep every weight shape apart from every activation shape.
"""

from __future__ import annotations

import dataclasses
import functools
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxquant as jq
import jaxquant.flax as jqf
from jaxquant import hlo
from jaxquant.backends.ffi import registry
from jaxquant.layers.operands import Operand

from lm import model as model_lib  # examples/ is on pytest's pythonpath (pyproject.toml)
from lm import training

needs_ffi = pytest.mark.skipif(not registry.extension_built(),
                               reason="the FFI extension (its CPU handlers) is not built")

# 8 x 20 = 160 token rows (40 per micro-batch of 4); weights [192|64|256, 64] and [64, 192].
CONFIG = model_lib.LMConfig(seq=20, d_model=64, layers=2, heads=2, mlp_ratio=3,
                            dtype=jnp.bfloat16)
BATCH = 8
RECIPES = {"fp8_current": jq.Float8CurrentScaling, "fp8_delayed": jq.DelayedScaling}


@pytest.fixture
def ffi_backend(monkeypatch):
  monkeypatch.setenv("JAXQUANT_BACKEND", "ffi")


def _tokens(seed: int) -> np.ndarray:
  rng = np.random.default_rng(seed)
  return rng.integers(0, CONFIG.vocab, (BATCH, CONFIG.seq + 1)).astype(np.int32)


def _kernels(params) -> list[tuple[int, ...]]:
  """Every quantized kernel (the token embedding is not one), one entry per layer."""
  found = []
  for path, leaf in jax.tree_util.tree_leaves_with_path(params["params"]):
    name = jax.tree_util.keystr(path)
    if name.endswith("['kernel']"):
      found += [tuple(leaf.shape[-2:])] * (leaf.shape[0] if leaf.ndim == 3 else 1)
  return found


def _weight_quantizations(text: str, kernels) -> int:
  either_way = {(k, n) for k, n in kernels} | {(n, k) for k, n in kernels}
  return sum(c.executions for c in hlo.custom_calls(text)
             if c.target.startswith("jaxquant_quantize") and c.operands
             and c.operands[0][1] in either_way)


def _compiled_step(config, recipe, seed, grad_accum=1):
  model = model_lib.GPT(config, recipe)
  tokens = _tokens(seed)
  state = training.create_state(model, tokens, training.TrainConfig(grad_accum=grad_accum))
  step, _ = training.make_steps(model, grad_accum=grad_accum)
  text = step.lower(state, jnp.asarray(tokens), jax.random.key(seed)).compile().as_text()
  return text, _kernels(state.params)


@needs_ffi
@pytest.mark.parametrize("recipe", sorted(RECIPES))
@pytest.mark.parametrize("scan", [False, True], ids=["unrolled", "scanned"])
def test_remat_quantizes_each_weight_once_per_step(ffi_backend, recipe, scan, seed):
  """`--remat` recomputes each block's forward in the backward; `jaxquant.remat_policy()` keeps
  the quantized weights, so the recomputed forward does not quantize them again. (Before, the
  scanned model quantized each block weight twice: 17 for these 9 weights.)"""
  if recipe == "fp8_delayed" and scan:
    pytest.skip("test_grad_accum_quantizes_each_weight_once_per_step[scanned] counts a "
                "scanned, rematerialized delayed-scaling step (this case took ~8 CPU-s)")
  config = dataclasses.replace(CONFIG, remat=True, scan_layers=scan)
  text, kernels = _compiled_step(config, RECIPES[recipe](), seed)
  assert len(kernels) == 9
  assert _weight_quantizations(text, kernels) == len(kernels)


@needs_ffi
@pytest.mark.parametrize("scan", [False, True], ids=["unrolled", "scanned"])
def test_grad_accum_quantizes_each_weight_once_per_step(ffi_backend, scan, seed):
  """Four micro-batches in a `lax.scan` (the delayed-scaling state threaded through them):
  the weights are quantized once, before the scan, not once per micro-batch."""
  config = dataclasses.replace(CONFIG, remat=scan, scan_layers=scan)
  text, kernels = _compiled_step(config, jq.DelayedScaling(), seed, grad_accum=4)
  assert _weight_quantizations(text, kernels) == len(kernels) == 9
  # and the step does loop over micro-batches: the input quantizations run 4 times each
  inputs = [c for c in hlo.custom_calls(text) if c.target.startswith("jaxquant_quantize")
            and c.operands and c.operands[0][1] == (BATCH // 4 * CONFIG.seq, CONFIG.d_model)]
  assert inputs and all(c.executions % 4 == 0 for c in inputs)


# The micro-batch tests take one block: what they check (how micro-batches are split, summed and
# share each weight's quantization) is the same in every block, and the block's compile is most
# of their time. The head's weight is quantized too: 5 weights, of each kind the model has.
ACCUM_CONFIG = dataclasses.replace(CONFIG, layers=1)


@functools.partial(jax.jit, static_argnames="model")
def _loss(model, variables, tokens, key):
  """The loss alone (the forward): all the one-batch step contributes to the comparison."""
  return training.next_token_loss(model, variables, tokens, key)


@functools.partial(jax.jit, static_argnames=("model", "grad_accum"))
def _loss_and_grads(model, variables, tokens, key, grad_accum):
  """(loss, gradients) of one step; tokens and key are arguments, so micro-batches of one shape
  share one compiled program."""
  if grad_accum == 1:
    return jax.value_and_grad(lambda v: training.next_token_loss(model, v, tokens, key))(
        variables)
  return training.accumulated_value_and_grad(model, variables, tokens, key, grad_accum)


# One block format: the micro-batch loop reuses whatever the recipe quantized, the same code for
# every format (Float8Block's case took ~1 CPU-minute, the longest of the suite's unit tests).
@pytest.mark.parametrize("recipe,rtol", [("bf16", 1e-4), ("mxfp8", 5e-4)])
def test_grad_accum_loss_equals_the_one_batch_step(recipe, rtol, seed, core_backend):
  """Four micro-batches give the one-batch step's loss up to what a reordered sum can round,
  and their accumulated gradient is the mean of the four micro-batches' own gradients.

  The model computes in bfloat16, and XLA:CPU sums the attention einsums in another order for
  2 sequences than for 8: a float32-order difference, which now and then moves a value across
  a rounding boundary of its dtype and the loss with it. Unquantized (bf16) that boundary is a
  bfloat16 one (a step of 2^-8 relative): bound 1e-4 (observed up to 9e-6 over 10 seeds; the
  mean of four means of 40 token losses against one mean of 160 adds ~1e-7). The quantized
  recipes quantize each token row on its own (per-row blocks), so their micro-batch forward is
  the full batch's rows but for the same reordering, and a moved value can cross an FP8
  boundary (a step of 2^-3 relative in E4M3): bound 5e-4 (observed up to 6e-5).

  The same reordering makes the one-batch step's weight gradients a poor reference: a code of a
  quantized gradient operand that crosses an FP8 boundary moves its terms by an FP8 step (seen
  with seed 2092004315: 2 of 4096 elements 5% apart). So the gradients are compared with the
  four micro-batches run as separate one-batch steps (micro-batch `i` = rows `i, i + 4, ...`,
  key `fold_in(key, i)`), summed in the scan's order: the same operands, the same partial sums.
  What remains is XLA compiling the step inside the scan and alone, bounded by the float32
  reordering of the four terms plus one bfloat16 step of each micro-batch's gradient (the layer
  rounds its GEMM output to the compute dtype); a missing or repeated micro-batch is off by its
  whole gradient."""
  make = {"bf16": lambda: None, "mxfp8": jq.MXFP8BlockScaling}
  model = model_lib.GPT(ACCUM_CONFIG, make[recipe]())
  tokens = _tokens(seed)
  variables = training.create_state(model, tokens, training.TrainConfig()).params
  key = jax.random.key(seed)
  loss_1 = _loss(model, variables, jnp.asarray(tokens), key)
  loss_4, grads_4 = _loss_and_grads(model, variables, jnp.asarray(tokens), key, 4)
  np.testing.assert_allclose(float(loss_4), float(loss_1), rtol=rtol)
  micro = [_loss_and_grads(model, variables, jnp.asarray(tokens[i::4]),
                           jax.random.fold_in(key, i), 1)[1]["params"] for i in range(4)]
  grad_sum = jax.tree_util.tree_map(jnp.zeros_like, variables["params"])
  for grads in micro:  # the scan's order: ((0 + g0) + g1) + g2) + g3
    grad_sum = jax.tree_util.tree_map(jnp.add, grad_sum, grads)
  accumulated = dict(jax.tree_util.tree_leaves_with_path(grads_4["params"]))
  magnitude = jax.tree_util.tree_map(lambda *g: sum(np.abs(np.asarray(x, np.float64)) for x in g),
                                     *micro)
  for (path, total), (_, m) in zip(jax.tree_util.tree_leaves_with_path(grad_sum),
                                   jax.tree_util.tree_leaves_with_path(magnitude)):
    want = np.asarray(total, np.float64) / 4
    bound = (2.0**-7 + 8 * 2.0**-24) * m / 4 + np.abs(want) * 2.0**-23
    err = np.abs(np.asarray(accumulated[path], np.float64) - want)
    bad = err > bound
    assert not bad.any(), (f"{jax.tree_util.keystr(path)}: {bad.sum()} of {bad.size} elements "
                           f"past the bound; worst err / bound {np.max(err / bound):.3g}")


def test_grad_accum_advances_weight_states_once_and_the_others_per_micro_batch(seed,
                                                                            core_backend):
  """Delayed scaling under four micro-batches: each weight's amax history gains one entry (its
  quantization is shared by the micro-batches), each input's and gradient's four (one per
  micro-batch, as four steps would), all from positive finite amaxes."""
  model = model_lib.GPT(ACCUM_CONFIG, jq.DelayedScaling())
  tokens = _tokens(seed)
  variables = training.create_state(model, tokens, training.TrainConfig()).params
  _, grads = _loss_and_grads(model, variables, jnp.asarray(tokens), jax.random.key(seed), 4)
  histories = {jax.tree_util.keystr(p): np.asarray(h) for p, h in
               jax.tree_util.tree_leaves_with_path(grads[jqf.OVERWRITE_WITH_GRADIENT])
               if jax.tree_util.keystr(p).endswith("_amax_history']")}
  assert len(histories) == 5 * 3  # qkv, proj, fc1, fc2 and the head: input, weight, grad
  for name, history in histories.items():
    seen = 1 if "weight_amax_history" in name else 4
    assert np.count_nonzero(history) == seen, name
    assert np.all(history[-seen:] > 0) and np.all(np.isfinite(history)), name


def test_train_lm_grad_accum_flag_trains(tmp_path, seed):
  # `--backend auto`: the FFI kernels' CPU handlers compile the step in about half the
  # reference path's CPU time; the flag's plumbing does not depend on the backend.
  import train_lm
  result = train_lm.main(["--recipe", "fp8_delayed", "--steps", "3", "--eval-every", "3",
                          "--grad-accum", "4", "--seed", str(seed % 10_000), "--out",
                          str(tmp_path), "--d-model", "32", "--layers", "1", "--heads", "2",
                          "--seq", "32", "--batch", "8", "--data-mb", "0.3",
                          "--eval-batches", "1", "--no-progress", "--backend", "auto"])
  history = result["histories"][0]
  assert len(history.step_losses) == 3 and all(np.isfinite(history.step_losses))
  with pytest.raises(SystemExit):
    train_lm.main(["--grad-accum", "3", "--batch", "8", "--out", str(tmp_path)])


# ---------------------------------------------------------------------------------------------
# A shared input quantized once: q, k and v of nn.MultiHeadDotProductAttention


def _lowered_quantizations(text: str, shape: tuple[int, int]) -> int:
  """Quantize calls on a `[rows, cols]` bf16 operand in the program jaxquant hands to XLA
  (lowered StableHLO: before XLA, which on CPU merges some identical calls by itself)."""
  pattern = re.compile(r"stablehlo\.custom_call @(jaxquant_quantize\w*)\(.*?: \(tensor<"
                       rf"{shape[0]}x{shape[1]}xbf16>")
  return len(pattern.findall(text))


def _attention(recipe, seed):
  module = nn.MultiHeadDotProductAttention(num_heads=4, dtype=jnp.bfloat16, deterministic=True)
  x = jax.random.normal(jax.random.key(seed), (2, 24, 64), jnp.bfloat16)
  loss = lambda v, x: module.apply(v, x).astype(jnp.float32).sum()
  with jqf.quantize_dense(recipe):
    variables = jax.jit(module.init)(jax.random.key(seed + 1), x)
    grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
    text = jax.jit(loss).lower(variables, x).as_text()  # the forward (dy has x's shape too)
    report = jq.explain(grad, variables, x)
    value = grad(variables, x)
  return text, report, value


@needs_ffi
def test_qkv_projections_of_one_input_share_one_quantization(ffi_backend, seed):
  text, report, _ = _attention(jq.Float8CurrentScaling(), seed)
  # forward, x [48, 64]: one quantization for query, key and value (the out projection's input
  # is another tensor, [48, 64] too: two in all, where there were four)
  assert _lowered_quantizations(text, (48, 64)) == 2
  shared = [d for d in report if d.op == "quantize" and d.path == "shared"]
  assert sorted(d.role.name for d in shared) == ["key", "value"]


def test_shared_quantization_gives_the_unshared_values_and_gradients(monkeypatch, seed,
                                                                     core_backend):
  from jaxquant.flax import interception
  _, report, shared = _attention(jq.Float8CurrentScaling(), seed)
  assert any(d.path == "shared" for d in report)
  monkeypatch.setattr(interception, "share_input_quantization", _no_scope)
  _, report, unshared = _attention(jq.Float8CurrentScaling(), seed)
  assert not any(d.path == "shared" for d in report)
  jax.tree_util.tree_map(lambda a, b: np.testing.assert_array_equal(np.asarray(a),
                                                                    np.asarray(b)),
                         shared, unshared)


def _no_scope():
  import contextlib
  return contextlib.nullcontext()


@pytest.mark.parametrize("recipe", ["delayed", "stochastic"])
def test_inputs_with_their_own_state_or_random_bits_are_not_shared(recipe, seed, core_backend):
  """Delayed scaling keeps a state per projection, stochastic rounding draws per layer: each
  projection quantizes its input itself."""
  def stochastic(role):
    return jq.NVFP4Quantizer(stochastic_rounding=True)
  make = {"delayed": jq.DelayedScaling, "stochastic": lambda: jq.CustomRecipe(stochastic)}
  module = nn.MultiHeadDotProductAttention(num_heads=4, dtype=jnp.bfloat16, deterministic=True)
  x = jax.random.normal(jax.random.key(seed), (2, 16, 64), jnp.bfloat16)
  with jqf.quantize_dense(make[recipe]()):
    variables = jax.jit(module.init)(jax.random.key(seed + 1), x)
    report = jq.explain(lambda v: module.apply(v, x, rngs={"quantize": jax.random.key(0)}),
                        variables)
  assert not any(d.path == "shared" for d in report)


def test_share_input_quantization_reuses_only_the_same_input_object(seed, core_backend):
  quantizers = jq.DenseQuantizers.from_recipe(jq.Float8CurrentScaling(), "linear", "p")
  x = jax.random.normal(jax.random.key(seed), (16, 32), jnp.bfloat16)
  w1, w2 = (jax.random.normal(jax.random.key(seed + i), (32, 48), jnp.bfloat16) for i in (1, 2))

  def two(x, same: bool):
    with jq.share_input_quantization():
      a = jq.dense(x, w1, quantizers=quantizers)
      b = jq.dense(x if same else x + 0, w2, quantizers=quantizers)
    return a, b

  for same, want in ((True, 1), (False, 0)):
    report = jq.explain(lambda x: two(x, same), x)
    assert sum(d.path == "shared" for d in report) == want
  _, b = jax.jit(lambda x: two(x, True))(x)
  np.testing.assert_array_equal(np.asarray(b), np.asarray(jq.dense(x, w2, quantizers=quantizers)))


CACHED_MODULES = ["dense_general_batch", "layernorm_mlp_swiglu", "quantize_dense",
                  "layernorm_dense_fused", "layernorm_mlp_swiglu_fused",
                  "layernorm_mlp_gelu_epilogue"]


@pytest.mark.parametrize("module", CACHED_MODULES)
def test_cached_weights_give_the_uncached_values_gradients_and_states(module, seed, core_backend):
  """A pass that reads its weights from `quantize_weights` computes what one that quantizes
  them itself does: values, parameter gradients and the new delayed-scaling states, bit for
  bit (a DenseGeneral with batch_dims caches one weight per batch element; the fused-producer
  paths of LayerNormDense / LayerNormMLP cache each of their dense layers' weights too)."""
  x = jax.random.normal(jax.random.key(seed), (3, 16, 32), jnp.bfloat16)
  recipe = jq.DelayedScaling()
  context = lambda: jqf.quantize_dense(recipe) if module == "quantize_dense" else _no_scope()
  model = {"dense_general_batch": jqf.DenseGeneral((4, 8), batch_dims=(0,), recipe=recipe),
           "layernorm_mlp_swiglu": jqf.LayerNormMLP(48, activations="swiglu", recipe=recipe,
                                                   dtype=jnp.bfloat16),
           "quantize_dense": nn.Dense(24, dtype=jnp.bfloat16),
           "layernorm_dense_fused": jqf.LayerNormDense(24, recipe=recipe, dtype=jnp.bfloat16,
                                                       fuse_producers=True),
           "layernorm_mlp_swiglu_fused": jqf.LayerNormMLP(
               48, activations="swiglu", recipe=recipe, dtype=jnp.bfloat16,
               fuse_producers=True),
           "layernorm_mlp_gelu_epilogue": jqf.LayerNormMLP(  # fc1's GEMM applies the gelu
               48, recipe=recipe, dtype=jnp.bfloat16, fuse_gemm_activation=True)}[module]
  with context():
    variables = jax.jit(model.init)(jax.random.key(seed + 1), x)
    weights = jax.jit(lambda v: jqf.quantize_weights(model.apply, v, x))(variables)
    assert weights, "no weight was cached"
    if module.endswith("_fused"):
      cached = [leaf for leaf in jax.tree_util.tree_leaves(
          weights, is_leaf=lambda a: isinstance(a, Operand)) if isinstance(leaf, Operand)]
      assert len(cached) == (2 if "mlp" in module else 1)
      report = jq.explain(lambda v: model.apply(v, x), variables)
      assert any(d.op == "quantize" and d.detail.startswith("fused") for d in report), (
          "the fused producers did not run")
    grad = jax.jit(jax.value_and_grad(
        lambda v, w: model.apply({**v, **w}, x).astype(jnp.float32).sum()))
    cached, uncached = grad(variables, weights), grad(variables, {})
  jax.tree_util.tree_map(lambda a, b: np.testing.assert_array_equal(np.asarray(a),
                                                                    np.asarray(b)),
                         cached, uncached)
