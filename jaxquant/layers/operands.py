"""The quantized operands of a dense contraction, made outside its `custom_vjp`.

`jaxquant.dense` quantizes its input and weight here, before its `custom_vjp`, and hands the
storages in. Being outside is what lets
- a remat policy keep the quantized weight: its copies carry `checkpoint_name`s (`WEIGHT_NAMES`),
  so `jax.checkpoint(..., policy=remat_policy())` saves them instead of quantizing the weight
  again in the recomputed forward. (A `checkpoint_name` on a value inside the custom_vjp's
  forward rule that is not one of its residuals breaks JAX's remat: an `AssertionError` in
  `_flatten_bwd`, bench/RESULTS.md issue 8.)
- a caller prepare the weight once and reuse it (gradient accumulation: `prepare_weight`);
- several contractions of one input share its quantization (`jaxquant.layers.shared_inputs`);
- a fused producer (normalization, activation) hand its quantized output in as the input
  operand (`given_operand`).

Directions: the rowwise copy is always made; the columnwise copy only when the backward will
read it, which is known inside the contraction's `custom_vjp` (is the other operand
differentiated?), not here. So an operand goes through `_by_need`, a custom_vjp whose argument
`probe` is that other operand (the kernel for x's wgrad copy, x for W's dgrad copy): JAX calls
its forward rule only when `probe` is differentiated, and that rule makes both copies; its
primal rule makes the rowwise copy and a zero placeholder of the columnwise one's layout, which
nothing reads and XLA removes. Its outputs are `stop_gradient`ed: no gradient flows through a
quantization (the contraction's backward gives the weight and input gradients).

Bits: narrow floats (FP8 payloads, FP4 payloads, E8M0 scales) cross the custom_vjp boundary as
unsigned integers of their width (`Bits`). JAX's remat rounds every floating residual it saves
with `reduce_precision(exponent_bits, mantissa_bits)` of its dtype, which reads E4M3 as an IEEE
format with infinities: every |value| above 240 came back as inf (NaN gradients), FP4's 6 and
E8M0's smallest exponent would be lost the same way. Integers pass untouched; the bitcasts are
free in XLA.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name
from jax.custom_derivatives import CustomVJPPrimal

from jaxquant import explain as _explain
from jaxquant.quantizers import Quantizer
from jaxquant.tensors import QuantizedTensor, ScaledTensor

WEIGHT_NAMES = ("jaxquant_weight_rowwise", "jaxquant_weight_columnwise")
INPUT_NAMES = ("jaxquant_input_rowwise", "jaxquant_input_columnwise")

# make(value2d, state, key, columnwise) -> (QuantizedTensor, new state): quantizes `value2d`
# rowwise (and columnwise when asked) and returns the quantizer's state after it.
Make = Callable[[jax.Array, Any, Optional[jax.Array], bool], tuple[QuantizedTensor, Any]]


def _bit_dtype(dtype) -> Optional[np.dtype]:
  """The unsigned integer that carries a narrow float's bits (None: carried as it is)."""
  if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
    return None
  width = jax.dtypes.itemsize_bits(dtype)
  return {8: np.dtype(jnp.uint8), 4: np.dtype(jnp.uint4)}.get(width)


