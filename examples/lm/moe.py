"""`--moe EXPERTS,TOPK`: a routed mixture of `jaxquant.flax.GroupedDense` experts.

Each token picks its `top_k` experts by router probability (a float32 `nn.Dense`, unquantized);
the token-expert assignments are sorted by expert, so each expert's tokens are contiguous and
`group_sizes` counts them (dropless: no capacity limit, empty experts allowed). The experts are
two `GroupedDense` layers, `fc1` and `fc2` (roles `("grouped_linear", ..., "fc1" | "fc2")`, the
names a recipe such as `moe_nvfp4_fwd_mxfp8_bwd` dispatches on), with a GELU between them; their
outputs are unsorted and combined with the renormalized top-k weights (Mixtral-style).

The permutation costs one sort: the assignments' expert ids are sorted once (`sort_by_expert`),
its inverse is one scatter of unique indices, and every move of rows is a gather in both
directions (`dispatch` and `combine` are `custom_vjp`s whose gradients gather where autodiff
would scatter-add): the token rows are gathered once into expert order, and the combine reads
each token's `top_k` expert rows, weights and sums them in float32 in one fusion and rounds once.
Each part runs under its own `jax.named_scope` (`SCOPES`), so a profile splits by part
(`bench/moe_block.py --trace`).

The Switch-Transformer load-balancing loss `E * sum_e f_e * P_e` (`f_e`: fraction of the
assignments routed to expert e, `P_e`: its mean router probability; 1 when balanced) is added to
the training objective through its gradient (`add_aux_loss`, Megatron's "aux loss auto-scaler"),
so the training loop and the reported cross-entropy are unchanged; its value is sown in
`"intermediates"` for inspection.

Under `--mesh` (`lm.sharding`) every token shard routes its own tokens: the experts are sharded
over the `ep` axis (logical name `expert`) and `jaxquant.expert_parallel` sends each token to
its experts' device with one all-to-all and back with another (the tokens are sharded over `ep`
as over `dp`): fixed-size buffers by default, `jax.lax.ragged_all_to_all` of the real rows with
`moe_exchange="ragged"` (`jaxquant.explain` records which and why); without `ep` each data
shard runs every (replicated) expert on its own tokens.
The experts then run as a sharded `GroupedDense` (`input_axes`): each device its own experts
on the rows it received. Buffers are dropless unless `moe_capacity` is set; the number of
dropped assignments is sown as `"dropped"`.
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

import jaxquant
import jaxquant.flax
from jaxquant import expert_parallel
from jaxquant import sharding as jq_sharding


@jax.custom_vjp
def add_aux_loss(y: jax.Array, aux: jax.Array) -> jax.Array:
  """`y`, unchanged; differentiating a loss of `y` also differentiates `+ aux`."""
  del aux
  return y


def _add_aux_loss_fwd(y, aux):
  return y, jnp.zeros_like(aux)


def _add_aux_loss_bwd(zero_aux, dy):
  return dy, jnp.ones_like(zero_aux)


add_aux_loss.defvjp(_add_aux_loss_fwd, _add_aux_loss_bwd)


# The parts of the block, each traced under its `jax.named_scope` (the names reach the HLO's
# op_name metadata, so a profile's kernels can be summed by part: bench/moe_block.py).
SCOPES = {
    "router": "moe_router",            # router GEMM, softmax, load-balancing loss
    "route": "moe_route",              # top-k, the sort into expert order, counts, inverse
    "dispatch": "moe_dispatch",        # the gather of token rows into expert order
    "experts": "moe_experts",          # the two GroupedDense layers (GEMMs + quantization)
    "activation": "moe_activation",    # GELU between them
    "combine": "moe_combine",          # unsort + weighted sum of each token's top-k rows
}


def expert_counts(expert_ids: jax.Array, experts: int) -> jax.Array:
  """Assignments per expert, `int32[experts]`: a compare-and-sum reduction (no scatter-add,
  whose atomics all hit a few counters)."""
  return jnp.sum(expert_ids[:, None] == jnp.arange(experts, dtype=expert_ids.dtype), axis=0,
                 dtype=jnp.int32)


def load_balancing_loss(probs: jax.Array, expert_ids: jax.Array, experts: int,
                        counts: Optional[jax.Array] = None) -> jax.Array:
  """Switch-Transformer auxiliary loss of router `probs[T, E]` and assignments `expert_ids`
  (`counts`: their `expert_counts`, when already known)."""
  counts = expert_counts(expert_ids, experts) if counts is None else counts
  fraction = counts / expert_ids.shape[0]
  return experts * jnp.sum(fraction * jnp.mean(probs, axis=0))


def sort_by_expert(expert_ids: jax.Array, experts: int) -> jax.Array:
  """The stable argsort of `expert_ids[n]` (values < `experts`), as one sort of unique int32
  keys `id * n + i` (a single-operand sort: no index payload to move, no stability needed)."""
  n = expert_ids.shape[0]
  if experts * n >= 2**31:
    return jnp.argsort(expert_ids, stable=True)
  keys = expert_ids.astype(jnp.int32) * n + jnp.arange(n, dtype=jnp.int32)
  return jnp.sort(keys) % n


def inverse_permutation(order: jax.Array) -> jax.Array:
  """`inverse[order[p]] = p`, by one scatter of unique indices (no second sort, no atomics)."""
  positions = jnp.arange(order.shape[0], dtype=order.dtype)
  return jnp.zeros_like(order).at[order].set(positions, unique_indices=True)


def route(probs: jax.Array, top_k: int):
  """Top-k routing of `probs[T, E]`: `(order, group_sizes, weights, expert_ids)` where
  `order[T*k]` lists the assignments `t * top_k + j` sorted by expert (stable),
  `group_sizes[E]` counts them, `weights[T, k]` are the chosen probabilities renormalized to
  sum to 1 per token and `expert_ids[T*k]` the chosen experts."""
  weights, chosen = jax.lax.top_k(probs, top_k)
  weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
  expert_ids = chosen.reshape(-1)
  order = sort_by_expert(expert_ids, probs.shape[-1])
  return order, expert_counts(expert_ids, probs.shape[-1]), weights, expert_ids


def _rows(x: jax.Array, index: jax.Array, unique: bool = False) -> jax.Array:
  """`x[index]` for in-bounds row indices (no clamping or fill)."""
  return x.at[index].get(mode="promise_in_bounds", unique_indices=unique)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def dispatch(tokens: jax.Array, order: jax.Array, inverse: jax.Array, top_k: int) -> jax.Array:
  """`tokens[order // top_k]`: each token's row once per chosen expert, in expert order.

  The gradient is a gather too: a token's `top_k` row gradients sit at `inverse[t*k : t*k+k]`,
  summed in float32 (the transpose of the forward gather would be a scatter-add)."""
  return _rows(tokens, order // top_k)


def _dispatch_fwd(tokens, order, inverse, top_k):
  return dispatch(tokens, order, inverse, top_k), (order, inverse)


def _dispatch_bwd(top_k, residuals, d_rows):
  order, inverse = residuals
  per_token = _rows(d_rows, inverse, unique=True).reshape(-1, top_k, d_rows.shape[-1])
  d_tokens = jnp.sum(per_token.astype(jnp.float32), axis=1).astype(d_rows.dtype)
  return d_tokens, None, None


dispatch.defvjp(_dispatch_fwd, _dispatch_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def combine(rows: jax.Array, weights: jax.Array, order: jax.Array, inverse: jax.Array,
            top_k: int) -> jax.Array:
  """`y[t] = sum_j weights[t, j] * rows[inverse[t*k + j]]`: the expert outputs `rows[T*k, d]`
  (expert order) back in token order, weighted and summed, products and sum in float32 in one
  fused gather-reduce (no float32 copy of the rows), rounded once to the rows' dtype.

  Gradients are gathers: `d_rows[p] = w[order[p]] * dy[order[p] // k]` (expert order) and
  `d_weights[t, j] = <dy[t], rows[inverse[t*k + j]]>`."""
  picked = _rows(rows, inverse, unique=True).reshape(-1, top_k, rows.shape[-1])
  y = jnp.sum(picked.astype(jnp.float32) * weights[..., None].astype(jnp.float32), axis=1)
  return y.astype(rows.dtype)


def _combine_fwd(rows, weights, order, inverse, top_k):
  return combine(rows, weights, order, inverse, top_k), (rows, weights, order, inverse)


def _combine_bwd(top_k, residuals, dy):
  rows, weights, order, inverse = residuals
  dy32 = dy.astype(jnp.float32)
  w_sorted = _rows(weights.reshape(-1).astype(jnp.float32), order, unique=True)
  d_rows = (_rows(dy32, order // top_k) * w_sorted[:, None]).astype(rows.dtype)
  picked = _rows(rows, inverse, unique=True).reshape(-1, top_k, rows.shape[-1])
  d_weights = jnp.sum(picked.astype(jnp.float32) * dy32[:, None, :], axis=-1)
  return d_rows, d_weights.astype(weights.dtype), None, None


combine.defvjp(_combine_fwd, _combine_bwd)


class MoEMLP(nn.Module):
  """`x[batch, seq, d_model]` -> the same shape, through `top_k` of `experts` GELU MLPs.

  Attributes:
    config: the `LMConfig` (`moe = (experts, top_k)`, `mlp_ratio`, `dtype`, `moe_aux_weight`).
    recipe: quantization recipe of the experts.
    hidden: the experts' hidden width (default `mlp_ratio * d_model`; fine-grained experts
      are narrower than the model, e.g. 1408 at d_model 2048).
  """

  config: Any
  recipe: Optional[jaxquant.Recipe] = None
  hidden: Optional[int] = None

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    cfg = self.config
    experts, top_k = cfg.moe
    batch, seq, d_model = x.shape
    tokens = x.reshape(-1, d_model)
    with jax.named_scope(SCOPES["router"]):
      logits = nn.Dense(experts, use_bias=False, dtype=jnp.float32, name="router")(
          tokens.astype(jnp.float32))
      probs = jax.nn.softmax(logits, axis=-1)
    layout = expert_layout(experts, cfg.moe_capacity, cfg.moe_exchange)
    if layout is not None:
      return self._sharded(x, tokens, probs, layout)
    with jax.named_scope(SCOPES["route"]):
      order, group_sizes, weights, expert_ids = route(probs, top_k)
      inverse = inverse_permutation(order)
    with jax.named_scope(SCOPES["dispatch"]):
      routed = dispatch(tokens, order, inverse, top_k)  # [T * top_k, d_model], expert order
    with jax.named_scope(SCOPES["experts"]):
      h = self._experts(self._hidden(d_model), "fc1", False)(routed, group_sizes)
    with jax.named_scope(SCOPES["activation"]):
      h = nn.gelu(h)
    with jax.named_scope(SCOPES["experts"]):
      out = self._experts(d_model, "fc2", False)(h, group_sizes)
    with jax.named_scope(SCOPES["combine"]):
      y = combine(out, weights, order, inverse, top_k)
    with jax.named_scope(SCOPES["router"]):
      aux = load_balancing_loss(probs, expert_ids, experts, group_sizes)
    self.sow("intermediates", "load_balancing_loss", aux)
    return add_aux_loss(y, cfg.moe_aux_weight * aux).reshape(batch, seq, d_model)

  def _hidden(self, d_model: int) -> int:
    return self.config.mlp_ratio * d_model if self.hidden is None else self.hidden

  def _experts(self, features: int, name: str, sharded: bool):
    cfg = self.config
    axes = dict(kernel_axes=EXPERT_KERNEL_AXES, input_axes=EXPERT_INPUT_AXES) if sharded else {}
    return jaxquant.flax.GroupedDense(features, num_groups=cfg.moe[0], use_bias=False,
                                      dtype=cfg.dtype, recipe=self.recipe, name=name, **axes)

  def _sharded(self, x, tokens, probs, layout: expert_parallel.ExpertSharding):
    """Expert-parallel (or data-parallel) experts: dispatch, local experts, combine."""
    cfg = self.config
    experts, top_k = cfg.moe
    batch, seq, d_model = x.shape
    weights, chosen = jax.lax.top_k(probs, top_k)
    weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    rows, group_sizes, dispatched = expert_parallel.dispatch(tokens, chosen, layout)
    h = nn.gelu(self._experts(self._hidden(d_model), "fc1", True)(rows, group_sizes))
    out = self._experts(d_model, "fc2", True)(h, group_sizes)
    y = expert_parallel.combine(out, weights, dispatched, layout)
    aux = load_balancing_loss(probs, chosen.reshape(-1), experts)
    self.sow("intermediates", "load_balancing_loss", aux)
    self.sow("intermediates", "dropped", jnp.sum(dispatched.dropped))
    return add_aux_loss(y, cfg.moe_aux_weight * aux).reshape(batch, seq, d_model)


# Logical names of the experts' kernels `[experts, in, out]` and of the dispatched rows.
EXPERT_KERNEL_AXES = ("expert", None, None)
EXPERT_INPUT_AXES = ("act_batch", None)


def expert_layout(experts: int, capacity_factor: Optional[float] = None,
                  exchange: str = "auto") -> Optional[expert_parallel.ExpertSharding]:
  """The `ExpertSharding` under the context mesh and logical rules (`lm.sharding`): tokens over
  the `act_batch` axes, experts over `expert`'s; None without a mesh or when neither is
  sharded."""
  mesh = jq_sharding.current_mesh()
  if mesh is None:
    return None
  sized = lambda names: tuple(a for a in jq_sharding.axes_tuple(
      nn.logical_to_mesh_axes(names)[0]) if mesh.shape[a] > 1)
  token_axes, expert_axes = sized(("act_batch",)), sized(("expert",))
  if not token_axes and not expert_axes:
    return None
  if len(expert_axes) > 1:
    raise ValueError(f"experts sharded over several mesh axes {expert_axes}; use one (ep)")
  return expert_parallel.ExpertSharding(mesh, token_axes, expert_axes[0] if expert_axes else None,
                                        experts, capacity_factor, exchange)
