"""`quantize_model(model, recipe)`: swap the `nnx.Linear`, `nnx.LinearGeneral` and `nnx.Einsum`
modules of an unmodified NNX model for jaxquant's, in place.

Each swapped module is replaced, wherever the model refers to it, by the jaxquant module of the
same kind built around the original's own `kernel` / `bias` variables (the same `nnx.Param`
objects: same paths, shapes, dtypes, values and sharding metadata), so `nnx.state(model,
nnx.Param)`, checkpoints and an existing `nnx.Optimizer` are unchanged. What the swap adds sits
next to those parameters: delayed-scaling state (`OverwriteWithGradient`, e.g.
`layers/0/mlp/fc1/input_scale`) and a fork of the `"quantize"` rng stream.

Which modules: exact instances of the three classes (a subclass may override `__call__`) with
Flax's own contraction (no custom `dot_general` / `dot_general_cls` / `einsum_op`, which are a
quantization of their own); any depth, in attributes, `nnx.List` / `nnx.Dict` / lists, and a
module shared by several parents once (all parents then share the one swapped module).

Paths and patterns: a module's path is its attribute path joined by "/" (`"layers/0/attn/
qkv_einsum"`, as `nnx.state` names its parameters). `include` / `exclude` are shell-style
patterns matched against the whole path with `fnmatch.fnmatchcase` (`*` also crosses "/":
`"*attn*"` matches at any depth); a module is swapped when it matches an `include` pattern (all
do when `include` is None) and no `exclude` pattern. A pattern that matches no candidate module
is an error (a typo would otherwise quantize, or keep, the wrong layers silently).

Roles: `("linear", "input" | "weight" | "grad_output", name)` where `name` is the last path
component (the attribute name, `"qkv_einsum"`; the index for a list element) and `role.path`
the full path. `QuantizerRole.path` takes no part in role equality or hashing, so factories that
compare roles by `(module_type, tensor_type, name)` keep working; dispatch on `role.path` to tell
apart two modules of the same name.
"""

from __future__ import annotations

import dataclasses
import fnmatch
from typing import Optional, Sequence, Union

import flax.nnx as nnx
import jax
import jax.numpy as jnp
from flax.nnx import graph

from jaxquant.flax.quantization import QUANTIZE_RNG, check_recipe, stochastic_roles
from jaxquant.nnx.einsum import Einsum
from jaxquant.nnx.linear import Linear
from jaxquant.nnx.linear_general import LinearGeneral
from jaxquant.nnx.module import QuantizedContraction
from jaxquant.recipes import Recipe, current_recipe

Patterns = Union[str, Sequence[str], None]

#: Flax NNX class -> the jaxquant module that replaces it.
SWAPS = {nnx.Linear: Linear, nnx.LinearGeneral: LinearGeneral, nnx.Einsum: Einsum}


@dataclasses.dataclass(frozen=True, eq=False)
class Swap:
  """One swapped module.

  Attributes:
    path: where it sits in the model ("layers/0/attn/qkv_einsum").
    original: the Flax class it replaced.
    module: the jaxquant module now at `path`.
    reason: why it runs unquantized ("" when the recipe quantizes it), e.g. an einsum the
      quantized contraction cannot express (`jaxquant.explain` reports it too).
  """

  path: str
  original: type
  module: QuantizedContraction
  reason: str = ""

  @property
  def quantized(self) -> bool:
    return not self.reason


def _swappable(module) -> bool:
  kind = type(module)
  if kind is nnx.Linear:
    return module.dot_general is jax.lax.dot_general
  if kind is nnx.LinearGeneral:
    return module.dot_general is None and module.dot_general_cls is None
  if kind is nnx.Einsum:
    return module.einsum_op is jnp.einsum
  return False


def _patterns(value: Patterns, name: str) -> Optional[tuple[str, ...]]:
  if value is None:
    return None
  value = (value,) if isinstance(value, str) else tuple(value)
  if not all(isinstance(p, str) for p in value):
    raise TypeError(f"quantize_model({name}=...): expected a path pattern or a sequence of "
                    f"them (e.g. 'layers/*/mlp/*'), got {value!r}")
  return value


def _candidates(model) -> dict[int, tuple[str, nnx.Module]]:
  """Every swappable module, once, by id -> (first path, module)."""
  found = {}
  for path, node in nnx.iter_graph(model):
    if _swappable(node) and id(node) not in found:
      found[id(node)] = ("/".join(str(p) for p in path), node)
  return found