def _to_bits(array):
  target = None if array is None else _bit_dtype(array.dtype)
  return array if target is None else jax.lax.bitcast_convert_type(array, target)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Bits:
  """A `ScaledTensor` whose narrow-float arrays are held as unsigned integers of their width;
  `dtypes` (static) are the arrays' own dtypes, `restore()` gives the `ScaledTensor` back."""

  tensor: ScaledTensor
  dtypes: tuple = dataclasses.field(metadata=dict(static=True))

  @classmethod
  def of(cls, t: ScaledTensor) -> "Bits":
    arrays = (t.data, t.scale_inv, t.amax)
    dtypes = tuple(None if a is None else np.dtype(a.dtype) for a in arrays)
    data, scale_inv, amax = (_to_bits(a) for a in arrays)
    return cls(dataclasses.replace(t, data=data, scale_inv=scale_inv, amax=amax), dtypes)

  def restore(self) -> ScaledTensor:
    t = self.tensor
    data, scale_inv, amax = (
        a if a is None or a.dtype == d else jax.lax.bitcast_convert_type(a, d)
        for a, d in zip((t.data, t.scale_inv, t.amax), self.dtypes))
    return dataclasses.replace(t, data=data, scale_inv=scale_inv, amax=amax)

  def named(self, name: str) -> "Bits":
    """The same arrays tagged with `checkpoint_name(name)` for remat policies."""
    return jax.tree_util.tree_map(lambda a: checkpoint_name(a, name), self)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Operand:
  """A quantized GEMM operand, ready for `jaxquant.dense`.

  Attributes:
    rowwise, columnwise: the two copies as `Bits` (the columnwise one may be a zero placeholder
      where no backward reads it, see the module docstring).
    state: the quantizer's state after this quantization (delayed scaling; None otherwise):
      what the contraction returns as its state's "gradient".
    quantizer: the quantizer that made it (static).
  """

  rowwise: Bits
  columnwise: Bits
  state: Any
  quantizer: Quantizer = dataclasses.field(metadata=dict(static=True))

  @classmethod
  def of(cls, qtensor: QuantizedTensor, state: Any) -> "Operand":
    return cls(Bits.of(qtensor.rowwise), Bits.of(qtensor.columnwise), state, qtensor.quantizer)

  def storage(self) -> QuantizedTensor:
    return QuantizedTensor(self.rowwise.restore(), self.columnwise.restore(), self.quantizer)

  def named(self, names: tuple[str, str]) -> "Operand":
    """The copies tagged `names`; the state with the rowwise copy's name (a policy that keeps
    the copies keeps the state they leave, else recomputing it would quantize again)."""
    state = jax.tree_util.tree_map(lambda a: checkpoint_name(a, names[0]), self.state)
    return dataclasses.replace(self, rowwise=self.rowwise.named(names[0]),
                               columnwise=self.columnwise.named(names[1]), state=state)


def _placeholder_columnwise(make: Make, value, state, key) -> ScaledTensor:
  """Zeros in the layout of the columnwise copy (never read: the backward that would read it
  does not run). Its layout comes from an abstract trace, which records no decision."""
  with _explain.suspended():
    shapes = jax.eval_shape(lambda v, s, k: make(v, s, k, True)[0].columnwise, value, state, key)
  return jax.tree_util.tree_map(lambda a: jnp.zeros(a.shape, a.dtype), shapes)


def _both(make: Make, value, state, key) -> Operand:
  qtensor, new_state = make(value, state, key, True)
  return Operand.of(qtensor, new_state)


def _rowwise_only(make: Make, value, state, key) -> Operand:
  qtensor, new_state = make(value, state, key, False)
  columnwise = _placeholder_columnwise(make, value, state, key)
  return Operand.of(dataclasses.replace(qtensor, columnwise=columnwise), new_state)


def _unwrap(tree):
  return jax.tree_util.tree_map(lambda p: p.value, tree,
                                is_leaf=lambda p: isinstance(p, CustomVJPPrimal))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _by_need(make: Make, probe, value, state, key) -> Operand:
  del probe  # not differentiated: no backward reads the columnwise copy
  return _rowwise_only(make, value, state, key)


def _by_need_fwd(make: Make, probe, value, state, key):
  del probe  # JAX calls this rule only when `probe` is differentiated (the others are not)
  return _both(make, *_unwrap((value, state, key))), None


def _by_need_bwd(make, residuals, cotangent):
  return None, None, None, None


_by_need.defvjp(_by_need_fwd, _by_need_bwd, symbolic_zeros=True)


def quantize_operand(make: Make, value: jax.Array, *, names: tuple[str, str], probe: Any = None,
                     state: Any = None, key: Optional[jax.Array] = None) -> Operand:
  """Quantize `value` (a `[rows, contraction]` matrix) for a dense contraction.

  Args:
    make: quantizes (see `Make`); it holds the quantizer, role and sharding constraints.
    value: the high-precision operand (not differentiated through).
    names: the `checkpoint_name`s of the rowwise and the columnwise copy.
    probe: the GEMM's other operand: the columnwise copy is made only where it is
      differentiated. None: both copies, always.
    state, key: the quantizer's state and PRNG key (None where not needed).
  """
  value, state = jax.lax.stop_gradient((value, state))
  if probe is None:
    operand = _both(make, value, state, key)
  else:
    operand = jax.lax.stop_gradient(_by_need(make, probe, value, state, key))
  return operand.named(names)


def given_operand(qtensor: QuantizedTensor, update: Callable[[QuantizedTensor, Any], Any],
                  state: Any, *, names: tuple[str, str]) -> Operand:
  """An operand another kernel already quantized, both copies (a fused producer's output:
  `jaxquant.layers.fused_norm`, `fused_activation`), with the quantizer's state after it,
  `update(qtensor, state)`. No gradient flows through it (the producer's own custom_vjp carries
  x's), nor through the state update; named as a made one."""
  qtensor, state = jax.lax.stop_gradient((qtensor, state))
  return Operand.of(qtensor, update(qtensor, state)).named(names)
