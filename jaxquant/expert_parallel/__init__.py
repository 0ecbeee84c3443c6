"""Expert parallelism: routed tokens sent to the devices that hold their experts, and back.

Under a mesh, a mixture-of-experts layer keeps its tokens sharded over the token (batch) mesh
axes and its experts sharded over an expert axis (`ep`, one of the token axes): the device at
`ep` index `d` holds experts `[d * E_loc, (d + 1) * E_loc)`. Each device

1. `dispatch`: sorts its own token-expert assignments by expert and sends each to the device of
   its expert over the expert axis, by one of two exchanges (`exchange.choose`, recorded for
   `jaxquant.explain` as an `"ep-exchange"` decision):
   - `jax.lax.ragged_all_to_all` (`ragged.py`, `exchange="ragged"`): only the real rows
     travel, after an `all_gather` of the per-expert counts; dropless. Not the default: on
     H100s XLA's ragged all-to-all (a one-shot copy kernel with cross-GPU barriers) measured
     slower than the fixed-size exchange (`exchange.RAGGED_AUTO_PLATFORMS`);
   - a fixed-size `jax.lax.all_to_all` (`fixed.py`) with `capacity` rows per (sender,
     receiver) pair: every assignment of the sender when dropless (at the price of `ep` times
     the rows in the buffers), or `capacity_factor` times an even share, dropping (and
     counting) assignments past it; the default.
   Either way the receiver holds its rows grouped by local expert (senders in order), then zero
   rows of no group, with `group_sizes` per local expert, ready for `jaxquant.grouped_dense`
   on its own experts (`jaxquant.flax.GroupedDense` with `input_axes`).
2. `combine`: the mirrored exchange brings each output row home, and the top-k outputs of a
   token are summed with their router weights.

Without an expert axis (or with one of size 1) nothing is sent: each data shard groups its own
tokens and runs every expert on them (data-parallel MoE with replicated experts). A receiver
holds all the rows of its experts (when nothing is dropped), so per-expert scales equal one
device's. With a data axis beside `ep` each data shard's copy of an expert sees that shard's
tokens only, and a per-tensor scale (FP8 current scaling) follows their amax, not the amax of
all of the expert's tokens.
"""

from jaxquant.expert_parallel.exchange import (RAGGED_PLATFORMS, choose, combine, dispatch,
                                               mesh_platform)
from jaxquant.expert_parallel.fixed import Dispatched
from jaxquant.expert_parallel.layout import EXCHANGES, ExpertSharding
from jaxquant.expert_parallel.ragged import RaggedDispatched

__all__ = ["EXCHANGES", "RAGGED_PLATFORMS", "Dispatched", "ExpertSharding", "RaggedDispatched",
           "choose", "combine", "dispatch", "mesh_platform"]
