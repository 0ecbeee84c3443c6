"""FFI wrappers of the fused producers (`ffi/fused`): a normalization or an activation whose
kernel writes the quantized copies of its output, bit for bit the reference composition.

* `norm_stats`: LayerNorm / RMSNorm statistics per row (mean, rsigma) and, when a per-tensor
  scale needs it first, the amax of the normalized output (`jaxquant_norm_stats`).
* `producer_amax`: the amax of an activation's output or of an activation gradient
  (`jaxquant_fused_amax`), for per-tensor current scaling.
* `fused_quantize`: the producer's output quantized in one pass over its inputs
  (`jaxquant_fused_quantize_{fp8,mxfp8,fp8_block}`), optionally with the normalized output in
  high precision (`write_y`) and per-tile column sums (`col_sums`, a bias gradient).

Every call is partitioned (`partitioning.Layout`): rows may be sharded; a normalization's or a
gated unit's columns may not (their values need the whole row), which the partitioner rejects
by name (the layers take the unfused path instead where a plan shards them).
"""

from __future__ import annotations

from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jaxquant.backends.ffi import calls, registry
from jaxquant.backends.ffi.partitioning import Layout
from jaxquant.backends.producers import Fused, Inputs, Producer, output_shape
from jaxquant.formats import format_of
from jaxquant.formats.delayed import DelayedScalingState, quantize_scale
from jaxquant.numerics import activations as _act
from jaxquant.quantizers import HIGH_PRECISION_DTYPES, Quantizer
from jaxquant.tensors import ScaledTensor

PRODUCER_CODES = {"layernorm": 1, "rmsnorm": 2, "activation": 3, "activation_grad": 4,
                  "parts": 5}  # ffi/fused
OUT_TYPES = {np.dtype(jnp.bfloat16): 0, np.dtype(jnp.float16): 1, np.dtype(jnp.float32): 2}
TARGETS = ("jaxquant_norm_stats", "jaxquant_fused_amax", "jaxquant_fused_quantize_fp8",
           "jaxquant_fused_quantize_mxfp8", "jaxquant_fused_quantize_fp8_block")
_MAX_DIM = 2**31 - 1
MAX_PARTS = 8  # ffi/fused/fused_args.h, kMaxParts


def unsupported(producer: Producer, inputs: Inputs, quantizer: Quantizer,
                platform: str) -> Optional[str]:
  """None when a fused kernel serves this case on `platform` ("cpu"/"cuda"), else why not."""
  reason = registry.unserved_reason(platform)
  if reason is not None:
    return reason
  missing = [t for t in TARGETS if t not in registry.registered_targets(platform)]
  if missing:
    return (f"the jaxquant FFI extension has no fused producer targets ({', '.join(missing)}); "
            "it was built before them: rebuild it")
  if format_of(quantizer).fused_producer_kernel(quantizer) is None:
    return (f"no fused kernel quantizes {type(quantizer).__name__} (per-tensor FP8, MXFP8 and "
            "Float8Block have one)")
  if producer.kind == "parts":
    reason = _parts_unsupported(producer, inputs)
    if reason is not None:
      return reason
  for name, array in (("input", inputs.a), ("h", inputs.b)):
    if array is None:
      continue
    if array.ndim != 2 or 0 in array.shape or max(array.shape) > _MAX_DIM:
      return f"the fused kernels need a non-empty 2-D matrix below 2^31; {name} is {array.shape}"
    if np.dtype(array.dtype) not in HIGH_PRECISION_DTYPES:
      return f"the fused kernels read bfloat16/float16/float32, not {np.dtype(array.dtype).name}"
  in_dtype = np.dtype(inputs.a.dtype)
  if producer.out_dtype not in OUT_TYPES:
    return f"the fused kernels write bfloat16/float16/float32, not {producer.out_dtype.name}"
  if not producer.norm and producer.out_dtype != in_dtype:
    return (f"an activation keeps its input's dtype: {in_dtype.name} in, "
            f"{producer.out_dtype.name} out")
  if (platform == "cuda" and producer.norm and producer.out_dtype != in_dtype
      and producer.out_dtype != np.dtype(jnp.float32)):
    return (f"no CUDA kernel normalizes {in_dtype.name} into {producer.out_dtype.name} (the "
            "output is the input's dtype or float32)")
  if producer.kind == "activation" and producer.gated and inputs.a.shape[1] % 2:
    return f"a gated unit's input holds two halves; got {inputs.a.shape[1]} columns"
  return None


