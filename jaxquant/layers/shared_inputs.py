"""One quantization of an input that several contractions read (the q, k and v projections).

XLA merges identical pure computations but not FFI custom calls, so three `jaxquant.dense`
calls on one input would quantize it three times. Inside `share_input_quantization()` (entered
by `jaxquant.flax.quantize_dense` around each `nn.MultiHeadDotProductAttention`, or by a
user around their own projections) the first contraction's input quantization is kept and the
later ones reuse it when nothing could make them differ:
- the same input object (a tracer is compared by identity, never by value),
- equal quantizers (frozen dataclasses) and the same matrix layout and sharding,
- no PRNG key (stochastic rounding draws per layer), and for a stateful quantizer (delayed
  scaling) the same state object (each layer's own state does not share),
- the same JAX trace (a quantization made inside `jax.checkpoint`, say, does not leak out).
A shared quantization makes both copies at once (which later contraction needs the columnwise
copy is not known when the first one runs); a contraction whose kernel is not differentiated
just does not read it. `jaxquant.explain` lists the reuse as a "shared" quantize decision.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import Any, Callable, Hashable, Iterator, Optional

from jax._src import core as _jax_core

from jaxquant.layers.operands import Operand


@dataclasses.dataclass
class _Entry:
  value: Any  # the input object (kept alive, compared by identity)
  key: Hashable
  state: Any
  trace: Any
  operand: Operand


@dataclasses.dataclass
class _Scope:
  entries: list = dataclasses.field(default_factory=list)


_SCOPE: contextvars.ContextVar[Optional[_Scope]] = contextvars.ContextVar(
    "jaxquant_shared_inputs", default=None)


@contextlib.contextmanager
def share_input_quantization() -> Iterator[None]:
  """Contractions in this block that quantize the same input the same way share one
  quantization (see the module docstring). Nested blocks start a fresh scope."""
  token = _SCOPE.set(_Scope())
  try:
    yield
  finally:
    _SCOPE.reset(token)


def active() -> bool:
  return _SCOPE.get() is not None


def _current_trace():
  return _jax_core.unsafe_get_current_trace()


def shared_operand(value: Any, key: Hashable, state: Any,
                   make: Callable[[], Operand]) -> tuple[Operand, bool]:
  """(operand, reused): the operand a previous contraction in this scope made from `value`
  under `key` and `state`, else `make()` (remembered for the next ones). Outside a scope:
  `make()`, not remembered."""
  scope = _SCOPE.get()
  if scope is None:
    return make(), False
  trace = _current_trace()
  for entry in scope.entries:
    if (entry.value is value and entry.key == key and entry.state is state
        and entry.trace is trace):
      return entry.operand, True
  operand = make()
  scope.entries.append(_Entry(value, key, state, trace, operand))
  return operand, False
