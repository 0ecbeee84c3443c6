"""Float32 parameters under bfloat16 compute (Flax's default `param_dtype`): a weight the recipe
quantizes is quantized from the float32 kernel itself (no convert pass to bf16 first), its
gradient comes out of the wgrad GEMM in float32, directions kept in high precision by an
`IdentityQuantizer` see the kernel cast to the compute dtype; and a weight whose two copies are
the same bytes either way is quantized as stored, not transposed first."""

from __future__ import annotations

import contextlib
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxquant as jq
import jaxquant.flax as jf
import jaxquant.nnx as jn
from helpers import assert_same_leaves
from jaxquant import ops
from jaxquant.layers.dense import copies_swap_with_transpose
from jaxquant.ops import grouped as grouped_ops

# Under JAXQUANT_BACKEND=ffi a case without a kernel is an error by design (never a silent
# fallback); those cases are expected to raise that RuntimeError, every other case must pass.
pytestmark = pytest.mark.xfail(os.environ.get("JAXQUANT_BACKEND") == "ffi", raises=RuntimeError,
                               strict=False, reason="no kernel for this case (ffi forced)")

T, K, N, G = 48, 96, 160, 4  # distinct sizes: a kernel-shaped array is recognizable in HLO


def _hybrid_identity(role):
  """MXFP8 everywhere, except the weight's dgrad copy, kept in high precision."""
  if role is not None and role.tensor_type == "weight":
    return jq.HybridQuantizer(jq.MXFP8Quantizer(), jq.IdentityQuantizer())
  return jq.MXFP8Quantizer()


RECIPES = {
    **{name: make() for name, make in jq.BUILTIN_RECIPES.items()},
    "hybrid_identity_dgrad": jq.CustomRecipe(_hybrid_identity),
}


@contextlib.contextmanager
def _reference_backend():
  saved = os.environ.get("JAXQUANT_BACKEND")
  os.environ["JAXQUANT_BACKEND"] = "reference"
  try:
    yield
  finally:
    if saved is None:
      os.environ.pop("JAXQUANT_BACKEND")
    else:
      os.environ["JAXQUANT_BACKEND"] = saved


def _record_weight_quantizes(monkeypatch):
  """Every weight quantize the layers run: (its input, its kwargs, its output, the op)."""
  recorded = []

  def spy(op_module, name, with_state=False):
    original = getattr(op_module, name)
    # quantize_and_update returns (storages, state): the storages are compared
    storages = (lambda *a, **k: original(*a, **k)[0]) if with_state else original

    def wrapped(x, quantizer, **kwargs):
      out = original(x, quantizer, **kwargs)
      role = kwargs.get("role")
      if role is not None and role.tensor_type == "weight":
        recorded.append((x, quantizer, kwargs, out[0] if with_state else out, storages))
      return out

    monkeypatch.setattr(op_module, name, wrapped)

  spy(ops, "quantize")
  spy(ops, "quantize_and_update", with_state=True)
  spy(grouped_ops, "quantize_experts")
  return recorded


def _models(recipe):
  """(name, init(x, sizes) -> state, apply(state, x, sizes) -> y, kernel of state) per module,
  float32 parameters and bfloat16 compute."""
  dense = jf.Dense(N, dtype=jnp.bfloat16, recipe=recipe)
  grouped = jf.GroupedDense(N, num_groups=G, dtype=jnp.bfloat16, recipe=recipe)
  linen = lambda m, grouped_call: (
      lambda x, s: m.init(jax.random.key(1), *((x, s) if grouped_call else (x,))),
      lambda v, x, s: m.apply(v, *((x, s) if grouped_call else (x,)),
                              rngs={"quantize": jax.random.key(2)}),
      lambda v: v["params"]["kernel"])

  def nnx_init(x, sizes):
    model, _ = jn.quantize_model(nnx.Linear(K, N, dtype=jnp.bfloat16, rngs=nnx.Rngs(1)), recipe,
                                 rngs=nnx.Rngs(quantize=2))
    return nnx.split(model)

  def nnx_apply(state, x, sizes):
    graphdef, params = state
    return nnx.merge(graphdef, params)(x)

  return {"Dense": linen(dense, False), "GroupedDense": linen(grouped, True),
          "nnx.Linear": (nnx_init, nnx_apply, lambda state: state[1]["kernel"][...])}


