"""Partial sums of K-sharded GEMMs: reduced in the GEMM's output dtype by default (FP8 moves no
more bytes than bf16), in float32 on request; FSDP weight gradients are reduce-scattered.

Counted in the compiled HLO of a Flax MLP's training step (fc1 column-parallel, fc2 row-parallel) on
the host CPU devices or the GPUs the suite runs on. Payload = the all-reduces and reduce-scatters
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
from jaxquant import hlo
import bounds
import per_layer
import sharded

RULES = (("batch", ("dp", "fsdp")), ("length", None), ("act_embed", None), ("act_mlp", "tp"),
         ("embed", "fsdp"), ("mlp", "tp"))
MESHES = {"dp": lambda n: (n, 1, 1), "tp": lambda n: (1, 1, n),
          "dp_tp": lambda n: (2, 1, n // 2)}  # (dp, fsdp, tp) over n devices
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
  """(compiled collectives, lowered reductions) of the sharded step."""
  step = jax.jit(jax.value_and_grad(_loss(model)))
  specs = nn.logical_to_mesh_sharding(nn.get_partition_spec(variables), mesh, RULES)
  v = jax.device_put(nn.meta.unbox(variables), nn.meta.unbox(specs))  # (unbox outside the mesh)
  with jax.set_mesh(mesh), nn.logical_axis_rules(RULES):
    xs = jax.device_put(x, NamedSharding(mesh, P(("dp", "fsdp"))))
    lowered = step.lower(v, xs)
    text = lowered.compile().as_text()
  return sharded.collectives(text), lowered_reductions(lowered.as_text())


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
  if mesh_name == "dp_tp" and len(devices) < 4:
    pytest.skip(f"dp x tp needs 4 devices, found {len(devices)}")
  mesh = _mesh(devices, MESHES[mesh_name](len(devices)))
  x = jnp.asarray(rng.standard_normal((8, 32, D)), jnp.bfloat16)
  variables = jax.jit(MLP().init)(jax.random.key(0), x)
  runs = {}
  for name, model in (("bf16", MLP()), ("fp8", MLP(jq.Float8CurrentScaling())),
                      ("fp8_f32", MLP(jq.Float8CurrentScaling(), jnp.float32))):
    runs[name] = _compiled_step(model, variables, x, mesh)
  measure = ((lambda c: c.bytes) if jax.default_backend() == "gpu"
             else (lambda c: c.elements))  # (XLA:CPU widens bf16 all-reduces to float32)
  payload = {name: sum(measure(c) for c in _payload(found)) for name, (found, _) in
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
  # Values and gradients of each layer on its own (per_layer.py says why not the whole
  # model), in both modes: bf16 outputs, and partial sums rounded to bf16 and reduced in bf16
  # (bounds.py: s * 2^-8 * sum|terms| for s shards) or in float32. On the dp x tp mesh, whose
  # layers reduce over both axes (fc2's K over tp, the weight gradients' tokens over dp), where
  # it can be made (on the dp and tp meshes too these took ~10 CPU-s more).
  if mesh_name != "dp_tp" and len(devices) >= 4:
    return
  for name in ("fp8", "fp8_f32"):
    model = MLP(jq.Float8CurrentScaling(), None if name == "fp8" else jnp.float32)
    per_layer.assert_layers_match_single_device(model, variables, x, mesh, RULES, rng)


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
  # XLA:GPU combines the weight's reduce-scatter with another into one collective of two
  # arrays (seen on 2 H100s): count the arrays and bytes reduce-scattered, not collectives.
  scattered = [(t, math.prod(s)) for c in found if c.op == "reduce-scatter" for t, s in c.arrays]
  assert ("f32", shard) in scattered, found
  moved = hlo.summarize(found)
  # dW's shard, and besides at most the step's only other sum, the bias gradient (N float32).
  assert 4 * shard <= moved["reduce-scatter"]["bytes"] <= 4 * (shard + sharded.N), found
  # Never the whole gradient all-reduced: at most dW's shard over the data axis, db, amaxes.
  assert moved.get("all-reduce", {"bytes": 0})["bytes"] < 4 * weight, found
  (reduce,) = [d for d in report if d.op == "reduce" and "wgrad" in str(d.role)]
  want = "reduce-scatter+all-reduce" if mesh.shape["dp"] > 1 else "reduce-scatter"
  assert reduce.path == want, reduce
  # ... and the gradient equals the single-device one within bounds.py's reordered-sum bound.
  _, dw, _ = jax.jit(step)(*args)
  single = lambda w, dy: jax.vjp(lambda w: jq.dense(x, w, b, quantizers), w)[1](dy)[0]
  want_dw = jax.jit(single)(w, dy)
  rows = math.prod(x.shape[:-1])
  how = bounds.gemm_sums(jq.explain(single, w, dy), report, mesh, {"wgrad": rows})["wgrad"]
  _, (magnitude, _) = bounds.linear_magnitudes(
      lambda w, x: jq.dense(x, w, None, quantizers), w, x, dy)
  bounds.assert_within(dw, want_dw, magnitude, how, "dW")
  assert dw.sharding.is_equivalent_to(NamedSharding(mesh, layout.kernel), 2), dw.sharding
