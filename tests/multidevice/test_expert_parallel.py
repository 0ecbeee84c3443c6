"""Expert parallelism (`jaxquant.expert_parallel`, a sharded `GroupedDense`, `examples/lm/moe.py`)
on 8 host CPU devices: the MoE layer on a mesh with experts sharded over `ep` equals the
single-device layer (global routing, every expert local), and its program moves tokens with
all-to-alls, never the expert weights."""

from __future__ import annotations

import importlib

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxquant as jq
import jaxquant.backends.ffi.gemm
import sharded

D, EXPERTS, TOP_K = 64, 8, 2


@pytest.fixture
def lm():
  return (importlib.import_module("lm.model"), importlib.import_module("lm.moe"),
          importlib.import_module("lm.sharding"))


def _moe(lm, experts=EXPERTS, recipe=None, capacity=None):
  model, moe, _ = lm
  config = model.LMConfig(d_model=D, heads=2, mlp_ratio=2, moe=(experts, TOP_K),
                          dtype=jnp.float32, moe_capacity=capacity)
  return moe.MoEMLP(config, recipe)


def _loss(module, c):
  return lambda v, x: jnp.sum(module.apply(v, x) * c)


def _sharded_step(lm, module, variables, x, c, axes):
  """(loss, grads, compiled collectives) on a mesh with `axes`."""
  _, _, lm_sharding = lm
  mesh = lm_sharding.make_mesh(axes)
  with lm_sharding.active(mesh):
    boxed = jax.eval_shape(module.init, jax.random.key(0), x)
    shardings = lm_sharding.state_shardings(boxed, mesh)
  params = jax.device_put(variables, nn.meta.unbox(shardings))
  batch = NamedSharding(mesh, P(lm_sharding.batch_axes(mesh)))
  xs, cs = jax.device_put(x, batch), jax.device_put(c, batch)
  grad_fn = jax.jit(jax.value_and_grad(lambda v, x, c: _loss(module, c)(v, x)))
  with lm_sharding.active(mesh):
    text = grad_fn.lower(params, xs, cs).compile().as_text()
    loss, grads = grad_fn(params, xs, cs)
  return loss, grads, sharded.collectives(text), params


@pytest.mark.parametrize("backend", ("reference", "ffi"))
@pytest.mark.parametrize("axes", [{"ep": 4}, {"dp": 2, "ep": 4}, {"ep": 8}, {"dp": 4}],
                         ids=["ep4", "dp2xep4", "ep8", "dp4"])
def test_expert_parallel_moe_equals_one_device(axes, backend, lm, devices, rng, monkeypatch):
  if len(devices) < 8:
    pytest.skip("needs 8 devices")
  monkeypatch.setenv("JAXQUANT_BACKEND", backend)
  monkeypatch.setattr(jaxquant.backends.ffi.gemm, "CPU_MAX_MACS", 1 << 26)
  # With a data axis each data shard's copy of an expert sees only that shard's tokens, and a
  # per-tensor FP8 scale follows their amax (not all of the expert's tokens'), so the FP8 layer
  # equals one device only where every expert's tokens meet on one device (ep alone); beside
  # dp the unquantized layer (ragged_dot) is compared.
  recipe = jq.Float8CurrentScaling() if set(axes) == {"ep"} else None
  module = _moe(lm, recipe=recipe)
  x = jnp.asarray(rng.standard_normal((8, 16, D)), jnp.float32)
  c = jnp.asarray(rng.standard_normal((8, 16, D)), jnp.float32)
  variables = nn.meta.unbox(jax.jit(module.init)(jax.random.key(1), x))
  want_loss, want_grads = jax.jit(jax.value_and_grad(_loss(module, c)))(variables, x)

  loss, grads, found, params = _sharded_step(lm, module, variables, x, c, axes)
  # float32 throughout; every expert sees the same rows as on one device (dropless), so its
  # per-expert FP8 scales and storages are the same; sums differ in order only: the weight
  # gradients add an expert's rows in another order, the data shards' gradients are summed.
  # The loss sums y * c over every element (it cancels): its tolerance is float32 reduction
  # order relative to the sum of the magnitudes, 1e-6 * sum|y c|.
  scale = float(jax.jit(lambda v, x: jnp.sum(jnp.abs(module.apply(v, x) * c)))(variables, x))
  np.testing.assert_allclose(loss, want_loss, rtol=0, atol=1e-6 * scale)
  for path, got in jax.tree_util.tree_leaves_with_path(grads):
    want = np.asarray(dict(jax.tree_util.tree_leaves_with_path(want_grads))[path], np.float64)
    got = np.asarray(got, np.float64)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5 * float(np.max(np.abs(want))),
                               err_msg=jax.tree_util.keystr(path))
  kernel = params["params"]["fc1"]["kernel"]
  ep = axes.get("ep", 1)
  assert kernel.sharding.is_equivalent_to(
      NamedSharding(kernel.sharding.mesh, P("ep" if ep > 1 else None)), 3), kernel.sharding
  expert_elements = EXPERTS * D * 2 * D // ep  # one device's experts of fc1 (or fc2)
  gathers = [c for c in found if c.op == "all-gather" and c.elements >= expert_elements]
  assert not gathers, f"expert weights gathered: {gathers}"
  to_all = [c for c in found if c.op in ("all-to-all", "ragged-all-to-all")]
  if ep > 1:  # dispatch and combine, forward and backward (ragged ones on GPUs)
    assert len(to_all) >= 4, found
  else:
    assert not to_all, found


