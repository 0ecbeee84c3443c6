"""Fused producers: a normalization or an activation that writes the quantized copies of its
output, instead of writing it in high precision for a separate quantize pass to read.

`norm_quantize`, `activation_quantize` and `activation_grad_quantize` compute the producer in
the spec's exact float32 arithmetic (`jaxquant.numerics.normalization` / `activations`), round
it to its dtype and quantize it: on the FFI kernels (`jaxquant.backends.ffi.fused`, one pass
over the producer's inputs) where the extension serves the case, else as the reference
composition (`jaxquant.backends.reference.fused`), with the same bits. `JAXQUANT_BACKEND` forces
either, as for the other ops, and `jaxquant.explain` records a "fused <producer>+quantize"
decision with the path taken and why.

`fusion_unsupported(quantizer)` says whether a format has fused kernels at all (per-tensor FP8,
current and delayed; MXFP8; Float8Block). For the others the layers run the producer and the
quantize separately and record why ("<producer>, then quantize"); `auto_fusion_reason()` says
whether the layers fuse by default (not yet anywhere: decision 20 of docs/design.md).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import jax
import numpy as np

from jaxquant.explain import Decision, record
from jaxquant.backends.ffi import fused as _ffi
from jaxquant.backends.ffi.gemm import GELU_TARGET as GELU_GEMM_TARGET
from jaxquant.backends.ffi import registry
from jaxquant.backends.producers import Inputs, Producer
from jaxquant.backends.reference import fused as _reference
from jaxquant.numerics.reductions import pairwise_sum
from jaxquant.ops import dispatch
from jaxquant.formats import format_of
from jaxquant.quantizers import Quantizer
from jaxquant.settings import env_choice
from jaxquant.tensors import QuantizedTensor

__all__ = ["NormQuantized", "activation_grad_quantize", "activation_quantize",
           "auto_fusion_reason", "auto_quantize_gelu_reason", "fusion_unsupported",
           "norm_quantize", "parts_quantize"]


def fusion_unsupported(quantizer: Quantizer) -> Optional[str]:
  """None when `quantizer`'s format has fused producer kernels, else why not."""
  fmt = format_of(quantizer)
  if fmt.halves(quantizer) is not None:
    return (f"{type(quantizer).__name__}: each direction has its own format, and the fused "
            "kernels write both copies in one format")
  if fmt.fused_producer_kernel(quantizer) is None:
    return (f"no fused kernel quantizes {type(quantizer).__name__} (per-tensor FP8, MXFP8 and "
            "Float8Block have one)")
  return None


def auto_fusion_reason(kind: str = "norm") -> Optional[str]:
  """None when the layers take the fused `kind` producer ("norm" or "activation", its gradient
  included) by default on this platform, else why not.

  Nowhere, for now (docs/design.md decision 20): on an H200 each fused CUDA kernel measured
  slower than XLA's producer followed by the quantize kernel (bench/RESULTS.md, "Fused
  producers"), so a default that fused would slow the step. The CPU handlers are plain loops,
  slower still. The layers fuse when asked (`fuse_producers=True`);
  `JAXQUANT_FUSE_PRODUCERS=on` fuses wherever the formats allow, `norms` only the
  normalizations, `off` never (A/B timings without touching a model; a module's explicit
  `fuse_producers` wins)."""
  if kind not in ("norm", "activation"):
    raise ValueError(f"kind={kind!r}: expected 'norm' or 'activation'")
  setting = env_choice("JAXQUANT_FUSE_PRODUCERS", ("auto", "on", "norms", "off"), "auto")
  if setting == "off":
    return "JAXQUANT_FUSE_PRODUCERS=off"
  if setting == "norms":
    return "JAXQUANT_FUSE_PRODUCERS=norms" if kind == "activation" else None
  if setting == "on":
    return None
  gate = _cuda_gate(_ffi.TARGETS, "fused producer targets",
                    "the fused producers' handlers are slower than XLA's producer and the "
                    "quantize kernels (fuse_producers=True takes them)")
  return gate or ("the fused CUDA kernels measure slower than the producer, then the quantize "
                  "kernel (bench/RESULTS.md); fuse_producers=True or JAXQUANT_FUSE_PRODUCERS=on "
                  "takes them")