def _parts_unsupported(producer: Producer, inputs: Inputs) -> Optional[str]:
  parts = (inputs.a, *inputs.more)
  if len(parts) > MAX_PARTS:
    return f"the fused kernels join at most {MAX_PARTS} parts; got {len(parts)}"
  if any(p.shape != inputs.a.shape or p.dtype != inputs.a.dtype for p in parts):
    return ("the parts differ in shape or dtype: "
            f"{[(tuple(p.shape), np.dtype(p.dtype).name) for p in parts]}")
  if inputs.a.ndim == 2 and inputs.a.shape[1] * len(parts) > _MAX_DIM:
    return f"the joined parts have {inputs.a.shape[1] * len(parts)} columns, >= 2^31"
  if producer.out_dtype != np.dtype(inputs.a.dtype):
    return (f"parts keep their dtype: {np.dtype(inputs.a.dtype).name} in, "
            f"{producer.out_dtype.name} out")
  return None


# The `act` code of an approximate gelu (jq::Act::kGeluApprox): after ACTIVATIONS' codes.
GELU_APPROX_CODE = len(_act.ACTIVATIONS)


def _attrs(producer: Producer) -> dict:
  act = GELU_APPROX_CODE if producer.approximate else _act.ACTIVATIONS.index(producer.activation)
  return dict(producer=np.int32(PRODUCER_CODES[producer.kind]), act=np.int32(act),
              out_type=np.int32(OUT_TYPES[producer.out_dtype]), gated=producer.gated,
              has_scale=producer.has_scale, has_bias=producer.has_bias)


def _placeholder() -> jax.Array:
  return jnp.zeros((), jnp.float32)


def _f32(v: Optional[jax.Array]) -> jax.Array:
  return _placeholder() if v is None else jnp.asarray(v, jnp.float32)


def _sds(shape, dtype) -> jax.ShapeDtypeStruct:
  return jax.ShapeDtypeStruct(tuple(shape), np.dtype(dtype))


# The producer inputs' partitioning: rows follow "m"; a normalization's row (and a gated unit's
# pair of halves) must stay whole, so its column axis is one block of its full length.
def _operand_dims(producer: Producer, inputs: Inputs) -> tuple:
  vec = lambda v, axis: ((axis, 1),) if v is not None else ()
  if producer.norm:
    return ((("m", 1), ("k", 1)), (), vec(inputs.mean, "m"), vec(inputs.rsigma, "m"),
            vec(inputs.scale, "k"), vec(inputs.bias, "k"))
  if producer.kind == "activation":
    a = (("m", 1), ("h", 1)) if producer.gated else (("m", 1), ("k", 1))
    return (a, (), (), (), (), ())
  if producer.kind == "parts":  # and the other parts: _more_dims
    return ((("m", 1), ("n", 1)), (), (), (), (), ())
  if producer.gated:
    return ((("m", 1), ("n", 1)), (("m", 1), ("k", 1)), (), (), (), ())
  return ((("m", 1), ("k", 1)), (("m", 1), ("k", 1)), (), (), (), ())


def _more_dims(inputs: Inputs) -> tuple:
  """The layout of the operands after a target's own: the other parts, rows following "m"."""
  return ((("m", 1), ("n", 1)),) * len(inputs.more)


