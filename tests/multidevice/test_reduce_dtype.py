"""Partial sums of K-sharded GEMMs: reduced in the GEMM's output dtype by default (FP8 moves no
more bytes than bf16), in float32 on request; FSDP weight gradients are reduce-scattered.

Counted in the compiled HLO of a Flax MLP's training step (fc1 column-parallel, fc2
row-parallel) on 8 host CPU devices (or the GPUs). Payload = the all-reduces and reduce-scatters
with more than 16 elements; the others are the scalar amax `pmax`es of current scaling. XLA:CPU
widens every bf16 all-reduce to float32 in the compiled program (the bf16 model's too), so on CPU
the compiled payloads are compared in elements and the reduction dtype is read from the lowered
program (the GEMMs' own collectives are there, before XLA's passes); on GPU in bytes.
"""

from __future__ import annotations

import math
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jaxquant as jq
import jaxquant.backends.ffi.gemm
import jaxquant.flax as jf
import sharded

RULES = (("batch", ("dp", "fsdp")), ("length", None), ("act_embed", None), ("act_mlp", "tp"),
         ("embed", "fsdp"), ("mlp", "tp"))
MESHES = {"dp": (8, 1, 1), "tp": (1, 1, 8), "dp_tp": (2, 1, 4)}
D, HIDDEN = 128, 512
SMALL = 16  # elements: an all-reduce up to this size is an amax, not a payload


class MLP(nn.Module):
  recipe: object = None
  reduce_dtype: object = None

  @nn.compact
  def __call__(self, x):
    common = dict(dtype=jnp.bfloat16, recipe=self.recipe, reduce_dtype=self.reduce_dtype)
    h = jf.Dense(HIDDEN, kernel_axes=("embed", "mlp"),
                 input_axes=("batch", "length", "act_embed"), name="fc1", **common)(x)
    return jf.Dense(D, kernel_axes=("mlp", "embed"), input_axes=("batch", "length", "act_mlp"),
                    name="fc2", **common)(nn.gelu(h))


def _loss(model):
  return lambda v, x: jnp.mean(jnp.square(model.apply(v, x).astype(jnp.float32)))


def _mesh(devices, shape) -> Mesh:
  return Mesh(np.array(devices[:math.prod(shape)]).reshape(shape), sharded.AXES)


def _compiled_step(model, variables, x, mesh):
  """(compiled collectives, lowered reductions, (loss, grads)) of the sharded step."""
  step = jax.jit(jax.value_and_grad(_loss(model)))
  specs = nn.logical_to_mesh_sharding(nn.get_partition_spec(variables), mesh, RULES)
  v = jax.device_put(nn.meta.unbox(variables), nn.meta.unbox(specs))  # (unbox outside the mesh)
  with jax.set_mesh(mesh), nn.logical_axis_rules(RULES):
    xs = jax.device_put(x, NamedSharding(mesh, P(("dp", "fsdp"))))
    lowered = step.lower(v, xs)
    text = lowered.compile().as_text()
    out = step(v, xs)
  return sharded.collectives(text), lowered_reductions(lowered.as_text()), out


_LOWERED = re.compile(r'"stablehlo\.(all_reduce|reduce_scatter)".*?\}\) : \(tensor<([^>]*)>\)',
                      re.DOTALL)


def lowered_reductions(text: str) -> list[tuple[str, str, int]]:
  """(op, element type, elements) of every all_reduce / reduce_scatter in StableHLO text."""
  found = []
  for op, tensor in _LOWERED.findall(text):
    *dims, dtype = tensor.split("x")
    found.append((op, dtype, math.prod(int(d) for d in dims)))
  return found


def _payload(found):
  return [c for c in found if c.op in ("all-reduce", "reduce-scatter") and c.elements > SMALL]


@pytest.fixture
def ffi_backend(monkeypatch):
  monkeypatch.setenv("JAXQUANT_BACKEND", "ffi")
  monkeypatch.setattr(jaxquant.backends.ffi.gemm, "CPU_MAX_MACS", 1 << 26)