def _check_patterns(patterns, paths, name):
  for pattern in patterns or ():
    if not any(fnmatch.fnmatchcase(p, pattern) for p in paths):
      raise ValueError(
          f"quantize_model({name}=...): pattern {pattern!r} matches none of the "
          f"nnx.Linear / LinearGeneral / Einsum paths {sorted(paths)[:20]}")


def _replace_references(node, replacements: dict, path: tuple, seen: set) -> None:
  """Point every reference below `node` to a swapped module at its replacement."""
  impl = graph.get_node_impl(node)
  if impl is None or id(node) in seen:
    return
  seen.add(id(node))
  for key, child in list(impl.node_dict(node).items()):
    if isinstance(child, nnx.Variable) or not graph.is_node(child):
      continue
    if id(child) in replacements:
      if impl.set_key is None:
        where = "/".join(str(p) for p in path + (key,))
        raise ValueError(f"quantize_model: cannot swap '{where}' in place: it is held by a "
                         f"{type(node).__name__}, which cannot be changed; hold it in an "
                         "attribute, nnx.List or nnx.Dict")
      impl.set_key(node, key, replacements[id(child)][1])
    else:
      _replace_references(child, replacements, path + (key,), seen)


def quantize_model(model: nnx.Module, recipe: Optional[Recipe], *, include: Patterns = None,
                   exclude: Patterns = None,
                   rngs: Optional[nnx.Rngs] = None) -> tuple[nnx.Module, list[Swap]]:
  """Swap, in place, the Linear / LinearGeneral / Einsum modules of `model` for jaxquant's.

  Example::

    model = Transformer(config, rngs=nnx.Rngs(0))        # plain nnx.Linear / nnx.Einsum
    model, swaps = jaxquant.nnx.quantize_model(model, jaxquant.Float8CurrentScaling())
    optimizer = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)  # or an existing one

  Args:
    model: an NNX module (or graph of them); changed in place.
    recipe: the recipe of every swapped module; None: each uses the innermost
      `jaxquant.autocast` at call time (delayed scaling then needs its state created here:
      swap under the same `autocast`).
    include, exclude: path patterns (see the module doc); None: every module / none.
    rngs: an `nnx.Rngs` with a `"quantize"` stream, forked for each swapped module; needed when
      the recipe rounds stochastically (NVFP4's gradients).

  Returns:
    `(model, swaps)`: the model (a new object only when `model` itself was a swapped module)
    and one `Swap` per swapped module, in the order of their paths.
  """
  check_recipe(recipe, "quantize_model(recipe)")
  include, exclude = _patterns(include, "include"), _patterns(exclude, "exclude")
  candidates = _candidates(model)
  paths = [p for p, _ in candidates.values()]
  _check_patterns(include, paths, "include")
  _check_patterns(exclude, paths, "exclude")
  replacements, swaps = {}, []
  for key, (path, module) in candidates.items():
    if include is not None and not any(fnmatch.fnmatchcase(path, p) for p in include):
      continue
    if exclude is not None and any(fnmatch.fnmatchcase(path, p) for p in exclude):
      continue
    name = path.rsplit("/", 1)[-1] or type(module).__name__
    new = SWAPS[type(module)].from_flax(module, recipe=recipe, name=name, path=path, rngs=rngs)
    _check_rngs(new, recipe, rngs)
    reason = new.unsupported_reason() if isinstance(new, Einsum) and new.einsum_str else ""
    replacements[key] = (module, new)  # the original stays referenced: ids stay unique
    swaps.append(Swap(path, type(module), new, reason))
  if id(model) in replacements:
    return replacements[id(model)][1], swaps
  _replace_references(model, replacements, (), set())
  return model, swaps


def _check_rngs(module: QuantizedContraction, recipe: Optional[Recipe], rngs) -> None:
  quantizers = module._quantizers(recipe if recipe is not None else current_recipe())
  if quantizers is None or not stochastic_roles(quantizers):
    return
  if not (isinstance(rngs, nnx.Rngs) and QUANTIZE_RNG in rngs):
    raise ValueError(
        f"quantize_model(rngs=...): the recipe rounds {module.path}'s "
        f"{', '.join(str(r) for r in stochastic_roles(quantizers))} stochastically; pass "
        f"rngs=nnx.Rngs({QUANTIZE_RNG}=seed)")