def _cuda_gate(targets, what: str, elsewhere: str) -> Optional[str]:
  """Why a default that only CUDA takes is off here (None: it is on): the reference backend,
  another platform (`elsewhere` says why there), or an extension without `targets` (`what`)."""
  if dispatch.requested_backend() == "reference":
    return "JAXQUANT_BACKEND=reference"
  platform = dispatch.current_platform()
  if platform != "cuda":
    return f"on {platform} {elsewhere}"
  if dispatch.ffi_module() is None:
    return dispatch.ffi_missing_reason()
  missing = [t for t in targets if t not in registry.registered_targets(platform)]
  if missing:
    return f"the jaxquant FFI extension has no {what} ({', '.join(missing)}); rebuild it"
  return None


def auto_gemm_epilogue_reason() -> Optional[str]:
  """None when an MLP's gelu runs in fc1's GEMM epilogue by default here
  (`jaxquant.ops.gemm_gelu`), else why not.

  On CUDA with the extension's `jaxquant_gemm_fp8_gelu` target, yes (docs/design.md decision
  60: cuBLASLt's epilogue costs less than XLA's gelu fusion it replaces). On CPU the target's
  handler is a plain loop, and the unfused arithmetic stays the CPU default
  (`fuse_gemm_activation=True` takes it). `JAXQUANT_GEMM_EPILOGUE=on|off` overrides `auto`
  for A/B timings (a module's explicit `fuse_gemm_activation` wins)."""
  setting = env_choice("JAXQUANT_GEMM_EPILOGUE", ("auto", "on", "off"), "auto")
  if setting == "off":
    return "JAXQUANT_GEMM_EPILOGUE=off"
  if setting == "on":
    return None
  return _cuda_gate((GELU_GEMM_TARGET,), "gelu GEMM target",
                    "the gelu epilogue's handler is a plain loop (fuse_gemm_activation=True "
                    "takes it)")


def auto_quantize_gelu_reason() -> Optional[str]:
  """None when an MLP's gelu runs in Float8Block's fc2 input quantize kernel by default here
  (`activation_quantize(..., approximate=True)`), else why not.

  Nowhere, for now (docs/design.md decision 62): on an H200 it removed 0.76 ms of XLA's kernels
  from the d2048 modules step but the step did not get faster (41.95 against 41.28 ms in one
  process, `bench/jobs/s38e.txt`; its GEMMs ran slower back to back). On CPU the target's
  handler computes the spec's gelu in a plain loop. `fuse_gemm_activation=True` or
  `JAXQUANT_GEMM_EPILOGUE=on` takes it (a module's explicit `fuse_gemm_activation` wins)."""
  setting = env_choice("JAXQUANT_GEMM_EPILOGUE", ("auto", "on", "off"), "auto")
  if setting == "off":
    return "JAXQUANT_GEMM_EPILOGUE=off"
  if setting == "on":
    return None
  gate = _cuda_gate(("jaxquant_fused_quantize_fp8_block",), "fused Float8Block target",
                    "the fused target's handler is a plain loop (fuse_gemm_activation=True "
                    "takes it)")
  return gate or ("the quantize kernel's gelu measured no faster in the step than XLA's gelu "
                  "(decision 62); fuse_gemm_activation=True or JAXQUANT_GEMM_EPILOGUE=on "
                  "takes it")


def _implementation(producer: Producer, inputs: Inputs, quantizer: Quantizer):
  """(backend module, path name, reason) for one fused call."""
  ffi = dispatch.ffi_module()
  reason = dispatch.ffi_missing_reason() if ffi is None else _ffi.unsupported(
      producer, inputs, quantizer, dispatch.current_platform())
  path, reason = dispatch.choose(f"fused {producer.kind}+quantize", reason)
  if path == "ffi":
    return _ffi, ffi.path_name(), reason
  return _reference, "reference", reason


