"""The ragged expert exchange (`jax.lax.ragged_all_to_all`) against the fixed-size dropless one.

Both must hand every expert device the same rows in the same order with the same `group_sizes`,
so a MoE layer's outputs and gradients are the same **bit for bit** whichever moved the rows.
XLA:CPU cannot compile `ragged-all-to-all`, so on the 8 host CPU devices the collective is
replaced by an emulation of its documented semantics (all-gathers and a scatter; autodiff
through it, not JAX's transpose rule), the program with the real collective is lowered and
inspected, and `jaxquant.explain` must report the fixed exchange with its reason. The tests
marked `gpu` run the real collective and its transpose on 2 and 4 GPUs (skipped elsewhere):

    JAXQUANT_MULTIDEVICE=1 python -m pytest -q tests/multidevice/test_expert_parallel_ragged.py
"""

from __future__ import annotations

import importlib
import re
from typing import Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jaxquant as jq
from jaxquant import expert_parallel

EXPERTS, TOP_K, D, N = 8, 2, 32, 48
MESHES = {"ep2": {"ep": 2}, "ep4": {"ep": 4}, "ep8": {"ep": 8}, "dp2xep4": {"dp": 2, "ep": 4}}


def emulated_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets,
                               recv_sizes, *, axis_name, axis_index_groups=None):
  """`jax.lax.ragged_all_to_all` as its docstring defines it, from all-gathers and a scatter
  (every device gathers every sender's rows and keeps the slices addressed to it)."""
  assert axis_index_groups is None
  del recv_sizes  # implied by the senders' send_sizes
  rows = lax.all_gather(operand, axis_name)  # [n, A, ...]
  starts, sizes, targets = (lax.all_gather(a, axis_name)
                            for a in (input_offsets, send_sizes, output_offsets))  # [n, K]
  senders, slices = starts.shape
  per_device, me = slices // senders, lax.axis_index(axis_name)
  t = jnp.arange(operand.shape[0])
  result = output
  for sender in range(senders):
    for j in range(per_device):
      i = me * per_device + j
      dst = jnp.where(t < sizes[sender, i], targets[sender, i] + t, output.shape[0])
      src = jnp.clip(starts[sender, i] + t, 0, operand.shape[0] - 1)
      result = result.at[dst].set(rows[sender][src], mode="drop")
  return result


def _mesh(axes: dict[str, int]) -> Mesh:
  need = int(np.prod(list(axes.values())))
  return Mesh(np.array(jax.devices()[:need]).reshape(tuple(axes.values())), tuple(axes))


def _needs(devices: int, platform: Optional[str] = None):
  found = jax.devices()
  if platform is not None and jax.default_backend() != platform:
    pytest.skip(f"needs {platform} devices, running on {jax.default_backend()}")
  if len(found) < devices:
    pytest.skip(f"needs {devices} devices, found {len(found)}")


def _routing(rng, tokens: int):
  """Distinct top-k experts per token, with router weights."""
  chosen = np.argsort(rng.random((tokens, EXPERTS)), axis=1)[:, :TOP_K].astype(np.int32)
  weights = rng.random((tokens, TOP_K)).astype(np.float32) + 0.1
  return chosen, weights


def _experts(mesh: Mesh, token_spec: P):
  """Each device's `ragged_dot` of its rows with its experts' kernels."""
  return jax.shard_map(lambda r, k, g: lax.ragged_dot(r, k, g), mesh=mesh,
                       in_specs=(token_spec, P("ep"), token_spec), out_specs=token_spec,
                       check_vma=False)


def _expert_step(layout: expert_parallel.ExpertSharding):
  """One program: loss(x, weights, kernels) through dispatch, each device's `ragged_dot` on
  its experts, and combine, with its gradients; plus the dispatched rows, group sizes and the
  combined output."""
  experts = _experts(layout.mesh, layout.token_spec)

  def loss(x, weights, kernels, chosen, c):
    rows, group_sizes, dispatched = expert_parallel.dispatch(x, chosen, layout)
    y = expert_parallel.combine(experts(rows, kernels, group_sizes), weights, dispatched, layout)
    return jnp.sum(y.astype(jnp.float32) * c), (rows, group_sizes, y)

  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))


