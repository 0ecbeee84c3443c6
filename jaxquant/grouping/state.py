"""Delayed-scaling state per group: every expert keeps its own scale and amax history.

A grouped tensor's state is the single-tensor state (`jaxquant.init_state`) with a leading `[G]`
axis on every leaf (a Hybrid's is the pair of its halves' states), so expert `g` quantizes with
`scale[g]` and records its own amax, exactly as `G` separate `jaxquant.dense` layers would. A
group that receives no tokens in a step records amax 0 (the history's max still sets its scale).
"""

from __future__ import annotations

from typing import Any, Union

import jax
import jax.numpy as jnp

from jaxquant.formats import format_of
from jaxquant.grouping.tensors import GroupedQuantizedTensor
from jaxquant.quantizers import Quantizer
from jaxquant.state import init_state as _init_single
from jaxquant.state import update_each_direction
from jaxquant.tensors import QuantizedTensor


def init_state(quantizer: Quantizer, groups: int) -> Any:
  """Fresh per-group state: `jaxquant.init_state(quantizer)` broadcast to `[groups, ...]`."""
  return jax.tree_util.tree_map(lambda a: jnp.broadcast_to(a, (groups,) + a.shape),
                                _init_single(quantizer))


def update_state(quantizer: Quantizer, state: Any,
                 quantized: Union[GroupedQuantizedTensor, QuantizedTensor]) -> Any:
  """New per-group state after `quantized` (from `jaxquant.grouped.quantize` or
  `quantize_experts`) was made with `state`; mirrors `jaxquant.update_state` group by group."""
  return update_each_direction(quantizer, state, quantized, lambda q, leaf, scaled: jax.vmap(
      lambda s, amax: format_of(q).update_state(q, s, amax))(leaf, scaled.amax))