def _record(role, producer: Producer, quantizer: Quantizer, rowwise: bool, columnwise: bool,
            path: str, reason: str) -> None:
  directions = "+".join(d for d, on in (("rowwise", rowwise), ("columnwise", columnwise)) if on)
  what = producer.kind.replace("_", " ")
  if producer.kind == "parts":
    what = "column parts"
  elif producer.activation and not producer.norm:
    what = f"{what} {producer.activation}{' gated' if producer.gated else ''}"
    what += " (approximate)" if producer.approximate else ""
  record(Decision("quantize", role,
                                    f"fused {what}+quantize {directions}: {quantizer}", path,
                                    reason))


def _amax_mode(quantizer: Quantizer) -> int:
  """What the statistics pass must also return: 1 the output's amax (current scaling), 2 the
  same while a delayed-scaling state has no scale yet, 0 nothing."""
  fmt = format_of(quantizer)
  family = fmt.fused_producer_kernel(quantizer)
  if family == "fp8-current":
    return 1
  if family == "fp8-delayed" and fmt.needs_current_amax(quantizer):
    return 2
  return 0


@dataclasses.dataclass(frozen=True)
class NormQuantized:
  """`norm_quantize`'s results: the quantized copies, the statistics the backward pass needs,
  and the normalized output in high precision when it was asked for."""

  quantized: QuantizedTensor
  mean: Optional[jax.Array]
  rsigma: jax.Array
  y: Optional[jax.Array] = None


def norm_quantize(x2d: jax.Array, scale: Optional[jax.Array], bias: Optional[jax.Array], *,
                  norm_type: str, epsilon: float, out_dtype: Any, quantizer: Quantizer,
                  rowwise: bool = True, columnwise: bool = True, state: Any = None,
                  write_y: bool = False, orig_dtype: Any = None,
                  role: Any = None) -> NormQuantized:
  """LayerNorm / RMSNorm of `x2d[rows, K]` over K, quantized.

  Args:
    scale: the normalization's float32 scale `[K]` (`1 + gamma` for a zero-centered gamma), or
      None; bias: float32 `[K]` or None.
    norm_type: "layernorm" or "rmsnorm"; epsilon: added to the variance.
    out_dtype: the normalized output's dtype (its values are rounded to it before quantizing).
    quantizer: a format with fused kernels (`fusion_unsupported` is None).
    state: the delayed-scaling state of a `Float8DelayedScalingQuantizer`.
    write_y: also return the normalized output in `out_dtype` (something else reads it).
    orig_dtype: the quantized tensors' `orig_dtype` (the consumer's input dtype; default
      `out_dtype`).
    role: label for `jaxquant.explain`.
  """
  reason = fusion_unsupported(quantizer)
  if reason is not None:
    raise ValueError(f"quantizer: {reason}")
  producer = Producer(norm_type, out_dtype, epsilon=epsilon, has_scale=scale is not None,
                      has_bias=bias is not None)
  impl, path, why = _implementation(producer, Inputs(x2d), quantizer)
  _record(role, producer, quantizer, rowwise, columnwise, path, why)
  mode = _amax_mode(quantizer)
  gate = state.scale if mode == 2 else None
  mean, rsigma, amax = impl.norm_stats(x2d, scale, bias, producer, amax=mode, gate=gate)
  inputs = Inputs(x2d, mean=mean, rsigma=rsigma, scale=scale, bias=bias)
  fused = impl.fused_quantize(producer, inputs, quantizer, rowwise=rowwise, columnwise=columnwise,
                              orig_dtype=np.dtype(orig_dtype or out_dtype), state=state,
                              write_y=write_y, amax=amax)
  return NormQuantized(QuantizedTensor(fused.rowwise, fused.columnwise, quantizer), mean, rsigma,
                       fused.y)