def _staged_steps(layouts: dict, args) -> dict:
  """The same step in stages, each its own program: dispatch, experts, combine + loss, then the
  backward of each (`jax.vjp`: JAX's transpose of the exchange). The expert programs are
  shared by both exchanges (one compiled GEMM), so any difference comes from the exchanges."""
  x, weights, kernels, chosen, c = args
  any_layout = next(iter(layouts.values()))
  experts = _experts(any_layout.mesh, any_layout.token_spec)
  experts_fwd = jax.jit(experts)
  experts_bwd = jax.jit(lambda r, k, g, dy: jax.vjp(lambda r, k: experts(r, k, g), r, k)[1](dy))
  results = {}
  for name, layout in layouts.items():
    rows, sizes, dispatched = jax.jit(
        lambda x, ch: expert_parallel.dispatch(x, ch, layout))(x, chosen)
    expert_out = experts_fwd(rows, kernels, sizes)

    def combined(y, w, d):
      out = expert_parallel.combine(y, w, d, layout)
      return jnp.sum(out.astype(jnp.float32) * c), out

    (loss, y), (d_out, d_weights) = jax.jit(jax.value_and_grad(
        combined, argnums=(0, 1), has_aux=True))(expert_out, weights, dispatched)
    d_rows, d_kernels = experts_bwd(rows, kernels, sizes, d_out)
    d_x = jax.jit(lambda x, ch, dr: jax.vjp(
        lambda x: expert_parallel.dispatch(x, ch, layout)[0], x)[1](dr)[0])(x, chosen, d_rows)
    results[name] = jax.device_get(((loss, (rows, sizes, y)), (d_x, d_weights, d_kernels)))
  return results


def _inputs(rng, mesh: Mesh, token_axes, dtype, tokens: int = 64):
  chosen, weights = _routing(rng, tokens)
  put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))
  tok = P(token_axes)
  x = put(jnp.asarray(rng.standard_normal((tokens, D)), dtype), tok)
  kernels = put(jnp.asarray(rng.standard_normal((EXPERTS, D, N)) / np.sqrt(D), dtype), P("ep"))
  c = put(jnp.asarray(rng.standard_normal((tokens, N)), jnp.float32), tok)
  return x, put(jnp.asarray(weights, dtype), tok), kernels, put(jnp.asarray(chosen), tok), c


def _both_exchanges(axes, rng, dtype, staged: bool = False):
  mesh = _mesh(axes)
  token_axes = tuple(axes)
  args = _inputs(rng, mesh, token_axes if len(token_axes) > 1 else token_axes[0], dtype)
  layouts = {exchange: expert_parallel.ExpertSharding(mesh, token_axes, "ep", EXPERTS,
                                                      exchange=exchange)
             for exchange in ("ragged", "fixed")}
  if staged:
    return _staged_steps(layouts, args)
  return {name: jax.device_get(_expert_step(layout)(*args)) for name, layout in layouts.items()}


def _assert_identical(results):
  (loss_r, (rows_r, sizes_r, y_r)), grads_r = results["ragged"]
  (loss_f, (rows_f, sizes_f, y_f)), grads_f = results["fixed"]
  np.testing.assert_array_equal(sizes_r, sizes_f)
  np.testing.assert_array_equal(np.asarray(rows_r, np.float32), np.asarray(rows_f, np.float32))
  np.testing.assert_array_equal(np.asarray(y_r, np.float32), np.asarray(y_f, np.float32))
  assert np.asarray(loss_r) == np.asarray(loss_f)
  for name, g_r, g_f in zip(("x", "weights", "kernels"), grads_r, grads_f):
    np.testing.assert_array_equal(np.asarray(g_r, np.float32), np.asarray(g_f, np.float32),
                                  err_msg=f"gradient of {name}")
    assert np.abs(np.asarray(g_r, np.float32)).max() > 0, name


