"""Every registered format is served by every layer, or rejected there with a clear error.

For each format in `jaxquant.formats.registered()` and each of its `variants()` (the options it
has), `format_problems` runs the layers a model uses: quantize (both directions, storage shapes
and dtypes as the format declares them), dequantize, the GEMM (forward and a wgrad-like pair of
columnwise copies), grouped quantize of tokens and of expert weights, both grouped GEMMs, the
storage sharding specs and block checks, state (single and per group), and the kernel facts the
backends read. A layer may reject a format only with a ValueError / TypeError that names it; any
other failure (a `NotImplementedError` from a fact the format does not define, a wrong shape, a
wrong value) is a problem. A toy format registered inside the test shows that an incomplete
format fails the check, naming what it misses.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractMesh, PartitionSpec as P

import jaxquant as jq
from jaxquant import grouped as jg
from jaxquant import sharding as jqs
from jaxquant.formats import Format, format_of, register, registered, unregister
from jaxquant.formats.base import AMAX_LAYOUTS, SCALE_LAYOUTS, no_grouped_kernel, tensor_amax
from jaxquant.ops.grouped import wgrad_token_block
from jaxquant.tensors import ScaledTensor

ROWS, COLS, OUT = 32, 64, 48  # x[ROWS, COLS], y[ROWS, OUT]: forward x.w^T, wgrad x^T.y
TOKENS, GROUPS, SIZES = 64, 3, (20, 0, 40)  # grouped tokens (rows 60-63 in no group)
GEMM_FAMILIES = ("fp8", "fp8-block", "mxfp8", "nvfp4", "hp")
ROUTES = ("fp8", "nvfp4", "single", None)


def _variants():
  cases = []
  for cls, fmt in registered().items():
    for i, q in enumerate(fmt.variants()):
      cases.append(pytest.param(q, id=f"{fmt.name}-{i}"))
  return cases


def _keys(quantizer, seed: int):
  """(key, per-group keys) when the quantizer rounds stochastically, else (None, None)."""
  if not format_of(quantizer).needs_key(quantizer):
    return None, None
  key = jax.random.key(seed)
  return key, jax.random.split(key, GROUPS)


def _close(got, want, scale, tol, what):
  """|got - want| <= tol * scale elementwise (float64), else AssertionError naming `what`."""
  err = np.abs(np.asarray(got, np.float64) - want)
  bad = err > tol * scale + 1e-30
  assert not bad.any(), f"{what}: {int(bad.sum())} values off (max error {err.max():.3g})"


def _product(a, b):
  """(a . b^T, |a| . |b|^T) in float64."""
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return a @ b.T, np.abs(a) @ np.abs(b).T


def _gemm_tol(a, b, terms: int) -> float:
  """Relative bound (to |a| . |b|^T) of a GEMM of the decoded operands: quantized operands are
  decoded exactly and accumulated in float32 (2e-3 is far above that rounding, far below a
  wrong decode); high-precision 16-bit operands are multiplied in their own dtype, as the
  unquantized model does, so `terms` roundings of that dtype's spacing."""
  eps = max(float(jnp.finfo(t.data.dtype).eps) if format_of(t.quantizer).high_precision else 0.0
            for t in (a, b))
  return max(2e-3, terms * eps)


# ------------------------------------------- the layers ----------------------------------------

def _check_storage(t: ScaledTensor, shape) -> None:
  """A storage laid out as its format declares (payload, scale and amax shapes and dtypes)."""
  q = t.quantizer
  fmt = format_of(q)
  assert t.shape == tuple(shape), f"storage shape {t.shape}, expected {tuple(shape)}"
  assert fmt.scale_layout(q) in SCALE_LAYOUTS and fmt.amax_layout(q) in AMAX_LAYOUTS
  want_scale = fmt.scale_shape(q, *shape)
  if want_scale is None:
    assert t.scale_inv is None, "a format without scales stored some"
  else:
    assert tuple(t.scale_inv.shape) == want_scale, (
        f"scale_inv {tuple(t.scale_inv.shape)}, the format declares {want_scale}")
    assert np.dtype(t.scale_inv.dtype) == fmt.scale_dtype(q)
  want_amax = {"none": None, "tensor": (), "row": (shape[0],)}[fmt.amax_layout(q)]
  assert (t.amax is None) == (want_amax is None), "amax presence differs from amax_layout"
  if want_amax is not None:
    assert tuple(t.amax.shape) == want_amax
  if fmt.high_precision:
    assert np.dtype(t.data.dtype) in jq.quantizers.HIGH_PRECISION_DTYPES


def _quantize(q, x, seed):
  key, _ = _keys(q, seed)
  return jq.ops.quantize(x, q, key=key, state=jq.init_state(q))


