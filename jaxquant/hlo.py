"""What a compiled program communicates: the collectives in its HLO text, with their bytes.

`collectives(jax.jit(f).lower(...).compile().as_text())` lists every all-gather, all-reduce,
reduce-scatter, all-to-all, ragged-all-to-all and collective-permute (an async `-start`/`-done`
pair counted once, by its results; a ragged-all-to-all's result is its whole receive buffer,
an upper bound on the rows it moves). A collective XLA combined from several (a tuple-shaped
all-reduce or reduce-scatter, as XLA:GPU's combiner passes make) is one entry holding every
array it moves: count bytes or arrays, not entries. Used to check that a sharded step moves what the sharding promises (no
all-gather of a sharded activation, one all-reduce for a K-sharded GEMM, FP8 bytes for an FSDP
weight gather) in the tests and in `bench/scaling.py`.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import re

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
