"""`--moe EXPERTS,TOPK`: a routed mixture of `jaxquant.flax.GroupedDense` experts.

Each token picks its `top_k` experts by router probability (a float32 `nn.Dense`, unquantized);
the token-expert assignments are sorted by expert, so each expert's tokens are contiguous and
`group_sizes` counts them (dropless: no capacity limit, empty experts allowed). The experts are
two `GroupedDense` layers, `fc1` and `fc2` (roles `("grouped_linear", ..., "fc1" | "fc2")`, the
names a recipe such as `moe_nvfp4_fwd_mxfp8_bwd` dispatches on), with a GELU between them; their
outputs are unsorted and combined with the renormalized top-k weights (Mixtral-style).

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


def load_balancing_loss(probs: jax.Array, expert_ids: jax.Array, experts: int) -> jax.Array:
  """Switch-Transformer auxiliary loss of router `probs[T, E]` and assignments `expert_ids`."""
  fraction = jnp.bincount(expert_ids, length=experts) / expert_ids.shape[0]
  return experts * jnp.sum(fraction * jnp.mean(probs, axis=0))


def route(probs: jax.Array, top_k: int):
  """Top-k routing of `probs[T, E]`: `(order, group_sizes, weights)` where `order[T*k]` lists
  the assignments `t * top_k + j` sorted by expert (stable), `group_sizes[E]` counts them and
  `weights[T, k]` are the chosen probabilities renormalized to sum to 1 per token."""
  weights, chosen = jax.lax.top_k(probs, top_k)
  weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
  expert_ids = chosen.reshape(-1)
  order = jnp.argsort(expert_ids, stable=True)
  group_sizes = jnp.bincount(expert_ids, length=probs.shape[-1]).astype(jnp.int32)
  return order, group_sizes, weights, expert_ids


class MoEMLP(nn.Module):
  """`x[batch, seq, d_model]` -> the same shape, through `top_k` of `experts` GELU MLPs.

  Attributes:
    config: the `LMConfig` (`moe = (experts, top_k)`, `mlp_ratio`, `dtype`, `moe_aux_weight`).
    recipe: quantization recipe of the experts.
  """

  config: Any
  recipe: Optional[jaxquant.Recipe] = None

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    cfg = self.config
    experts, top_k = cfg.moe
    batch, seq, d_model = x.shape
    tokens = x.reshape(-1, d_model)
    logits = nn.Dense(experts, use_bias=False, dtype=jnp.float32, name="router")(
        tokens.astype(jnp.float32))
    probs = jax.nn.softmax(logits, axis=-1)
    layout = expert_layout(experts, cfg.moe_capacity, cfg.moe_exchange)
    if layout is not None:
      return self._sharded(x, tokens, probs, layout)
    order, group_sizes, weights, expert_ids = route(probs, top_k)
    routed = tokens[order // top_k]  # [T * top_k, d_model], sorted by expert
    experts_layer = lambda features, name: jaxquant.flax.GroupedDense(
        features, num_groups=experts, use_bias=False, dtype=cfg.dtype, recipe=self.recipe,
        name=name)
    h = nn.gelu(experts_layer(cfg.mlp_ratio * d_model, "fc1")(routed, group_sizes))
    out = experts_layer(d_model, "fc2")(h, group_sizes)
    out = out[jnp.argsort(order)].reshape(-1, top_k, d_model)  # back to (token, choice)
    y = jnp.sum(out * weights[..., None].astype(out.dtype), axis=1)
    aux = load_balancing_loss(probs, expert_ids, experts)
    self.sow("intermediates", "load_balancing_loss", aux)
    return add_aux_loss(y, cfg.moe_aux_weight * aux).reshape(batch, seq, d_model)

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
    h = nn.gelu(self._experts(cfg.mlp_ratio * d_model, "fc1", True)(rows, group_sizes))
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