def _whole_rows(producer: Producer, inputs: Inputs) -> tuple:
  """The `Layout.blocks` that keep what a value needs on one shard: a normalized row, both
  halves of a gated unit, every part's columns (a shard of each would not be a shard of the
  joined matrix)."""
  rows, cols = output_shape(producer, inputs)
  if producer.kind == "parts":
    return (("n", inputs.a.shape[1]), ("k", cols))
  if producer.norm:
    return (("k", cols),)
  if producer.gated and producer.kind == "activation":
    return (("h", 2 * cols),)
  if producer.gated:
    return (("n", cols // 2), ("k", cols))
  return ()


def _operands(inputs: Inputs) -> tuple:
  b = _placeholder() if inputs.b is None else inputs.b
  return (inputs.a, b, _f32(inputs.mean), _f32(inputs.rsigma), _f32(inputs.scale),
          _f32(inputs.bias))


def norm_stats(x2d: jax.Array, scale: Optional[jax.Array], bias: Optional[jax.Array],
               producer: Producer, *, amax: int = 0,
               gate: Optional[jax.Array] = None) -> tuple[Optional[jax.Array], jax.Array,
                                                          Optional[jax.Array]]:
  """(mean `[rows]` or None, rsigma `[rows]`, amax `()` or None) of `x2d`.

  `amax`: 0 none; 1 the amax of the normalized output (rounded to `producer.out_dtype`); 2 the
  same only while the float32 `gate` (a delayed-scaling scale) is 0, else 0."""
  rows, cols = x2d.shape
  layernorm = producer.kind == "layernorm"
  results = ([_sds((rows,), np.float32)] if layernorm else []) + [_sds((rows,), np.float32)]
  result_dims = ((("m", 1),),) * len(results)
  reduce = ()
  if amax:
    results.append(_sds((), np.float32))
    result_dims += ((),)
    reduce = ((len(results) - 1, ("m", "k")),)
  vec = lambda v: (("k", 1),) if v is not None else ()
  layout = Layout(operands=((("m", 1), ("k", 1)), vec(scale), vec(bias), ()),
                  results=result_dims, reduce=reduce, blocks=(("k", cols),),
                  what="jaxquant_norm_stats")
  gate = _placeholder() if gate is None else jnp.asarray(gate, jnp.float32).reshape(())
  outs = calls.call("jaxquant_norm_stats", results, x2d, _f32(scale), _f32(bias), gate,
                    layout=layout, rmsnorm=not layernorm, epsilon=float(producer.epsilon),
                    amax=np.int32(amax), out_type=np.int32(OUT_TYPES[producer.out_dtype]),
                    has_scale=scale is not None, has_bias=bias is not None)
  mean = outs.pop(0) if layernorm else None
  rsigma = outs.pop(0)
  return mean, rsigma, (outs.pop(0) if amax else None)


def producer_amax(producer: Producer, inputs: Inputs,
                  gate: Optional[jax.Array] = None) -> jax.Array:
  """The amax of the producer's output (only while the float32 `gate` is 0, when given)."""
  layout = Layout(operands=_operand_dims(producer, inputs) + ((),) + _more_dims(inputs),
                  results=((),), reduce=((0, ("m", "k")),),
                  blocks=_whole_rows(producer, inputs), what="jaxquant_fused_amax")
  gate_value = _placeholder() if gate is None else jnp.asarray(gate, jnp.float32).reshape(())
  (amax,) = calls.call("jaxquant_fused_amax", [_sds((), np.float32)], *_operands(inputs),
                       gate_value, *inputs.more, layout=layout, gated_amax=gate is not None,
                       **_attrs(producer))
  return amax


def _current_amax(producer: Producer, inputs: Inputs, gate=None) -> jax.Array:
  if producer.norm:
    _, _, amax = norm_stats(inputs.a, inputs.scale, inputs.bias, producer,
                            amax=2 if gate is not None else 1, gate=gate)
    return amax
  return producer_amax(producer, inputs, gate)


def fused_quantize(producer: Producer, inputs: Inputs, quantizer: Quantizer, *, rowwise: bool,
                   columnwise: bool, orig_dtype: Any, state: Any = None, write_y: bool = False,
                   col_sums: bool = False, amax: Optional[jax.Array] = None) -> Fused:
  """The producer's output quantized by `quantizer` in one pass over its inputs.

  A "parts" producer's other parts (`inputs.more`) follow the target's own operands.
  Per-tensor current scaling takes the amax first (`amax` when the caller has it, e.g. from
  `norm_stats`, else `producer_amax` / `norm_stats` here; a `pmax` under a mesh); delayed
  scaling quantizes with the state's scale (the first step's from the gated amax, `amax` or a
  gated pass here) and returns the amax; the block formats need no amax first."""
  rows, cols = output_shape(producer, inputs)
  tail, reduce, extra, target = [], (), {}, None
  row_scale = col_scale = None
  scale_dims = ((), ())
  fmt = format_of(quantizer)
  family = fmt.fused_producer_kernel(quantizer)
  if family in ("fp8-current", "fp8-delayed"):
    delayed = family == "fp8-delayed"
    if delayed:
      if not isinstance(state, DelayedScalingState):
        raise ValueError("state: Float8DelayedScalingQuantizer needs its DelayedScalingState "
                         f"(jaxquant.init_state(quantizer)); got {type(state).__name__}")
      s = state.scale.astype(jnp.float32).reshape(())
      if fmt.needs_current_amax(quantizer):  # no scale yet: the gated pass gives the amax
        first = amax if amax is not None else _current_amax(producer, inputs, gate=s)
        s = quantize_scale(s, first, quantizer)
      extra = dict(delayed=True, pow2_scale=False, amax_epsilon=0.0)
    else:
      s = amax if amax is not None else _current_amax(producer, inputs)
      extra = dict(delayed=False, pow2_scale=quantizer.pow2_scale,
                   amax_epsilon=float(quantizer.amax_epsilon))
    target = "jaxquant_fused_quantize_fp8"
    tail = [_sds((), np.float32)] + ([_sds((), np.float32)] if delayed else [])
    tail_dims = ((), ()) if delayed else ((),)
    amax_index = 1 if delayed else None
    operands_extra, extra_dims = (s,), ((),)
  elif family in ("mxfp8", "fp8-block"):  # block scales laid out as the format says
    scale_dtype, (br, bc) = fmt.scale_dtype(quantizer), fmt.block_shape(quantizer)
    row_scale = _sds(fmt.scale_shape(quantizer, rows, cols), scale_dtype)
    col_scale = _sds(fmt.scale_shape(quantizer, cols, rows), scale_dtype)
    scale_dims = ((("m", br), ("k", bc)), (("k", br), ("m", bc)))
    tail, tail_dims, amax_index = [_sds((), np.float32)], ((),), 0
    operands_extra, extra_dims = (), ()
    if family == "mxfp8":
      target = "jaxquant_fused_quantize_mxfp8"
    else:
      target = "jaxquant_fused_quantize_fp8_block"
      extra = dict(block_2d=br > 1, pow2_scale=quantizer.pow2_scale,
                   amax_epsilon=float(quantizer.amax_epsilon))
  else:
    raise ValueError(f"no fused kernel quantizes {type(quantizer).__name__}")

  results, result_dims = [], []
  if write_y:
    results.append(_sds((rows, cols), producer.out_dtype))
    result_dims.append((("m", 1), ("k", 1)))
  for on, shape, dims, scale, sdims in ((rowwise, (rows, cols), (("m", 1), ("k", 1)), row_scale,
                                         scale_dims[0]),
                                        (columnwise, (cols, rows), (("k", 1), ("m", 1)),
                                         col_scale, scale_dims[1])):
    if on:
      results.append(_sds(shape, quantizer.dtype))
      result_dims.append(dims)
      if scale is not None:
        results.append(scale)
        result_dims.append(sdims)
  first_tail = len(results)
  results += tail
  result_dims += list(tail_dims)
  if amax_index is not None:
    reduce = ((first_tail + amax_index, ("m", "k")),)
  if col_sums:
    results.append(_sds((-(-rows // 128), cols), np.float32))
    result_dims.append((("m", 128), ("k", 1)))
  layout = Layout(operands=_operand_dims(producer, inputs) + extra_dims + _more_dims(inputs),
                  results=tuple(result_dims), reduce=reduce,
                  blocks=_whole_rows(producer, inputs), what=target)
  outs = calls.call(target, results, *_operands(inputs), *operands_extra, *inputs.more,
                    layout=layout,
                    write_y=write_y, col_sums=col_sums, rowwise=rowwise, columnwise=columnwise,
                    **extra, **_attrs(producer))
  y = outs.pop(0) if write_y else None
  row = row_s = col = col_s = None
  if rowwise:
    row = outs.pop(0)
    row_s = outs.pop(0) if row_scale is not None else None
  if columnwise:
    col = outs.pop(0)
    col_s = outs.pop(0) if col_scale is not None else None
  if target == "jaxquant_fused_quantize_fp8":
    scale_inv = outs.pop(0)
    tensor_amax = outs.pop(0) if extra["delayed"] else s
    row_s = col_s = scale_inv
  else:
    tensor_amax = outs.pop(0)
  sums = outs.pop(0) if col_sums else None
  make = lambda d, sc: ScaledTensor(d, sc, tensor_amax, quantizer, np.dtype(orig_dtype), False)
  return Fused(make(row, row_s) if rowwise else None, make(col, col_s) if columnwise else None,
               y, sums)
