"""What a compiled program communicates and calls: collectives and custom calls in its HLO text.

`collectives(jax.jit(f).lower(...).compile().as_text())` lists every all-gather, all-reduce,
reduce-scatter, all-to-all, ragged-all-to-all and collective-permute (an async `-start`/`-done` pair
counted once, by its results; a ragged-all-to-all's result is its whole receive buffer, an upper
bound on the rows it moves). A collective XLA combined from several (a tuple-shaped all-reduce or
reduce-scatter, as XLA:GPU's combiner passes make) is one entry holding every array it moves: count
bytes or arrays, not entries. Used to check that a sharded step moves what the sharding promises (no
all-gather of a sharded activation, one all-reduce for a K-sharded GEMM, FP8 bytes for an FSDP
weight gather) in the tests and in `bench/scaling.py`.

`custom_calls(text)` lists every custom call (the FFI kernels) with its operand and result
types and how many times it runs per execution of the program: a call in a `while` body runs
its known trip count times (`lax.scan` over layers or micro-batches, nested loops multiply), so
a test can count, say, the weight quantizations of a training step.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import re
from typing import Optional

_COLLECTIVE = re.compile(
    r"=\s*(?P<type>\((?:/\*index=\d+\*/|[^=])*?\)|[\w]+\[[\d,]*\](?:\{[^}]*\})?)\s+"
    r"(?P<op>all-gather|all-reduce|reduce-scatter|ragged-all-to-all|all-to-all|"
    r"collective-permute)"
    r"(?:-start)?\(")
_ARRAY = re.compile(r"(\w+)\[([\d,]*)\]")
_BYTES = {"f8e4m3fn": 1, "f8e5m2": 1, "f8e8m0fnu": 1, "f4e2m1fn": 0.5, "u8": 1, "s8": 1,
          "bf16": 2, "f16": 2, "f32": 4, "u32": 4, "s32": 4, "pred": 1, "f64": 8, "s64": 8,
          "u64": 8}


@dataclasses.dataclass(frozen=True)
class Collective:
  """One collective: its op name and the (element type, shape) of each result."""

  op: str
  arrays: tuple[tuple[str, tuple[int, ...]], ...]

  @property
  def bytes(self) -> float:
    return sum(_BYTES.get(t, 4) * math.prod(s) for t, s in self.arrays)

  @property
  def elements(self) -> int:
    return sum(math.prod(s) for _, s in self.arrays)

  def __str__(self) -> str:
    shapes = ", ".join(f"{t}[{','.join(map(str, s))}]" for t, s in self.arrays)
    return f"{self.op}({shapes})"


def _top_level(type_text: str) -> list[str]:
  """The elements of a tuple type `(a, (b, c), d[1,2]{1,0})`, split at its top-level commas."""
  inner, parts, depth, start = type_text[1:-1], [], 0, 0
  for i, ch in enumerate(inner):
    if ch in "([{":
      depth += 1
    elif ch in ")]}":
      depth -= 1
    elif ch == "," and depth == 0:
      parts.append(inner[start:i])
      start = i + 1
  return parts + [inner[start:]]


def _result_type(type_text: str, op: str, is_start: bool) -> str:
  """The part of an instruction's type that is its result.

  A synchronous collective and `all-reduce-start` are typed by their results (one array or a
  tuple of them). The other `-start` halves are typed `(operands, results, context...)`:
  `all-gather-start` and `collective-permute-start` directly, the ops XLA wraps in an async
  computation (`reduce-scatter-start`, `all-to-all-start`, ...) as `((operands...), results,
  context...)`; the results are the second element either way."""
  if not is_start or op == "all-reduce" or not type_text.startswith("("):
    return type_text
  return _top_level(type_text)[1]


def collectives(hlo_text: str) -> list[Collective]:
  """Every collective of a compiled module's text (async `-start` halves counted once)."""
  found = []
  for match in _COLLECTIVE.finditer(hlo_text):
    type_text = re.sub(r"/\*index=\d+\*/", "", match.group("type"))
    result = _result_type(type_text, match.group("op"), "-start(" in match.group(0))
    arrays = tuple((t, tuple(int(d) for d in dims.split(",") if d))
                   for t, dims in _ARRAY.findall(result))
    found.append(Collective(match.group("op"), arrays))
  return found


