"""How far a sharded result may lie from the single-device one: a bound from the dtypes'
spacing and the number of summed terms, for every comparison in tests/multidevice where both
programs multiply the same quantized operands (test_sharded_dense.py checks those bit for bit).

Derivation. An output element is a sum `c = sum_{i<n} t_i` of n terms that both programs form
exactly: FP8 / FP4 codes times their power-of-two or E4M3 block scales multiply exactly in
float32, and per-tensor / per-row factors multiply the accumulator afterwards. Only the way the
terms are added differs. With `M = sum_i |t_i|` and `u = 2^-24` (float32's unit roundoff):

  * One device adds the n terms in some order of n - 1 float32 additions: an error of at most
    `gamma(n-1) M`, `gamma(m) = m u / (1 - m u)` (Higham, *Accuracy and Stability of Numerical
    Algorithms*, 2nd ed., eq. 4.4, which holds for any order: each term takes part in at most
    n - 1 additions).
  * The mesh adds s partial sums of n/s terms and reduces the s partials (psum,
    reduce-scatter): in float32 again n - 1 additions per term, `gamma(n-1) M`. Partials first
    rounded to a narrower `reduce_dtype` (bf16: unit roundoff `u_r = 2^-8`) and reduced in it
    add `u_r |p_j|` per partial and `gamma_r(s-1) sum_j |p_j|` for the reduction; with
    `sum_j |p_j| <= M (1 + gamma(n-1))` that is at most `s u_r (1 + s u_r) M` (first order
    `s * 2^-8 * M` for bf16 partial sums over s shards).
  * Hopper's FP8 tensor cores (the cublaslt-* paths) add each MMA's products in reduced
    precision before promoting to float32: `tensor_core * M` per GEMM, 2^-9 with split
    accumulation and 2^-7 with fast accumulation, the bounds of tests/test_ffi_gemm.py (split
    measured up to 2^-10.7 at K = 256 on an H100); a K-sharded GEMM's pieces err by at most
    the same relative to the M of their own terms, so `2 tensor_core M` for the two sides.
  * The epilogue multiplies up to two factors and adds a bias in float32 on each side: 3
    roundings of values below `M + |bias|`, `6 u (M + |bias|)` for both.
  * Both round to the output dtype: half an ulp each, the ulp taken at the rounded value (round
    to nearest never leaves a binade downwards).
  * Where a GEMM operand is quantized from a value that itself came out of reordered sums (a
    weight gradient's quantized output cotangent, computed upstream by another GEMM), the two
    programs need not quantize the same codes: an element within that upstream error of a
    rounding midpoint rounds to one neighbour on one side and to the other on the other. Round
    to nearest moves such a code by one spacing of the format, at most `2^-m |q|` for m
    mantissa bits (E5M2: 2^-2, E4M3: 2^-3), so each term moves by at most `2^-m |t_i|`: a
    further `requantized M`, `requantized = 2^-m` (`Sum.requantized`; 0 where both programs
    quantize bit-identical inputs). That holds for normal codes; a subnormal code's step (the
    format's smallest normal times 2^-m, times the scale's inverse) is far below the other
    terms wherever the tensor's amax sets the scale.

So, per element, with `a` the accumulation dtype's unit roundoff (float32's, or the gradient's
dtype for a plain `lax.reduce` of bf16 rows, which XLA may add in bf16):

  |got - want| <= (2 gamma_a(n-1) + s u_r (1 + s u_r) + 2 tensor_core + requantized) M
                  + 6 u (M + |bias|)
                  + (ulp(got) + ulp(want)) / 2.

`M` comes from the operands: `gemm_magnitude` sums `|a| |b|^T` of what a GEMM multiplies (its
storages' raw values and factors), `linear_magnitudes` evaluates a linear layer on magnitudes.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jaxquant.backends.ffi import gemm as ffi_gemm
from jaxquant.formats import format_of
from jaxquant.tensors import ScaledTensor

U32 = 2.0**-24
# Per-GEMM error of the FP8 tensor-core paths relative to M (tests/test_ffi_gemm.py).
TENSOR_CORE = {"split": 2.0**-9, "fast": 2.0**-7}
# `linear_magnitudes` computes M with the layer itself, a sum of non-negative terms whose
# relative error is below its own accumulation bound (2^-7 + n u at most) plus one rounding to
# the output dtype (2^-8 for bf16); M is raised by 2^-6 to stay an upper bound.
MAGNITUDE_SLACK = 2.0**-6


def unit_roundoff(dtype) -> float:
  return float(jnp.finfo(dtype).eps) / 2


def gamma(m: int, u: float = U32) -> float:
  return m * u / (1 - m * u)


@dataclasses.dataclass(frozen=True)
class Sum:
  """How both programs formed one compared output.

  Attributes:
    terms: n, the terms per output element (the GEMM's K, or the rows of a bias gradient).
    shards: s, the partial sums the mesh reduced (1: K not sharded).
    reduce_dtype: the dtype the mesh rounded its partials to and reduced them in.
    accumulate_dtype: the dtype each side accumulates in (float32 for every GEMM path).
    tensor_core: the per-GEMM FP8 tensor-core term (`TENSOR_CORE`), 0 elsewhere.
    requantized: the relative spacing `2^-m` of the format an operand was quantized to from a
      value that reordered sums produced on each side (`requantized_spacing`), 0 elsewhere.
  """

  terms: int
  shards: int = 1
  reduce_dtype: Any = jnp.float32
  accumulate_dtype: Any = jnp.float32
  tensor_core: float = 0.0
  requantized: float = 0.0

  def coefficient(self) -> float:
    """The factor of M in the bound (see the module doc)."""
    coeff = 2 * gamma(max(self.terms - 1, 0), unit_roundoff(self.accumulate_dtype))
    u_r = unit_roundoff(self.reduce_dtype)
    if self.shards > 1 and u_r > U32:
      coeff += self.shards * u_r * (1 + self.shards * u_r)
    return coeff + 2 * self.tensor_core + self.requantized


def requantized_spacing(dtype) -> float:
  """`2^-m`: the most one round-to-nearest step of `dtype` (m mantissa bits) moves a code,
  relative to its magnitude (`Sum.requantized`)."""
  return 2.0 ** -int(jnp.finfo(dtype).nmant)


def ulp(values: np.ndarray, dtype) -> np.ndarray:
  """The spacing of `dtype` at |values| (the smallest subnormal step at 0)."""
  info = jnp.finfo(dtype)
  mag = np.maximum(np.abs(np.asarray(values, np.float64)), float(info.tiny))
  return np.exp2(np.floor(np.log2(mag)) - info.nmant)


def bound(magnitude, got, want, how: Sum, bias_magnitude=0.0, out_dtype=None) -> np.ndarray:
  """The largest |got - want| the module doc allows, per element (`magnitude` = M broadcast to
  their shape; `out_dtype`: the dtype they were rounded to, default theirs)."""
  m = np.asarray(magnitude, np.float64)
  dtype = np.asarray(want).dtype if out_dtype is None else out_dtype
  return (how.coefficient() * m + 6 * U32 * (m + np.abs(np.asarray(bias_magnitude, np.float64)))
          + (ulp(got, dtype) + ulp(want, dtype)) / 2)


def assert_within(got, want, magnitude, how: Sum, name: str = "", bias_magnitude=0.0,
                  out_dtype=None) -> None:
  """Every element of `got` within `bound` of `want`; NaN exactly where `want` has NaN.
  `out_dtype`: the dtype the GEMM rounded them to, where they were cast afterwards (a bf16
  layer's gradient of a float32 parameter); default their own."""
  got, want = np.asarray(got), np.asarray(want)
  assert got.shape == want.shape and got.dtype == want.dtype, (name, got.shape, got.dtype,
                                                                want.shape, want.dtype)
  g, w = got.astype(np.float64), want.astype(np.float64)
  np.testing.assert_array_equal(np.isnan(g), np.isnan(w), err_msg=f"{name}: NaN positions")
  limit = bound(np.broadcast_to(magnitude, w.shape), got, want, how, bias_magnitude,
                out_dtype)
  err = np.where(g == w, 0.0, np.abs(g - w))
  bad = ~np.isnan(w) & ~(err <= limit)
  assert not bad.any(), (
      f"{name}: {bad.sum()} of {bad.size} elements past the reordered-sum bound "
      f"({how}); worst |got - want| / bound = {np.max(np.where(np.isnan(w), 0, err / limit)):.3g}")


# --------------------------------------------------------------------------------------------
# M: the magnitudes of the terms.
# --------------------------------------------------------------------------------------------

def _gemm_values(operand) -> tuple[np.ndarray, Optional[np.ndarray]]:
  """|values| a GEMM multiplies (blocks times block scales, in the RHT domain where the storage
  has it) and |its accumulator factor| (per tensor or per row), as float64."""
  if isinstance(operand, ScaledTensor) and operand.scale_inv is not None:
    fmt = format_of(operand.quantizer)
    factor = fmt.gemm_factor(operand)
    return (np.abs(np.asarray(fmt.dequantize_raw(operand), np.float64)),
            None if factor is None else np.abs(np.asarray(factor, np.float64)))
  data = operand.data if isinstance(operand, ScaledTensor) else operand
  return np.abs(np.asarray(jnp.asarray(data, jnp.float32), np.float64)), None


def gemm_magnitude(a, b) -> np.ndarray:
  """M of `C[m, n] = sum_k a[m, k] b[n, k]` for two storages (or arrays) `[rows, K]`."""
  (va, fa), (vb, fb) = _gemm_values(a), _gemm_values(b)
  m = va @ vb.T
  if fa is not None:
    m = m * (fa[:, None] if fa.ndim else fa)
  if fb is not None:
    m = m * (fb[None, :] if fb.ndim else fb)
  return m


def linear_magnitudes(fn: Callable, params, x, cotangent):
  """M of `fn(params, x)`'s output and of its gradients for `cotangent`, for a layer linear in
  `x` and in its kernel (a quantized dense, einsum or their sharded forms): the same layer,
  evaluated on |params|, |x| and |cotangent|, adds exactly the terms' magnitudes.

  This holds where quantization commutes with |.|: a scale from an amax (of a tensor or a
  block) and round-to-nearest, which is odd (per-tensor FP8, MXFP8, Float8Block, NVFP4 without
  stochastic rounding or the Hadamard transform). A bias adds |bias| to M_y (an upper bound
  still). Returns `(M_y, (M_dparams, M_dx))`, raised by `MAGNITUDE_SLACK`."""
  mag = lambda tree: jax.tree.map(jnp.abs, tree)
  y, vjp = jax.vjp(fn, mag(params), mag(x))
  grads = vjp(mag(cotangent).astype(y.dtype))
  raise_ = lambda v: np.asarray(v, np.float64) * (1 + MAGNITUDE_SLACK)
  return raise_(y), jax.tree.map(raise_, grads)


# --------------------------------------------------------------------------------------------
# n, s and the tensor-core term of each GEMM, from what jaxquant.explain recorded.
# --------------------------------------------------------------------------------------------

DIRECTIONS = ("fprop", "dgrad", "wgrad")
_REDUCE = re.compile(r"partial sums over \(([^)]*)\) in (\w+)")


def _direction(role) -> Optional[str]:
  direction = str(role).rsplit("/", 1)[-1]
  return direction if direction in DIRECTIONS else None


def gemm_sums(single_report, sharded_report, mesh, terms: dict[str, int]) -> dict[str, Sum]:
  """The `Sum` of each GEMM direction of one layer.

  Args:
    single_report: `jaxquant.explain` of the single-device step: the path each GEMM took (an
      FP8 tensor-core path adds `TENSOR_CORE` of its FP8 accumulation mode).
    sharded_report: `jaxquant.explain` of the sharded step: its "reduce" lines name the mesh
      axes and dtype of each K-sharded GEMM's partial sums.
    mesh: the mesh of the sharded step.
    terms: n per direction ("fprop": K, "dgrad": the output features, "wgrad": the rows).
  """
  tensor_core = {}
  for d in single_report:
    direction = _direction(d.role)
    if d.op == "gemm" and direction is not None and d.path.startswith("cublaslt"):
      mode = ffi_gemm.fp8_accumulation(None, str(d.role), None)
      tensor_core[direction] = max(tensor_core.get(direction, 0.0), TENSOR_CORE[mode])
  reductions = {}
  for d in sharded_report:
    direction = _direction(d.role)
    match = _REDUCE.fullmatch(d.detail) if d.op == "reduce" else None
    if direction is not None and match is not None:
      axes = [a.strip(" '\"") for a in match.group(1).split(",") if a.strip(" '\"")]
      reductions[direction] = (math.prod(mesh.shape[a] for a in axes),
                               jnp.dtype(match.group(2)))
  return {direction: Sum(n, *reductions.get(direction, (1, jnp.float32)),
                         tensor_core=tensor_core.get(direction, 0.0))
          for direction, n in terms.items()}