def layer_quantize(q, data, seed):
  qt = _quantize(q, data["x"], seed)
  assert qt.rowwise is not None and qt.columnwise is not None
  _check_storage(qt.rowwise, (ROWS, COLS))
  _check_storage(qt.columnwise, (COLS, ROWS))


def layer_dequantize(q, data, seed):
  x = np.asarray(data["x"], np.float64)
  qt = _quantize(q, data["x"], seed)
  scale = np.abs(x).max()
  _close(qt.rowwise.dequantize(), x, scale, 0.5, "rowwise dequantize")
  _close(qt.columnwise.dequantize().T, x, scale, 0.5, "columnwise dequantize")


def layer_gemm(q, data, seed):
  qx = _quantize(q, data["x"], seed)
  qw = _quantize(q, data["w"], seed + 1)
  qy = _quantize(q, data["y"], seed + 2)
  pairs = (("forward", qx.rowwise, qw.rowwise), ("wgrad", qx.columnwise, qy.columnwise))
  for what, a, b in pairs:
    out = jq.ops.gemm(a, b)
    want, scale = _product(a.dequantize(), b.dequantize())
    _close(out, want, scale, _gemm_tol(a, b, a.shape[1]), f"{what} GEMM")


def layer_grouped_quantize(q, data, seed):
  x, sizes = data["tokens"], jnp.asarray(SIZES, jnp.int32)
  _, keys = _keys(q, seed)
  gq = jg.quantize(x, sizes, q, keys=keys, state=jg.init_state(q, GROUPS))
  used = sum(SIZES)
  ref = np.asarray(x, np.float64)[:used]
  for direction, copy in (("rowwise", gq.rowwise), ("columnwise", gq.columnwise)):
    got = np.asarray(copy.tokens(), np.float64)
    _close(got[:used], ref, np.abs(ref).max(), 0.5, f"grouped {direction} tokens")
    assert not got[used:].any(), f"grouped {direction}: rows of no group are not zero"
  w = data["experts"]
  _, keys = _keys(q, seed + 1)
  qe = jg.quantize_experts(w, q, keys=keys, state=jg.init_state(q, GROUPS))
  for direction, copy, want in (("rowwise", qe.rowwise, w),
                                ("columnwise", qe.columnwise, jnp.swapaxes(w, 1, 2))):
    got = jax.vmap(lambda t: t.dequantize())(copy)
    want = np.asarray(want, np.float64)
    _close(got, want, np.abs(want).max(), 0.5, f"expert weights {direction}")


def layer_grouped_gemm(q, data, seed):
  x, dy, sizes = data["tokens"], data["grad_tokens"], jnp.asarray(SIZES, jnp.int32)
  col = q.for_direction("columnwise")
  block = wgrad_token_block(col, col)
  (_, kx), (_, kd), (_, kw) = _keys(q, seed), _keys(q, seed + 1), _keys(q, seed + 2)
  qx = jg.quantize(x, sizes, q, col_block=block, keys=kx, state=jg.init_state(q, GROUPS))
  qd = jg.quantize(dy, sizes, q, col_block=block, keys=kd, state=jg.init_state(q, GROUPS))
  qw = jg.quantize_experts(data["experts"], q, keys=kw, state=jg.init_state(q, GROUPS))
  used, starts = sum(SIZES), np.cumsum((0,) + SIZES)
  # forward: each token times its group's expert
  y = jg.to_tokens(jg.gemm(qx.rowwise, qw.rowwise), qx.rowwise)
  xt = np.asarray(qx.rowwise.tokens(), np.float64)
  wt = np.asarray(jax.vmap(lambda t: t.dequantize())(qw.rowwise), np.float64)
  tol = _gemm_tol(qx.rowwise, qw.rowwise, COLS)
  for g in range(GROUPS):
    rows = slice(starts[g], starts[g + 1])
    want, scale = _product(xt[rows], wt[g])
    _close(np.asarray(y)[rows], want, scale, tol, f"grouped forward GEMM, group {g}")
  assert not np.asarray(y)[used:].any()
  # wgrad: per group, x_g^T . dy_g over the group's positions in the token layout (with the RHT
  # the padding positions of a group's last chunk hold transformed values too)
  dw = np.asarray(jg.gemm(qx.columnwise, qd.columnwise))
  xc = np.asarray(qx.columnwise.dequantize(), np.float64)
  dc = np.asarray(qd.columnwise.dequantize(), np.float64)
  tol = _gemm_tol(qx.columnwise, qd.columnwise, TOKENS)
  for g, (start, extent) in enumerate(qx.columnwise.layout.group_slices(sizes)):
    span = slice(start, start + extent)
    want, scale = _product(xc[:, span], dc[:, span])
    _close(dw[g], want, scale, tol, f"grouped wgrad GEMM, group {g}")