def test_experts_not_divisible_by_ep_is_an_error_at_trace_time(lm, devices, rng):
  if len(devices) < 4:
    pytest.skip("needs 4 devices")
  _, _, lm_sharding = lm
  module = _moe(lm, experts=6, recipe=jq.Float8CurrentScaling())
  x = jnp.asarray(rng.standard_normal((8, 16, D)), jnp.float32)
  mesh = lm_sharding.make_mesh({"ep": 4})
  with lm_sharding.active(mesh), pytest.raises(ValueError, match="experts=6 is not divisible "
                                                                "by the 4 devices"):
    jax.eval_shape(module.init, jax.random.key(0), x)


def test_capacity_drops_are_counted(lm, devices, rng, monkeypatch):
  """A capacity below the busiest pair's load drops assignments (zero output) and says how
  many; dropless buffers drop none."""
  if len(devices) < 4:
    pytest.skip("needs 4 devices")
  monkeypatch.setenv("JAXQUANT_BACKEND", "reference")
  _, _, lm_sharding = lm
  x = jnp.asarray(rng.standard_normal((8, 16, D)), jnp.float32)
  variables = nn.meta.unbox(jax.jit(_moe(lm).init)(jax.random.key(1), x))
  mesh = lm_sharding.make_mesh({"ep": 4})
  dropped = {}
  for capacity in (None, 0.25):
    module = _moe(lm, capacity=capacity)
    with lm_sharding.active(mesh):
      _, state = jax.jit(lambda v, x: module.apply(v, x, mutable=["intermediates"]))(
          variables, x)
    dropped[capacity] = int(state["intermediates"]["dropped"][0])
  assert dropped[None] == 0
  # 128 assignments per device, 8 per (sender, receiver) pair at factor 0.25: most are dropped.
  assert dropped[0.25] > 0


def test_train_lm_trains_moe_with_experts_over_ep(lm, devices, tmp_path):
  if len(devices) < 8:
    pytest.skip("needs 8 devices")
  train_lm = importlib.import_module("train_lm")
  result = train_lm.main(["--mesh", "dp=2,ep=4", "--moe", "8,2", "--recipe", "fp8_current",
                          "--steps", "6", "--eval-every", "6", "--lr", "1e-2", "--warmup", "2",
                          "--d-model", "64", "--layers", "1", "--heads", "2", "--seq", "32",
                          "--batch", "8", "--data-mb", "0.3", "--eval-batches", "1",
                          "--no-progress", "--out", str(tmp_path), "--backend", "reference"])
  (history,) = result["histories"]
  assert np.isfinite(history.step_losses).all()
  assert history.rows[-1]["train_loss"] < history.rows[0]["train_loss"] - 0.3, history.rows
