"""`jaxquant.explain`: which quantizer and which implementation served every role.

Ops record a line per decision while they are traced; `explain(fn, *args)` traces `fn` (no
compilation, no execution) and returns those lines, so no fallback to a slower path is silent.
`with jaxquant.explain_recording() as report:` collects the same lines around any code.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import itertools
from typing import Any, Callable, Iterator, Optional

import jax


@dataclasses.dataclass(frozen=True)
class Decision:
  op: str  # "quantize" | "gemm" | "transpose" | "state-update"
  role: Any  # QuantizerRole, a description string, or None
  detail: str  # quantizer(s) and direction(s)
  path: str  # implementation taken, e.g. "reference", "ffi-cuda", "cublaslt-fp8", "dequant-bf16"
  reason: str = ""  # why a slower path was taken, when it was

  def __str__(self) -> str:
    role = str(self.role) if self.role is not None else "-"
    why = f"  ({self.reason})" if self.reason else ""
    return f"{self.op:9s} {role:32s} {self.path:20s} {self.detail}{why}"


class Report(list):
  """A list of `Decision`s; `str(report)` is a table."""

  def __str__(self) -> str:
    return "\n".join(str(d) for d in self) if self else "(no quantized ops traced)"

  def paths(self, op: Optional[str] = None) -> set[str]:
    return {d.path for d in self if op is None or d.op == op}


_ACTIVE: contextvars.ContextVar[Optional[Report]] = contextvars.ContextVar("jaxquant_explain",
                                                                           default=None)


def record(decision: Decision) -> None:
  report = _ACTIVE.get()
  if report is not None:
    report.append(decision)


@contextlib.contextmanager
def explain_recording() -> Iterator[Report]:
  report = Report()
  token = _ACTIVE.set(report)
  try:
    yield report
  finally:
    _ACTIVE.reset(token)


@contextlib.contextmanager
def suspended() -> Iterator[None]:
  """Record nothing in this block: for abstract traces that only ask for shapes (e.g. the
  storage layout of a copy that is not made), whose decisions did not happen."""
  token = _ACTIVE.set(None)
  try:
    yield
  finally:
    _ACTIVE.reset(token)


# Each `explain` call traces under a fresh value of this jit-cache-sensitive context, so jitted
# functions that were traced before are traced again and their decisions recorded.
_EXPLAIN_CALL = jax.make_user_context(default_value=0)
_explain_calls = itertools.count(1)


def explain(fn: Callable, *args, **kwargs) -> Report:
  """Trace `fn(*args, **kwargs)` abstractly and report every quantize/GEMM decision."""
  with explain_recording() as report, _EXPLAIN_CALL(next(_explain_calls)):
    jax.eval_shape(fn, *args, **kwargs)
  return report