def layer_storage_specs(q, data, seed):
  specs = jqs.storage_specs(q, P("data", "model"))
  qt = _quantize(q, data["x"], seed)
  for direction in ("rowwise", "columnwise"):
    t, spec = getattr(qt, direction), getattr(specs, direction)
    for field in ("data", "scale_inv", "amax"):
      leaf, leaf_spec = getattr(t, field), getattr(spec, field)
      assert (leaf is None) == (leaf_spec is None), f"{direction}.{field}: spec presence"
      if leaf is not None:
        assert len(tuple(leaf_spec)) == leaf.ndim, f"{direction}.{field}: spec {leaf_spec}"
  mesh = AbstractMesh((2, 2), ("data", "model"))
  jqs.check_blocks_fit(q, (256, 256), P("data", "model"), mesh)  # 128 per shard: every block
  for direction in ("rowwise", "columnwise"):
    leaf = q.for_direction(direction)
    block_rows, block_cols = format_of(leaf).copy_block(leaf, direction)
    # 48 per shard along the copy's cols: rejected exactly when a block or chunk spans it
    shape = (96, 256) if direction == "columnwise" else (256, 96)
    splits = 48 % block_cols != 0
    try:
      jqs.check_blocks_fit(q, shape, P("data", "model"), mesh, directions=(direction,))
      assert not splits, f"{direction}: a shard boundary cuts a {block_cols}-long block"
    except ValueError as err:
      assert splits and "would split" in str(err), str(err)


def layer_state(q, data, seed):
  fmt = format_of(q)
  state = jq.init_state(q)
  assert (state is not None) == fmt.stateful(q) == q.stateful
  qt = _quantize(q, data["x"], seed)
  new = jq.update_state(q, state, qt)
  assert (jax.tree_util.tree_structure(new) == jax.tree_util.tree_structure(state))
  grouped = jg.init_state(q, GROUPS)
  for leaf in jax.tree_util.tree_leaves(grouped):
    assert leaf.shape[0] == GROUPS
  _, keys = _keys(q, seed)
  qe = jg.quantize_experts(data["experts"], q, keys=keys, state=grouped)
  new = jg.update_state(q, grouped, qe)
  assert jax.tree_util.tree_structure(new) == jax.tree_util.tree_structure(grouped)


def layer_kernel_facts(q, data, seed):
  from jaxquant.backends.ffi.quantize import KERNEL_FORMATS
  for direction in ("rowwise", "columnwise"):
    leaf = q.for_direction(direction)
    fmt = format_of(leaf)
    assert fmt.quantize_kernel(leaf) in tuple(KERNEL_FORMATS) + (None,)
    assert fmt.gemm_family(leaf) in GEMM_FAMILIES
    assert isinstance(fmt.xla_fused(leaf), bool)
    route, reason = fmt.grouped_quantize_kernel(leaf, direction)
    assert route in ROUTES and (route is not None or (isinstance(reason, str) and reason))
    multiple = fmt.expert_rows_multiple(leaf, direction)
    assert multiple is None or (isinstance(multiple, int) and multiple >= 1)
    scaling = fmt.grouped_gemm_scaling(leaf)
    assert scaling is None or scaling in range(6)
    assert isinstance(fmt.grouped_gemm_operand(leaf), str)
    assert fmt.token_block(leaf, direction) >= 1


LAYERS = {
    "quantize": layer_quantize,
    "dequantize": layer_dequantize,
    "gemm": layer_gemm,
    "grouped_quantize": layer_grouped_quantize,
    "grouped_gemm": layer_grouped_gemm,
    "storage_specs": layer_storage_specs,
    "state": layer_state,
    "kernel_facts": layer_kernel_facts,
}


def _names_format(err: Exception, q) -> bool:
  names = {type(leaf).__name__ for leaf in q.leaves()} | {type(q).__name__}
  names |= {format_of(leaf).name for leaf in q.leaves() if type(leaf) in registered()}
  return any(n and n in str(err) for n in names)