def _inputs(rng):
  sizes = jnp.asarray([20, 0, 17, 8], jnp.int32)  # an empty group, 3 rows in none
  x = jnp.asarray(rng.standard_normal((T, K)), jnp.bfloat16)
  dy = jnp.asarray(rng.standard_normal((T, N)), jnp.bfloat16)
  return x, sizes, dy


def _matches_kernel(source, kernel) -> bool:
  """`source` is the kernel itself ([.., K, N]) or its transpose, bit for bit."""
  kernel = np.asarray(kernel)
  for candidate in (kernel, np.swapaxes(kernel, -1, -2)):
    if candidate.shape == source.shape and candidate.dtype == source.dtype:
      if np.array_equal(candidate.view(np.uint32), np.asarray(source).view(np.uint32)):
        return True
  return False


# GroupedDense (the slowest here, eager) takes per-tensor FP8 through its stateful quantize,
# NVFP4, and MXFP8 beside an Identity direction (hybrid_identity_dgrad); its current-scaling and
# plain MXFP8 cases (~15 CPU-s) quantize experts by the same code with another quantizer, and
# Dense and nnx.Linear still take every recipe.
GROUPED_RECIPES = ("fp8_delayed", "nvfp4", "hybrid_identity_dgrad")


@pytest.mark.parametrize("module", ["Dense", "GroupedDense", "nnx.Linear"])
@pytest.mark.parametrize("name", ["fp8_current", "fp8_delayed", "mxfp8", "nvfp4",
                                  "hybrid_identity_dgrad"])
def test_float32_params_are_quantized_from_the_float32_kernel(rng, monkeypatch, module, name):
  """The weight storages of a float32-params module are the reference quantize of the float32
  kernel bit for bit (not of its bf16 rounding); an Identity direction holds the kernel cast to
  bf16."""
  if module == "GroupedDense" and name not in GROUPED_RECIPES:
    pytest.skip(f"GroupedDense takes {GROUPED_RECIPES} (the same expert quantize)")
  init, apply, kernel_of = _models(RECIPES[name])[module]
  x, sizes, dy = _inputs(rng)
  state = init(x, sizes)
  kernel = kernel_of(state)
  assert kernel.dtype == jnp.float32
  recorded = _record_weight_quantizes(monkeypatch)
  y, vjp = jax.vjp(lambda s, x: apply(s, x, sizes), state, x)  # eager: concrete storages
  vjp(dy)
  assert recorded, "no weight quantize was recorded"
  for source, quantizer, kwargs, out, original in recorded:
    assert source.dtype == jnp.float32 and _matches_kernel(source, kernel), (
        f"{module} {name}: the weight was quantized from {source.dtype}{source.shape}, not the "
        f"float32 kernel {kernel.shape}")
    with _reference_backend():
      expected = original(source, quantizer, **kwargs)
    assert_same_leaves(out, expected, f"{module} {name}: weight storages vs the reference")
    for direction in ("rowwise", "columnwise"):
      leaf, copy = quantizer.for_direction(direction), getattr(out, direction)
      if isinstance(leaf, jq.IdentityQuantizer) and copy is not None:
        assert copy.data.dtype == jnp.bfloat16, f"{module}: Identity {direction} not in bf16"
        np.testing.assert_array_equal(
            np.asarray(copy.data, np.float32),
            np.asarray(jnp.swapaxes(source, -1, -2).astype(jnp.bfloat16)
                       if direction == "columnwise" else source.astype(jnp.bfloat16),
                       np.float32))


@pytest.mark.parametrize("module", ["Dense", "GroupedDense"])
@pytest.mark.parametrize("name", ["fp8_current", "mxfp8"])
def test_the_weight_gradient_comes_from_the_gemm_in_float32(rng, module, name):
  """The kernel's gradient is float32 straight from the wgrad GEMM: most of its values are not
  bf16 numbers (a bf16 GEMM output widened afterwards would all be)."""
  init, apply, kernel_of = _models(RECIPES[name])[module]
  x, sizes, dy = _inputs(rng)
  state = init(x, sizes)
  _, vjp = jax.jit(lambda s, x: jax.vjp(lambda s: apply(s, x, sizes), s))(state, x)
  grad = np.asarray(kernel_of(vjp(dy)[0]))
  assert grad.dtype == np.float32
  nonzero = grad != 0
  assert nonzero.mean() > 0.5
  widened = np.asarray(jnp.asarray(grad).astype(jnp.bfloat16), np.float32)
  assert (widened[nonzero] != grad[nonzero]).mean() > 0.5, "the gradient went through bf16"