@pytest.fixture
def lm():
  return (importlib.import_module("lm.model"), importlib.import_module("lm.moe"),
          importlib.import_module("lm.sharding"))


# ------------------------------------------- host CPUs ------------------------------------------

@pytest.mark.parametrize("mesh_name,staged", [("ep4", False), ("ep8", False),
                                               ("dp2xep4", False), ("ep4", True)],
                         ids=["ep4", "ep8", "dp2xep4", "ep4-staged"])
def test_emulated_ragged_exchange_equals_the_fixed_one_bit_for_bit(mesh_name, staged, rng,
                                                                   monkeypatch):
  """One program per exchange (and, as the GPU test runs it, in stages)."""
  _needs(8)
  monkeypatch.setattr(jax.lax, "ragged_all_to_all", emulated_ragged_all_to_all)
  _assert_identical(_both_exchanges(MESHES[mesh_name], rng, jnp.float32, staged))


def test_the_ragged_program_moves_rows_only_by_ragged_all_to_all(rng):
  """dispatch + combine and their transposes: 4 ragged all-to-alls of rows; the plain
  all-to-alls left move int32 offsets only (JAX's transpose rule), the all-gather the counts."""
  _needs(4)
  mesh = _mesh({"ep": 4})
  layout = expert_parallel.ExpertSharding(mesh, ("ep",), "ep", EXPERTS, exchange="ragged")
  args = _inputs(rng, mesh, "ep", jnp.float32)
  text = _expert_step(layout).lower(*args).as_text()  # XLA:CPU could not compile it
  assert len(re.findall(r"custom_call @ragged_all_to_all\(", text)) == 4, text
  plain = re.findall(r'"stablehlo.all_to_all"\(%[\w#]+\).*?: \((tensor<[^>]*>)\)', text)
  assert plain and all(t.endswith("xi32>") for t in plain), plain
  gathers = re.findall(r'"stablehlo.all_gather"\(%[\w#]+\).*?: \((tensor<[^>]*>)\)', text)
  assert gathers == [f"tensor<1x{EXPERTS}xi32>"], gathers


def test_explain_reports_the_exchange_taken_and_why(rng):
  _needs(4)
  mesh = _mesh({"ep": 4})
  args = _inputs(rng, mesh, "ep", jnp.float32)
  on_gpu = jax.default_backend() == "gpu"
  cases = {("auto", None): ("all-to-all", "measured slower than the fixed-size exchange"
                            if on_gpu else "XLA:CPU does not compile ragged_all_to_all"),
           ("ragged", None): ("ragged-all-to-all", ""),
           ("auto", 1.5): ("all-to-all", "capacity_factor=1.5"),
           ("fixed", None): ("all-to-all", "exchange='fixed' asked for")}
  for (exchange, capacity), (path, reason) in cases.items():
    layout = expert_parallel.ExpertSharding(mesh, ("ep",), "ep", EXPERTS, capacity, exchange)
    report = jq.explain(lambda *a: _expert_step(layout)(*a)[0][0], *args)
    (decision,) = [d for d in report if d.op == "ep-exchange"]
    assert decision.path == path, (exchange, capacity, str(report))
    assert reason in decision.reason and (reason or not decision.reason), decision
    assert f"{EXPERTS} experts over ep=4 (2 per device)" in decision.detail


@pytest.mark.parametrize("exchange", ["ragged", "fixed"])
def test_the_lm_moe_layer_takes_the_configured_exchange(exchange, lm, rng):
  """`LMConfig.moe_exchange` reaches `ExpertSharding` (traced only: nothing compiled)."""
  _needs(4)
  model, moe, lm_sharding = lm
  config = model.LMConfig(d_model=D, heads=2, mlp_ratio=2, moe=(EXPERTS, TOP_K),
                          dtype=jnp.float32, moe_exchange=exchange)
  module = moe.MoEMLP(config)
  x = jnp.asarray(rng.standard_normal((8, 16, D)), jnp.float32)
  with lm_sharding.active(lm_sharding.make_mesh({"ep": 4})):
    report = jq.explain(module.init, jax.random.key(0), x)
  (decision,) = [d for d in report if d.op == "ep-exchange"]
  assert decision.path == {"ragged": "ragged-all-to-all", "fixed": "all-to-all"}[exchange]