def summarize(found: list[Collective]) -> dict[str, dict[str, float]]:
  """`{op: {"count": n, "bytes": total}}` over `found`."""
  summary: dict[str, dict[str, float]] = collections.defaultdict(
      lambda: {"count": 0, "bytes": 0.0})
  for c in found:
    summary[c.op]["count"] += 1
    summary[c.op]["bytes"] += c.bytes
  return dict(summary)


_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%([\w.-]+)\s+\(.*\{\s*$")
_CALLEE = re.compile(r"(?:calls|to_apply|body|condition|true_computation|false_computation)="
                     r"%([\w.-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_CUSTOM_CALL = re.compile(r"=\s*(?P<results>.*?)\s+custom-call\((?P<operands>.*?)\),\s*"
                          r'.*?custom_call_target="(?P<target>[^"]+)"')
# Operand types, where the operand list names the operands without them (XLA:CPU prints them
# here for FFI calls).
_OPERAND_LAYOUTS = re.compile(r"operand_layout_constraints=\{(?P<types>(?:[^{}]|\{[^{}]*\})*)\}")


@dataclasses.dataclass(frozen=True)
class CustomCall:
  """One custom-call instruction: its target, the (element type, shape) of each operand and
  result, and how many times it runs per program execution (None: inside a loop whose trip
  count XLA does not know)."""

  target: str
  operands: tuple[tuple[str, tuple[int, ...]], ...]
  results: tuple[tuple[str, tuple[int, ...]], ...]
  executions: Optional[int]


def _arrays(text: str) -> tuple[tuple[str, tuple[int, ...]], ...]:
  return tuple((t, tuple(int(d) for d in dims.split(",") if d)) for t, dims in
               _ARRAY.findall(text))


def _computations(hlo_text: str) -> tuple[dict[str, list[str]], Optional[str]]:
  bodies: dict[str, list[str]] = {}
  entry, current = None, None
  for line in hlo_text.splitlines():
    match = _COMPUTATION.match(line)
    if match:
      current = match.group(1)
      bodies[current] = []
      if line.startswith("ENTRY"):
        entry = current
    elif current is not None:
      if line.strip() == "}":
        current = None
      else:
        bodies[current].append(line)
  return bodies, entry


def _executions(bodies: dict[str, list[str]], entry: str) -> dict[str, Optional[int]]:
  """Runs per program execution of each computation reachable from `entry`."""
  callers: dict[str, list[tuple[str, Optional[int]]]] = collections.defaultdict(list)
  for name, lines in bodies.items():
    for line in lines:
      factor: Optional[int] = 1
      if " while(" in line:
        trip = _TRIP_COUNT.search(line)
        factor = int(trip.group(1)) if trip else None
      callees = _CALLEE.findall(line)
      for branches in _BRANCHES.findall(line):
        callees += [b.strip().lstrip("%") for b in branches.split(",") if b.strip()]
      for callee in callees:
        callers[callee].append((name, factor))
  memo: dict[str, Optional[int]] = {entry: 1}

  def count(name: str) -> Optional[int]:
    if name not in memo:
      total: Optional[int] = 0
      for caller, factor in callers.get(name, []):
        runs = count(caller)
        if runs is None or factor is None:
          total = None
          break
        total += runs * factor
      memo[name] = total
    return memo[name]

  return {name: count(name) for name in bodies}


def custom_calls(hlo_text: str) -> list[CustomCall]:
  """Every custom call of a compiled module's text, with its executions per program run."""
  bodies, entry = _computations(hlo_text)
  if entry is None:
    raise ValueError("hlo_text: no ENTRY computation found; pass the text of a compiled "
                     "module (jax.jit(f).lower(...).compile().as_text())")
  runs = _executions(bodies, entry)
  found = []
  for name, lines in bodies.items():
    for line in lines:
      match = _CUSTOM_CALL.search(line)
      if match:
        operands = _arrays(match.group("operands"))
        layouts = _OPERAND_LAYOUTS.search(line)
        if not operands and layouts:
          operands = _arrays(layouts.group("types"))
        found.append(CustomCall(match.group("target"), operands,
                                _arrays(match.group("results")), runs[name]))
  return found