def _compiled_step_text(model, variables, x, sizes, dy) -> str:
  extra = () if sizes is None else (sizes,)

  def step(v, x):
    y, vjp = jax.vjp(lambda v, x: model.apply(v, x, *extra), v, x)
    return y, vjp(dy)

  return jax.jit(step).lower(variables, x).compile().as_text()


def _arrays_of_shape(hlo: str, dtype: str, shape) -> list[str]:
  """HLO instructions producing a `dtype` array of exactly `shape` (alone or in a tuple; a
  compiled module prints its operands without shapes)."""
  pattern = re.compile(rf"\b{dtype}\[{','.join(map(str, shape))}\]")
  return [line.strip()[:160] for line in hlo.splitlines()
          if " = " in line and pattern.search(line.split(" = ", 1)[1])]


# Per-tensor FP8 only: an MXFP8 / NVFP4 GEMM on CUDA decodes its quantized weights to bf16
# (`dequant-bf16`), a bf16 array of the kernel's shape that is not a convert of the kernel.
@pytest.mark.parametrize("name", ["fp8_current", "fp8_delayed"])
def test_a_float32_params_grouped_step_has_no_bf16_copy_of_the_kernel(rng, name):
  """The compiled float32-params GroupedDense step holds no bf16 array of the kernel's shape
  (the convert pass, or a bf16 weight gradient) nor a transposed float32 copy of the kernel."""
  model = jf.GroupedDense(N, num_groups=G, use_bias=False, dtype=jnp.bfloat16,
                          recipe=RECIPES[name])
  x, sizes, dy = _inputs(rng)
  variables = model.init(jax.random.key(0), x, sizes)
  hlo = _compiled_step_text(model, variables, x, sizes, dy)
  for dtype, shape in (("bf16", (G, K, N)), ("bf16", (G, N, K)), ("f32", (G, N, K))):
    assert not _arrays_of_shape(hlo, dtype, shape), (dtype, shape,
                                                     _arrays_of_shape(hlo, dtype, shape))
  assert _arrays_of_shape(hlo, "f32", (G, K, N)), "expected the float32 kernel gradient"


@pytest.mark.parametrize("name", ["fp8_current", "fp8_delayed"])
def test_a_float32_params_dense_step_has_no_bf16_copy_of_the_kernel(rng, name):
  model = jf.Dense(N, use_bias=False, dtype=jnp.bfloat16, recipe=RECIPES[name])
  x, _, dy = _inputs(rng)
  variables = model.init(jax.random.key(0), x)
  hlo = _compiled_step_text(model, variables, x, None, dy)
  for dtype, shape in (("bf16", (K, N)), ("bf16", (N, K)), ("f32", (N, K))):
    assert not _arrays_of_shape(hlo, dtype, shape), (dtype, shape,
                                                     _arrays_of_shape(hlo, dtype, shape))


SWAP_CASES = {
    "fp8_current": (jq.Float8CurrentScalingQuantizer(), True),
    "fp8_delayed": (jq.Float8DelayedScalingQuantizer(), True),
    "mxfp8": (jq.MXFP8Quantizer(), True),
    "fp8_block_1x128": (jq.Float8BlockQuantizer((1, 128)), True),
    "fp8_block_128x128": (jq.Float8BlockQuantizer((128, 128)), True),
    "nvfp4_2d": (jq.NVFP4Quantizer(block_2d=True), True),
    "nvfp4_row_scaled": (jq.NVFP4Quantizer(row_scaled=True), True),
    "nvfp4_rht": (jq.NVFP4Quantizer(rht=True), False),
    "nvfp4_stochastic": (jq.NVFP4Quantizer(stochastic_rounding=True), False),
    "hybrid": (jq.HybridQuantizer(jq.MXFP8Quantizer(), jq.Float8CurrentScalingQuantizer()),
               False),
}