# --------------------------------------------- GPUs ---------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("mesh_name", ["ep2", "ep4"])
def test_gpu_ragged_exchange_equals_the_fixed_one_bit_for_bit(mesh_name, rng):
  """The real collective and JAX's transpose of it, bf16 rows and experts, staged so both
  exchanges feed one compiled expert GEMM (forward and backward)."""
  axes = MESHES[mesh_name]
  _needs(axes["ep"], "gpu")
  _assert_identical(_both_exchanges(axes, rng, jnp.bfloat16, staged=True))


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", [None, "fp8_current"])
def test_gpu_moe_layer_is_the_same_with_either_exchange(recipe, lm, rng):
  """`examples/lm`'s MoE layer (router, GroupedDense experts, GELU) at ep=4 in bf16, each
  exchange one whole program: "auto" takes the fixed dropless exchange on GPUs too (XLA's
  one-shot ragged kernel measured slower); the ragged exchange's loss and gradients match the
  fixed one's. The rows every expert sees are the same bits (the staged test), but
  XLA compiles the two programs separately and may pick other GEMM kernels or fusions, so the
  bound is one bf16 rounding (2^-8) of the largest element per leaf; whether they came out
  bit-identical is printed."""
  _needs(4, "gpu")
  model, moe, lm_sharding = lm
  x = jnp.asarray(rng.standard_normal((8, 32, 64)), jnp.bfloat16)
  c = jnp.asarray(rng.standard_normal((8, 32, 64)), jnp.float32)
  mesh = lm_sharding.make_mesh({"ep": 4})
  results, paths = {}, {}
  for exchange in ("auto", "ragged", "fixed"):
    config = model.LMConfig(d_model=64, heads=2, mlp_ratio=2, moe=(EXPERTS, TOP_K),
                            dtype=jnp.bfloat16, moe_exchange=exchange)
    module = moe.MoEMLP(config, None if recipe is None else jq.Float8CurrentScaling())
    with lm_sharding.active(mesh):
      boxed = jax.eval_shape(module.init, jax.random.key(0), x)
      shardings = nn.meta.unbox(lm_sharding.state_shardings(boxed, mesh))
      variables = jax.device_put(nn.meta.unbox(jax.jit(module.init)(jax.random.key(1), x)),
                                 shardings)
      batch = NamedSharding(mesh, P(lm_sharding.batch_axes(mesh)))
      xs, cs = jax.device_put(x, batch), jax.device_put(c, batch)
      loss_fn = lambda v, x, c: jnp.sum(module.apply(v, x).astype(jnp.float32) * c)
      grad_fn = jax.jit(jax.value_and_grad(loss_fn))
      report = jq.explain(grad_fn, variables, xs, cs)
      paths[exchange] = {d.path for d in report if d.op == "ep-exchange"}
      if exchange != "auto":
        results[exchange] = jax.device_get(grad_fn(variables, xs, cs))
  assert paths == {"auto": {"all-to-all"}, "ragged": {"ragged-all-to-all"},
                   "fixed": {"all-to-all"}}, paths
  (loss_r, grads_r), (loss_f, grads_f) = results["ragged"], results["fixed"]
  flat_f = dict(jax.tree_util.tree_leaves_with_path(grads_f))
  identical = loss_r == loss_f
  np.testing.assert_allclose(loss_r, loss_f, rtol=2**-8)
  for path, got in jax.tree_util.tree_leaves_with_path(grads_r):
    got, want = np.asarray(got, np.float32), np.asarray(flat_f[path], np.float32)
    identical &= np.array_equal(got, want)
    np.testing.assert_allclose(got, want, rtol=0, atol=2**-8 * np.abs(want).max(),
                               err_msg=jax.tree_util.keystr(path))
  print(f"[moe layer {recipe or 'bf16'}, ep=4] ragged vs fixed bit-identical: {identical}")