def activation_quantize(h2d: jax.Array, *, activation: str, gated: bool, quantizer: Quantizer,
                        rowwise: bool = True, columnwise: bool = True, state: Any = None,
                        role: Any = None, approximate: bool = False) -> QuantizedTensor:
  """`act(h)` (gated: `act(h0) * h1` of `h2d = [h0 | h1]`) quantized; the output keeps h's
  dtype. `approximate`: an ungated gelu the CUDA kernels may compute with hardware
  approximations (`Producer.approximate`)."""
  reason = fusion_unsupported(quantizer)
  if reason is not None:
    raise ValueError(f"quantizer: {reason}")
  dtype = np.dtype(h2d.dtype)
  producer = Producer("activation", dtype, activation=activation, gated=gated,
                      approximate=approximate)
  inputs = Inputs(h2d)
  impl, path, why = _implementation(producer, inputs, quantizer)
  _record(role, producer, quantizer, rowwise, columnwise, path, why)
  fused = impl.fused_quantize(producer, inputs, quantizer, rowwise=rowwise, columnwise=columnwise,
                              orig_dtype=dtype, state=state)
  return QuantizedTensor(fused.rowwise, fused.columnwise, quantizer)


def activation_grad_quantize(dy2d: jax.Array, h2d: jax.Array, *, activation: str, gated: bool,
                             quantizer: Quantizer, rowwise: bool = True, columnwise: bool = True,
                             state: Any = None, dbias: bool = False,
                             role: Any = None) -> tuple[QuantizedTensor, Optional[jax.Array]]:
  """The gradient through the activation, `dh = dy * act'(h)` (gated: `[dh0 | dh1]`), in h's
  dtype, quantized; with `dbias`, also the float32 sum of dh over its rows (per-tile sums in the
  kernel, then `reductions.pairwise_sum` over the tiles)."""
  reason = fusion_unsupported(quantizer)
  if reason is not None:
    raise ValueError(f"quantizer: {reason}")
  producer = Producer("activation_grad", np.dtype(h2d.dtype), activation=activation,
                      gated=gated)
  return _gradient_quantize(producer, Inputs(dy2d, b=h2d), quantizer, rowwise=rowwise,
                            columnwise=columnwise, state=state, dbias=dbias, role=role)


def _gradient_quantize(producer: Producer, inputs: Inputs, quantizer: Quantizer, *,
                       rowwise: bool, columnwise: bool, state: Any, dbias: bool,
                       role: Any) -> tuple[QuantizedTensor, Optional[jax.Array]]:
  """A gradient producer's output quantized, and its float32 column sums with `dbias` (per-tile
  sums in the kernel, then `reductions.pairwise_sum` over the tiles)."""
  impl, path, why = _implementation(producer, inputs, quantizer)
  _record(role, producer, quantizer, rowwise, columnwise, path, why)
  fused = impl.fused_quantize(producer, inputs, quantizer, rowwise=rowwise, columnwise=columnwise,
                              orig_dtype=producer.out_dtype, state=state, col_sums=dbias)
  bias_grad = pairwise_sum(fused.col_sums, axis=0) if dbias else None
  return QuantizedTensor(fused.rowwise, fused.columnwise, quantizer), bias_grad


def parts_quantize(parts, *, quantizer: Quantizer, rowwise: bool = True,
                   columnwise: bool = True, state: Any = None, dbias: bool = False,
                   role: Any = None) -> tuple[QuantizedTensor, Optional[jax.Array]]:
  """The column parts `[rows, Cp]` side by side, `[p0 | p1 | ...]`, quantized where they lie:
  a packed projection's dq, dk and dv (`jaxquant.layers.split_output`) without the copy that
  joins them. Bit for bit `jnp.concatenate(parts, axis=1)` quantized. With `dbias`, also the
  float32 column sums (per-tile sums in the kernel, then `reductions.pairwise_sum` over the
  tiles, as `activation_grad_quantize`'s)."""
  reason = fusion_unsupported(quantizer)
  if reason is not None:
    raise ValueError(f"quantizer: {reason}")
  parts = tuple(parts)
  if not parts:
    raise ValueError("parts: expected at least one [rows, cols] array")
  return _gradient_quantize(Producer("parts", np.dtype(parts[0].dtype)),
                            Inputs(parts[0], more=parts[1:]), quantizer, rowwise=rowwise,
                            columnwise=columnwise, state=state, dbias=dbias, role=role)