def format_problems(q, rng, seed: int) -> tuple[dict[str, str], dict[str, str]]:
  """({layer: problem}, {layer: clear rejection}) of quantizer `q` through every layer."""
  data = {
      "x": jnp.asarray(rng.standard_normal((ROWS, COLS)), jnp.float32),
      "w": jnp.asarray(rng.standard_normal((OUT, COLS)), jnp.float32),
      "y": jnp.asarray(rng.standard_normal((ROWS, OUT)), jnp.float32),
      "tokens": jnp.asarray(rng.standard_normal((TOKENS, COLS)), jnp.float32),
      "grad_tokens": jnp.asarray(rng.standard_normal((TOKENS, OUT)), jnp.float32),
      "experts": jnp.asarray(rng.standard_normal((GROUPS, OUT, COLS)), jnp.float32),
  }
  problems, rejections = {}, {}
  for name, layer in LAYERS.items():
    try:
      layer(q, data, seed)
    except (ValueError, TypeError) as err:
      if _names_format(err, q):
        rejections[name] = str(err)
      else:
        problems[name] = f"{type(err).__name__}: {err}"
    except Exception as err:  # noqa: BLE001 - any other failure is what the check reports
      problems[name] = f"{type(err).__name__}: {err}"
  return problems, rejections


# --------------------------------------------- tests -------------------------------------------

def test_every_quantizer_class_has_a_format_with_variants_of_its_own_class():
  for cls, fmt in registered().items():
    assert fmt.name, f"{cls.__name__}'s format has no name"
    variants = fmt.variants()
    assert variants and all(type(v) is cls for v in variants), fmt.name
  public = {jq.Float8CurrentScalingQuantizer, jq.Float8DelayedScalingQuantizer, jq.MXFP8Quantizer,
            jq.NVFP4Quantizer, jq.Float8BlockQuantizer, jq.IdentityQuantizer, jq.HybridQuantizer}
  assert public <= set(registered())


@pytest.mark.parametrize("quantizer", _variants())
def test_every_layer_serves_the_format(quantizer, rng, seed):
  problems, rejections = format_problems(quantizer, rng, seed)
  assert not problems, f"{quantizer}: " + "; ".join(f"{k}: {v}" for k, v in problems.items())
  assert not rejections, f"{quantizer} is rejected by {rejections}"


# ------------------------------------- an incomplete format ------------------------------------

@dataclasses.dataclass(frozen=True)
class ToyQuantizer(jq.Quantizer):
  """Per-tensor int8-like rounding stored in float32: a format a maintainer has just begun."""

  levels: int = 127


class ToyFormat(Format):
  """Defines the reference math and its variants, none of the facts the layers ask."""

  name = "toy-int8"

  def quantize(self, mat, quantizer, ctx):
    amax = tensor_amax(mat)
    scale_inv = jnp.where(amax > 0, amax / quantizer.levels, 1.0)
    data = jnp.round(mat.astype(jnp.float32) / scale_inv)
    return ScaledTensor(data, scale_inv, amax, quantizer, ctx.orig_dtype, ctx.rht)

  def dequantize_raw(self, t):
    return t.data * t.scale_inv

  def variants(self):
    return (ToyQuantizer(),)


class CompletedToyFormat(ToyFormat):
  """The toy with every fact answered (no kernel serves it: the reference does, visibly)."""

  def grouped_quantize(self, mat, quantizer, ctx):
    raise ValueError(f"{type(quantizer).__name__}: no grouped quantization (toy-int8)")

  def blocks(self, quantizer):
    return None

  def scale_layout(self, quantizer):
    return "tensor"

  def amax_layout(self, quantizer):
    return "tensor"

  def scale_dtype(self, quantizer):
    return np.dtype(np.float32)

  def quantize_kernel(self, quantizer):
    return None

  def gemm_family(self, quantizer):
    return "hp"

  def grouped_quantize_kernel(self, quantizer, direction):
    return no_grouped_kernel(quantizer)

  def grouped_gemm_scaling(self, quantizer):
    return None


@pytest.fixture
def toy_format():
  """Registers `ToyFormat` for `ToyQuantizer` and removes it again after the test."""
  register(ToyQuantizer, ToyFormat())
  yield
  unregister(ToyQuantizer)
  assert ToyQuantizer not in registered()


def test_an_incomplete_format_fails_the_check_naming_what_it_misses(toy_format, rng, seed):
  problems, _ = format_problems(ToyQuantizer(), rng, seed)
  # the reference math alone serves no layer that asks a fact the toy does not define
  for layer in ("grouped_quantize", "grouped_gemm", "storage_specs", "kernel_facts"):
    assert layer in problems, f"{layer} passed an incomplete format"
    assert "does not define" in problems[layer] and "toy-int8" in problems[layer]
  assert "NotImplementedError" in problems["storage_specs"]
  assert "scale_layout" in problems["storage_specs"] or "blocks" in problems["storage_specs"]


def test_completing_the_toy_leaves_only_clear_rejections(toy_format, rng, seed):
  register(ToyQuantizer, CompletedToyFormat())
  problems, rejections = format_problems(ToyQuantizer(), rng, seed)
  assert not problems, problems
  assert set(rejections) == {"grouped_quantize", "grouped_gemm"}
  assert all("ToyQuantizer" in why for why in rejections.values())