@pytest.mark.parametrize("case", sorted(SWAP_CASES))
def test_weight_copies_swap_with_the_transpose_exactly_where_claimed(rng, prng_key, case):
  """Where `copies_swap_with_transpose` holds, quantizing W [K, N] gives quantize(W^T)'s copies
  swapped, bit for bit (so the layers may skip the transpose); the RHT and stochastic rounding
  are where it does not."""
  quantizer, claimed = SWAP_CASES[case]
  assert copies_swap_with_transpose(quantizer) == claimed
  w = jnp.asarray(rng.standard_normal((K, N)) * 0.1, jnp.float32)
  state = jq.init_state(quantizer)
  kw = dict(key=prng_key, state=state)
  stored = jax.jit(lambda w: ops.quantize(w, quantizer, **kw))(w)
  transposed = jax.jit(lambda w: ops.quantize(w.T, quantizer, **kw))(w)
  if claimed:
    assert_same_leaves((stored.columnwise, stored.rowwise),
                       (transposed.rowwise, transposed.columnwise), case)
    experts = jnp.stack([w, -2 * w])
    states = jq.grouped.init_state(quantizer, 2)
    stored = jax.jit(lambda w: grouped_ops.quantize_experts(w, quantizer, state=states))(experts)
    transposed = jax.jit(lambda w: grouped_ops.quantize_experts(
        jnp.swapaxes(w, 1, 2), quantizer, state=states))(experts)
    assert_same_leaves((stored.columnwise, stored.rowwise),
                       (transposed.rowwise, transposed.columnwise), f"{case} experts")
  else:
    same = jax.tree_util.tree_map(lambda a, b: bool(jnp.array_equal(a, b)),
                                  stored.columnwise.data, transposed.rowwise.data)
    assert not same, f"{case}: the copies agree here, so the predicate could claim them"


def _independent_hybrids(role):
  """NVFP4 forward, MXFP8 backward for every role: weights Hybrid(NVFP4, MXFP8), whose halves
  each swap with the transpose and are independent."""
  if role is not None and role.tensor_type in ("input", "weight"):
    return jq.HybridQuantizer(rowwise=jq.NVFP4Quantizer(), columnwise=jq.MXFP8Quantizer())
  return jq.MXFP8Quantizer()


@pytest.mark.parametrize("quantizer", [
    jq.HybridQuantizer(jq.MXFP8Quantizer(), jq.Float8CurrentScalingQuantizer()),
    jq.HybridQuantizer(jq.NVFP4Quantizer(), jq.MXFP8Quantizer())], ids=str)
def test_a_hybrid_of_swappable_halves_quantizes_w_with_its_halves_exchanged(rng, quantizer):
  """`Format.transposed_quantizer`: Hybrid(A, B) of W^T is Hybrid(B, A) of W with the copies
  swapped, bit for bit, so a layer quantizes its kernel as stored."""
  swapped = jq.formats.format_of(quantizer).transposed_quantizer(quantizer)
  assert swapped == jq.HybridQuantizer(quantizer.columnwise, quantizer.rowwise)
  w = jnp.asarray(rng.standard_normal((K, N)) * 0.1, jnp.float32)
  stored = jax.jit(lambda w: ops.quantize(w, swapped))(w)
  transposed = jax.jit(lambda w: ops.quantize(w.T, quantizer))(w)
  assert_same_leaves((stored.columnwise, stored.rowwise),
                     (transposed.rowwise, transposed.columnwise), str(quantizer))


def test_a_float32_params_hybrid_grouped_step_quantizes_the_kernel_as_stored(rng, monkeypatch):
  """Expert weights Hybrid(NVFP4, MXFP8) under float32 parameters: the compiled GroupedDense
  step holds fewer transposed float32 copies of the kernel than the step that quantizes the
  transposed kernel (the reference's NVFP4 columnwise copy transposes on CPU too, so count),
  and equals it bit for bit. (Dense keeps quantizing W^T for Hybrids: not measured on a GPU.)"""
  model = jf.GroupedDense(N, num_groups=G, use_bias=False, dtype=jnp.bfloat16,
                          recipe=jq.CustomRecipe(_independent_hybrids))
  x, sizes, dy = _inputs(rng)
  variables = model.init(jax.random.key(0), x, sizes)

  def step(v, x):
    y, vjp = jax.vjp(lambda v, x: model.apply(v, x, sizes), v, x)
    return y, vjp(dy)

  as_stored_hlo = jax.jit(lambda *a: step(*a)).lower(variables, x).compile().as_text()
  as_stored = jax.jit(lambda *a: step(*a))(variables, x)
  monkeypatch.setattr(jq.formats.hybrid.HybridFormat, "transposed_quantizer",
                      lambda self, q: None)
  transposing_hlo = jax.jit(lambda *a: step(*a)).lower(variables, x).compile().as_text()
  transposing = jax.jit(lambda *a: step(*a))(variables, x)
  stored_copies = _arrays_of_shape(as_stored_hlo, "f32", (G, N, K))
  transposed_copies = _arrays_of_shape(transposing_hlo, "f32", (G, N, K))
  assert len(stored_copies) < len(transposed_copies), (stored_copies, transposed_copies)
  assert_same_leaves(as_stored, transposing, "GroupedDense")