@pytest.mark.parametrize("mesh_name", list(MESHES))
def test_fp8_reduces_no_more_bytes_than_bf16(mesh_name, devices, rng, ffi_backend):
  if len(devices) < 8:
    pytest.skip("needs 8 devices")
  mesh = _mesh(devices, MESHES[mesh_name])
  x = jnp.asarray(rng.standard_normal((8, 32, D)), jnp.bfloat16)
  variables = jax.jit(MLP().init)(jax.random.key(0), x)
  unboxed = nn.meta.unbox(variables)
  runs = {}
  for name, model in (("bf16", MLP()), ("fp8", MLP(jq.Float8CurrentScaling())),
                      ("fp8_f32", MLP(jq.Float8CurrentScaling(), jnp.float32))):
    runs[name] = _compiled_step(model, variables, x, mesh)
  measure = ((lambda c: c.bytes) if jax.default_backend() == "gpu"
             else (lambda c: c.elements))  # (XLA:CPU widens bf16 all-reduces to float32)
  payload = {name: sum(measure(c) for c in _payload(found)) for name, (found, _, _) in
             runs.items()}
  assert payload["bf16"] > 0, runs["bf16"][0]
  assert payload["fp8"] <= payload["bf16"], (payload, _payload(runs["fp8"][0]),
                                             _payload(runs["bf16"][0]))
  fp8_found = runs["fp8"][0]
  assert all(c.elements <= SMALL for c in fp8_found if c not in _payload(fp8_found)), fp8_found
  # The GEMMs' own reductions: bf16 partial sums by default, float32 ones on request.
  for name, want in (("fp8", "bf16"), ("fp8_f32", "f32")):
    gemm_reductions = [r for r in runs[name][1] if r[2] > SMALL]
    assert gemm_reductions and {t for _, t, _ in gemm_reductions} == {want}, (name,
                                                                               runs[name][1])
  if jax.default_backend() == "gpu":
    assert payload["fp8_f32"] >= 1.9 * payload["bf16"], payload
  # The model computes in bf16, so its gradients are bf16 values: a sum taken in another order
  # (over shards) may round to the neighbouring bf16 value (2^-8 relative), on one device too,
  # whatever the reduce dtype. Bounds: the float32 mode within 1e-2 (relative norm; loss 1e-5),
  # the default bf16 partial sums (one more bf16 rounding per shard) within 6e-2 (loss 2e-2): a
  # value that moves by one bf16 step (2^-8) flips the E4M3 rounding of an element near a rounding
  # boundary by a whole E4M3 step (2^-3), and the next quantized GEMMs carry that on (measured
  # 3.0-4.0% over 8 seeds on 8 CPU devices; float32 partial sums give the same flips far less often).
  single = jax.jit(jax.value_and_grad(_loss(MLP(jq.Float8CurrentScaling()))))(unboxed, x)
  for name, loss_rtol, grad_rtol in (("fp8_f32", 1e-5, 1e-2), ("fp8", 2e-2, 6e-2)):
    loss, grads = runs[name][2]
    np.testing.assert_allclose(loss, single[0], rtol=loss_rtol, err_msg=name)
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(single[1])):
      got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
      assert np.linalg.norm(got - want) <= grad_rtol * np.linalg.norm(want), name


@pytest.mark.parametrize("backend", ("reference", "ffi"))
def test_fsdp_weight_gradient_is_reduce_scattered(backend, devices, rng, monkeypatch):
  monkeypatch.setenv("JAXQUANT_BACKEND", backend)
  monkeypatch.setattr(jaxquant.backends.ffi.gemm, "CPU_MAX_MACS", 1 << 26)
  layout = sharded.LAYOUTS["fsdp"]
  mesh = sharded.make_mesh(devices, layout.main)
  quantizers = sharded.quantizers_of(jq.Float8CurrentScaling())
  x, w, b, dy, key = sharded.inputs(rng, layout, mesh)
  sharding = jq.sharding.DenseSharding(layout.x, layout.kernel, mesh)

  def step(x, w, b, dy):
    y, vjp = jax.vjp(lambda x, w, b: jq.dense(x, w, b, quantizers, sharding=sharding), x, w, b)
    return vjp(dy)

  args = sharded.put(mesh, layout, x, w, b, dy)
  report = jq.explain(step, *args)
  found = sharded.collectives(jax.jit(step).lower(*args).compile().as_text())
  weight = sharded.K * sharded.N
  shard = weight // mesh.shape["fsdp"]
  scatters = [c for c in found if c.op == "reduce-scatter"]
  assert [c.elements for c in scatters] == [shard], found
  assert not [c for c in found if c.op == "all-reduce" and c.elements >= weight], found
  (reduce,) = [d for d in report if d.op == "reduce" and "wgrad" in str(d.role)]
  want = "reduce-scatter+all-reduce" if mesh.shape["dp"] > 1 else "reduce-scatter"
  assert reduce.path == want, reduce
  # ... and the gradient still equals the single-device one (float32 reduction order).
  _, dw, _ = jax.jit(step)(*args)
  _, vjp = jax.vjp(lambda w: jq.dense(x, w, b, quantizers), w)
  (want_dw,) = jax.jit(lambda dy: vjp(dy))(dy)
  np.testing.assert_allclose(np.asarray(dw), np.asarray(want_dw), rtol=1e-5,
                             atol=1e-5 * float(np.max(np.abs(want_dw))))
  assert dw.sharding.is_equivalent_to(NamedSharding(mesh, layout.kernel), 2), dw.sharding
