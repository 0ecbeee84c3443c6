"""`ExpertSharding`: where the tokens and the experts of a mixture-of-experts layer live, and how
the routed rows travel between them."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional

from jax.sharding import PartitionSpec as P

from jaxquant import sharding as _sharding

# How the rows reach their experts' devices (`ExpertSharding.exchange`):
#   "auto"   the ragged exchange where it is dropless and measured faster on the platform
#            (none today: `exchange.RAGGED_AUTO_PLATFORMS`), else the fixed-size one
#            (`jaxquant.expert_parallel.exchange.choose` says which and why);
#   "ragged" `jax.lax.ragged_all_to_all`, real rows only (dropless; XLA:CPU cannot compile it);
#   "fixed"  `jax.lax.all_to_all` of fixed-size per-pair buffers (`capacity` rows each).
EXCHANGES = ("auto", "ragged", "fixed")


@dataclasses.dataclass(frozen=True)
class ExpertSharding:
  """Where the tokens and the experts of a MoE layer live.

  Attributes:
    mesh: the mesh (or abstract mesh of `jax.set_mesh`).
    token_axes: mesh axes sharding the tokens (the batch axes, the expert axis among them).
    expert_axis: mesh axis sharding the experts (None: experts replicated).
    experts: number of experts E.
    capacity_factor: None: dropless (a buffer slot for every local assignment); else each
      (sender, receiver) pair gets `ceil(capacity_factor * assignments / ep)` rows.
    exchange: one of `EXCHANGES`: "auto" (default), "ragged" or "fixed".
  """

  mesh: Any
  token_axes: tuple[str, ...]
  expert_axis: Optional[str]
  experts: int
  capacity_factor: Optional[float] = None
  exchange: str = "auto"

  def __post_init__(self):
    names = tuple(self.mesh.axis_names)
    for axis in self.token_axes + ((self.expert_axis,) if self.expert_axis else ()):
      if axis not in names:
        raise ValueError(f"ExpertSharding: mesh axis {axis!r} is not in the mesh {names}")
    if self.expert_axis and self.ep > 1 and self.expert_axis not in self.token_axes:
      raise ValueError(f"ExpertSharding: the expert axis {self.expert_axis!r} must also shard "
                       f"the tokens (token axes {self.token_axes}): each expert device routes "
                       "its own tokens")
    if self.experts % self.ep:
      raise ValueError(f"experts={self.experts} is not divisible by the {self.ep} devices of "
                       f"the expert axis {self.expert_axis!r}: every device must hold the same "
                       f"number of experts (use a multiple of {self.ep} experts, or a smaller "
                       "expert axis)")
    if self.capacity_factor is not None and not self.capacity_factor > 0:
      raise ValueError(f"capacity_factor={self.capacity_factor}: expected None (dropless) or "
                       "a positive number")
    if self.exchange not in EXCHANGES:
      raise ValueError(f"ExpertSharding: exchange={self.exchange!r}; expected one of "
                       f"{EXCHANGES}")
    if self.exchange == "ragged" and self.capacity_factor is not None:
      raise ValueError(f"ExpertSharding: exchange='ragged' is dropless (it moves every real "
                       f"row); capacity_factor={self.capacity_factor} needs exchange='fixed' "
                       "or 'auto', or capacity_factor=None")

  @property
  def ep(self) -> int:
    """Devices along the expert axis (1 without one)."""
    return self.mesh.shape[self.expert_axis] if self.expert_axis else 1

  @property
  def local_experts(self) -> int:
    return self.experts // self.ep

  @property
  def shards(self) -> int:
    """Token shards (devices holding different tokens)."""
    return _sharding.axis_size(self.mesh, self.token_axes)

  def capacity(self, assignments: int) -> int:
    """Rows per (sender, receiver) pair for `assignments` local token-expert assignments."""
    if self.capacity_factor is None or self.ep == 1:
      return assignments
    return min(assignments, math.ceil(self.capacity_factor * assignments / self.ep))

  @property
  def token_spec(self) -> P:
    return P(_sharding.spec_entry(self.token_axes))