def _every_module():
  """(name, init(x) -> variables, apply(variables, x)) of every module kind with a quantized
  weight, float32 parameters and bf16 compute, under per-tensor FP8."""
  recipe = RECIPES["fp8_current"]
  linen = {
      "DenseGeneral": jf.DenseGeneral((4, N // 4), dtype=jnp.bfloat16, recipe=recipe),
      "LayerNormDense": jf.LayerNormDense(N, dtype=jnp.bfloat16, recipe=recipe),
      "LayerNormMLP": jf.LayerNormMLP(N, activations="swiglu", dtype=jnp.bfloat16,
                                      recipe=recipe),
      "LayerNormDense fused": jf.LayerNormDense(N, dtype=jnp.bfloat16, recipe=recipe,
                                                fuse_producers=True),
      "LayerNormMLP fused": jf.LayerNormMLP(N, activations="swiglu", dtype=jnp.bfloat16,
                                            recipe=recipe, fuse_producers=True),
  }
  cases = {name: (lambda x, m=m: m.init(jax.random.key(1), x),
                  lambda v, x, m=m: m.apply(v, x)) for name, m in linen.items()}
  import flax.linen as nn
  for name, m in (("quantize_dense nn.Dense", nn.Dense(N, dtype=jnp.bfloat16)),
                  ("quantize_dense nn.Einsum", nn.Einsum((K, N), "tk,kn->tn",
                                                         dtype=jnp.bfloat16))):
    def init(x, m=m):
      with jf.quantize_dense(recipe):
        return m.init(jax.random.key(1), x)

    def apply(v, x, m=m):
      with jf.quantize_dense(recipe):
        return m.apply(v, x)

    cases[name] = (init, apply)
  for name, make in (("nnx.LinearGeneral", lambda: nnx.LinearGeneral(
      K, (4, N // 4), dtype=jnp.bfloat16, rngs=nnx.Rngs(1))),
                     ("nnx.Einsum", lambda: nnx.Einsum("tk,kn->tn", (K, N), dtype=jnp.bfloat16,
                                                        rngs=nnx.Rngs(1)))):
    def init(x, make=make):
      return nnx.split(jn.quantize_model(make(), recipe)[0])

    def apply(state, x):
      return nnx.merge(*state)(x)

    cases[name] = (init, apply)
  return cases


@pytest.mark.parametrize("module", ["DenseGeneral", "LayerNormDense", "LayerNormMLP",
                                    "LayerNormDense fused", "LayerNormMLP fused",
                                    "quantize_dense nn.Dense", "quantize_dense nn.Einsum",
                                    "nnx.LinearGeneral", "nnx.Einsum"])
def test_every_module_quantizes_its_float32_kernel(rng, monkeypatch, module):
  """Every module with a quantized weight hands its float32 kernel to the quantize (none casts
  it to the bf16 compute dtype first) and gets a float32 gradient for it."""
  init, apply = _every_module()[module]
  x, _, _ = _inputs(rng)
  state = init(x)
  recorded = _record_weight_quantizes(monkeypatch)
  y, vjp = jax.vjp(apply, state, x)
  grads = vjp(jnp.ones_like(y))[0]
  assert recorded, "no weight quantize was recorded"
  assert all(source.dtype == jnp.float32 for source, *_ in recorded), [
      source.dtype for source, *_ in recorded]
  kernels = [leaf for path, leaf in jax.tree_util.tree_leaves_with_path(grads)
             if "kernel" in jax.tree_util.keystr(path)]
  assert kernels and all(k.dtype == jnp.float32 for k in kernels), [k.dtype for k in kernels]
