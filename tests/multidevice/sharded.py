"""Shared pieces of the multi-device tests: meshes, layouts, recipes, one sharded dense step,
and a parser of the collectives in compiled HLO."""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jaxquant as jq
from jaxquant import sharding as jqs
from jaxquant.hlo import Collective, collectives  # noqa: F401  (re-exported for the tests)

AXES = ("dp", "fsdp", "tp")


@dataclasses.dataclass(frozen=True)
class Layout:
  """x `[B, S, K]` and kernel `[K, N]` specs; `main` is the mesh axis the layout is about (2
  devices of it on every mesh, see `make_mesh`)."""

  name: str
  x: P
  kernel: P
  main: str


LAYOUTS = {
    "dp": Layout("dp", P("dp", None, None), P(None, None), "dp"),
    "fsdp": Layout("fsdp", P(("dp", "fsdp"), None, None), P("fsdp", None), "fsdp"),
    "column_parallel": Layout("column_parallel", P("dp", None, None), P(None, "tp"), "tp"),
    "row_parallel": Layout("row_parallel", P("dp", None, "tp"), P("tp", None), "tp"),
    "sequence": Layout("sequence", P("dp", "tp", None), P(None, None), "tp"),
}

RECIPES = {name: cls for name, cls in jq.BUILTIN_RECIPES.items()}
RECIPES["zoo:mxfp8_fwd_nvfp4_bwd"] = lambda: jq.CustomRecipe(
    jq.factories.ZOO["mxfp8_fwd_nvfp4_bwd"])

# GEMM rows 512, K 256, N 256: every shard of every layout holds whole blocks of every format
# (128-long Float8Block blocks included) with 2 devices along each mesh axis.
ROWS, K, N = 512, 256, 256
# With 4 devices the main axis and this one get 2 each.
SECOND_AXIS = {"dp": "fsdp", "fsdp": "dp", "tp": "dp"}


def make_mesh(devices, main: str) -> Mesh:
  """(dp, fsdp, tp) = (2, 2, 2) on 8 devices; on 4, the layout's main axis and a data axis
  (`SECOND_AXIS`) get 2 each; on 2 devices the main axis gets both."""
  if len(devices) >= 8:
    shape = (2, 2, 2)
  elif len(devices) >= 4:
    shape = tuple(2 if axis in (main, SECOND_AXIS[main]) else 1 for axis in AXES)
  else:
    shape = tuple(2 if axis == main else 1 for axis in AXES)
  return Mesh(np.array(devices[:math.prod(shape)]).reshape(shape), AXES)


def x_shape(layout: Layout, mesh: Mesh) -> tuple[int, int, int]:
  """`[B, S, K]`: the sequence layout shards S with one sequence per data shard (so the GEMM
  rows flatten without a reshard); the others use 4 sequences."""
  batch = mesh.shape["dp"] if layout.name == "sequence" else 4
  return (batch, ROWS // batch, K)


def quantizers_of(recipe) -> jq.DenseQuantizers:
  return jq.DenseQuantizers.from_recipe(recipe, "linear", "layer")


def delayed_states(quantizers: jq.DenseQuantizers, scales=(2.0, 8.0, 4096.0)):
  """States with non-trivial scales (a fresh state's scale is 1)."""
  states = quantizers.init_states()

  def with_scale(state, scale):
    if state is None:
      return None
    if isinstance(state, tuple):
      return tuple(with_scale(s, scale) for s in state)
    return jq.DelayedScalingState(jnp.float32(scale), state.amax_history)

  return tuple(with_scale(s, c) for s, c in zip(states, scales))


def inputs(rng: np.random.Generator, layout: Layout, mesh: Mesh):
  shape = x_shape(layout, mesh)
  x = jnp.asarray(rng.standard_normal(shape), jnp.float32)
  w = jnp.asarray(rng.standard_normal((K, N)) * 0.05, jnp.float32)
  b = jnp.asarray(rng.standard_normal((N,)), jnp.float32)
  dy = jnp.asarray(rng.standard_normal(shape[:-1] + (N,)), jnp.float32)
  key = jax.random.key(int(rng.integers(1 << 31)))
  return x, w, b, dy, key


def step_fn(quantizers: jq.DenseQuantizers, layout: Layout, mesh: Optional[Mesh]):
  """A jitted function returning the quantized storages of x, W^T and dy (as `jaxquant.dense`
  quantizes them) and the dense's y, dx, dW, db. `mesh=None`: the single-device program."""
  # float32 partial sums: the mesh equals one device to float32 reduction order.
  sharding = None if mesh is None else jqs.DenseSharding(layout.x, layout.kernel, mesh,
                                                         reduce_dtype=jnp.float32)

  def step(x, w, b, dy, key, states):
    keys = [jax.random.fold_in(key, i) for i in range(3)]
    plan = None
    if mesh is not None:
      plan = jqs.plan_dense(sharding, x.shape, w.shape, 1, quantizers.weight,
                            ("rowwise", "columnwise"))

    def stored(value, quantizer, spec, key, state):
      value = value if plan is None else jax.lax.with_sharding_constraint(
          value, NamedSharding(mesh, spec))
      q = jq.ops.quantize(value, quantizer, key=key, state=state)
      if plan is not None:
        q = jqs.constrain(q, jqs.storage_specs(quantizer, spec), mesh)
      return q

    weight_spec = plan and (plan.weight_gathered if plan.weight_gather == "high-precision"
                            else plan.weight)
    storages = (stored(x.reshape(-1, K), quantizers.input, plan and plan.x2d, keys[0], states[0]),
                stored(w.T, quantizers.weight, weight_spec, keys[1], states[1]),
                stored(dy.reshape(-1, N), quantizers.grad_output, plan and plan.y2d, keys[2],
                       states[2]))
    fwd = lambda x, w, b: jq.dense(x, w, b, quantizers, key=key, states=states,
                                   sharding=sharding)
    y, vjp = jax.vjp(fwd, x, w, b)
    return storages, (y, *vjp(dy))

  return jax.jit(step)


def put(mesh: Mesh, layout: Layout, x, w, b, dy):
  shard = lambda v, spec: jax.device_put(v, NamedSharding(mesh, spec))
  return (shard(x, layout.x), shard(w, layout.kernel), shard(b, P(layout.kernel[1])),
          shard(dy, P(*layout.x[:-1], layout.kernel[1])))



def place_flax(boxed, x, mesh: Mesh, rules, x_spec: P = P(("dp", "fsdp"))):
  """(variables, x) on `mesh`: the variables `init` returned (`boxed`, with their logical axis
  names) sharded as `rules` map those names, `x` as `x_spec`. The values are unboxed without
  a sharding constraint (`nn.meta.unbox` adds one under a mesh, which eager arrays refuse)."""
  shardings = nn.logical_to_mesh_sharding(nn.get_partition_spec(boxed), mesh, rules)
  boxed_leaf = lambda v: isinstance(v, nn.Partitioned)
  values = jax.tree.map(lambda v: v.value if boxed_leaf(v) else v, boxed, is_leaf=boxed_leaf)
  return (jax.device_put(values, nn.meta.unbox(shardings)),
          jax.device_put(x, NamedSharding(mesh, x_spec)))
