"""The format registry: one `Format` object per quantizer class, the home of every format fact
(docs/design.md §4 "Formats").

A `Format` holds a format's reference math (`quantize`, `dequantize_raw`, `gemm_factor`,
`grouped_quantize`) and answers every question the layers above ask about it, so no layer
tests quantizer classes: block shapes per direction, scale shape / dtype / layout, the token
block of a grouped copy, which tensor axes a shard may split and by what multiple, whether it is
stateful, which kernels serve it (FFI quantize, XLA-fused quantize, GEMM family, grouped
quantize and grouped GEMM) and why not. Quantizer options (NVFP4's `row_scaled`, `block_2d`,
`rht`, `stochastic_rounding`; Float8Block's `block`, `pow2_scale`) are answered by methods that
take the quantizer. `HybridQuantizer` has a format too (`jaxquant.formats.hybrid`): it has no
storage of its own and delegates each direction to its halves.

Adding a format:
  1. a frozen quantizer dataclass in `jaxquant.quantizers` (options validated at construction);
  2. one module here defining a `Format` subclass: override every method that raises
     `NotImplementedError` below (the reference math, the layout facts `blocks`, `scale_layout`,
     `amax_layout`, `scale_dtype`, the kernel facts `quantize_kernel`, `gemm_family`,
     `grouped_quantize_kernel`, `grouped_gemm_scaling`, and `variants`) and the defaults that do
     not hold for it (`uses_rht`, `needs_key`, `transposable`, `exact_in_bf16`, state, ...);
     `register(QuantizerClass, MyFormat())`, and import the module in `formats/__init__.py`;
  3. its kernels, if any: the FFI quantize family `quantize_kernel` names
     (`jaxquant.backends.ffi.quantize.KERNEL_FORMATS`), the GEMM family `gemm_family` names
     (`jaxquant.backends.ffi.gemm`: "fp8", "fp8-block", "mxfp8", "nvfp4" or "hp"), the grouped
     routes (`jaxquant.backends.ffi.grouped.support`: "fp8", "nvfp4", "single") and the grouped
     GEMM's scaling code. A format without a kernel returns None there and takes the reference
     path, visibly (`jaxquant.explain` prints the reason it gives).
`tests/test_format_completeness.py` runs every registered format (each of its `variants()`)
through every layer and names what a new format is missing.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jaxquant.numerics.hadamard import rht16_inverse
from jaxquant.quantizers import Quantizer
from jaxquant.tensors import ScaledTensor, register_decoder

DIRECTIONS = ("rowwise", "columnwise")
SCALE_LAYOUTS = ("none", "tensor", "block")  # no scale (Identity), one per tensor, per block
AMAX_LAYOUTS = ("none", "tensor", "row")  # no amax, one per tensor, one per row (row-scaled)
RHT_CHUNK = 16  # the random Hadamard transform mixes chunks of 16 along the contraction axis
# The FFI quantize families whose tile kernels also serve the fused producers (`ffi/fused`).
FUSED_PRODUCER_FAMILIES = ("fp8-current", "fp8-delayed", "mxfp8", "fp8-block")


@dataclasses.dataclass(frozen=True)
class QuantizeContext:
  """Per-call inputs a format may need besides the matrix and the quantizer.

  Attributes:
    orig_dtype: dtype of the tensor being quantized.
    key_words: uint32[2] stochastic-rounding seed for this direction, or None.
    state: the quantizer's state (delayed scaling), or None.
    rht: whether `mat` has already been through the Hadamard transform.
  """

  orig_dtype: Any
  key_words: Optional[jax.Array] = None
  state: Any = None
  rht: bool = False


class Format:
  """One quantization format: its reference math and every fact the layers ask about it.

  Methods take the quantizer (a frozen dataclass of the registered class) so its options can
  change an answer. Methods that raise `NotImplementedError` here must be defined by each
  format; the others have the answer most formats share.
  """

  #: short name ("fp8-current", "mxfp8", ...), used in messages and tests
  name: str = ""
  #: the storage holds the high-precision tensor itself: no payload, scales or amax (Identity)
  high_precision: bool = False

  def __repr__(self) -> str:
    return f"<format {self.name or type(self).__name__}>"

  def _undefined(self, what: str):
    return NotImplementedError(f"format {self.name or type(self).__name__!r} does not define "
                               f"{what} (see jaxquant.formats.base: adding a format)")

  # ------------------------------------------ reference math ----------------------------------

  def quantize(self, mat: jax.Array, quantizer: Quantizer, ctx: QuantizeContext) -> ScaledTensor:
    """`[rows, cols]` matrix (contraction axis last) -> its `ScaledTensor`."""
    raise self._undefined("quantize")

  def dequantize_raw(self, t: ScaledTensor) -> jax.Array:
    """float32 blocks times block scales, without the GEMM factor."""
    raise self._undefined("dequantize_raw")

  def stores_raw(self, t: ScaledTensor) -> bool:
    """Whether `t.data` holds its raw values in bfloat16 (payload x block scale, what a GEMM on
    decoded operands reads) instead of the payload: MXFP8 copies the grouped FFI kernels write
    for those GEMMs (`jaxquant.grouped.quantize(decoded=True)`). `dequantize_raw` reads both."""
    return False

  def gemm_factor(self, t: ScaledTensor) -> Optional[jax.Array]:
    """The per-tensor (`()`) or per-row (`[rows]`) factor a GEMM applies to its accumulator."""
    return None

  def grouped_quantize(self, mat: jax.Array, quantizer: Quantizer, ctx) -> tuple:
    """(data, scale_inv, amax) of a token-layout matrix whose groups are quantized each as if
    alone (`ctx`: `jaxquant.formats.grouped.GroupedContext`)."""
    raise self._undefined("grouped_quantize")

  # ------------------------------------------ storage layout ----------------------------------

  def blocks(self, quantizer: Quantizer) -> Optional[tuple[int, int]]:
    """(block_rows, block_cols) of the scales, or None (one scale per tensor, or none)."""
    raise self._undefined("blocks")

  def scale_layout(self, quantizer: Quantizer) -> str:
    """What `scale_inv` holds: "none", "tensor" (one `()` scale) or "block" (a block grid)."""
    raise self._undefined("scale_layout")

  def amax_layout(self, quantizer: Quantizer) -> str:
    """What `amax` holds: "none", "tensor" (`()`) or "row" (`[rows]`, row-scaled)."""
    raise self._undefined("amax_layout")

  def scale_dtype(self, quantizer: Quantizer) -> Optional[np.dtype]:
    """dtype of `scale_inv` (None when there is none)."""
    raise self._undefined("scale_dtype")

  def block_shape(self, quantizer: Quantizer) -> tuple[int, int]:
    """(rows, cols) of one scaling block; (1, 1) when scaled per tensor or not at all."""
    blocks = self.blocks(quantizer)
    return (1, 1) if blocks is None else tuple(blocks)

  def scale_shape(self, quantizer: Quantizer, rows: int, cols: int) -> Optional[tuple]:
    """Shape of `scale_inv` of a `[rows, cols]` storage (None when there is none)."""
    layout = self.scale_layout(quantizer)
    if layout == "none":
      return None
    if layout == "tensor":
      return ()
    block_rows, block_cols = self.block_shape(quantizer)
    return (-(-rows // block_rows), -(-cols // block_cols))

  def uses_rht(self, quantizer: Quantizer, direction: str) -> bool:
    """Whether `direction`'s copy goes through the random Hadamard transform along its cols."""
    return False

  def copy_block(self, quantizer: Quantizer, direction: str) -> tuple[int, int]:
    """(rows, cols) of `direction`'s copy that one block or transform spans: a shard may cut
    an axis of the copy only at multiples of these, and a grouped copy pads each group to them
    along the tokens. The scale block, with cols at least `RHT_CHUNK` under the RHT."""
    block_rows, block_cols = self.block_shape(quantizer)
    if self.uses_rht(quantizer, direction):
      block_cols = max(block_cols, RHT_CHUNK)
    return block_rows, block_cols

  def token_block(self, quantizer: Quantizer, direction: str) -> int:
    """The token-layout block `direction`'s grouped copy needs: `copy_block` along the tokens
    (rows of a rowwise copy, cols of the transposed columnwise copy)."""
    return self.copy_block(quantizer, direction)[0 if direction == "rowwise" else 1]

  def transposable(self, quantizer: Quantizer) -> bool:
    """Whether the columnwise copy is the rowwise bytes transposed (nothing depends on the
    direction: per-tensor scales), so `jaxquant.ops.transpose` can make it."""
    return False

  def copies_swap_with_transpose(self, quantizer: Quantizer) -> bool:
    """Whether `quantize(W^T)`'s (rowwise, columnwise) copies are `quantize(W)`'s (columnwise,
    rowwise) bit for bit, so a weight can be quantized as it is stored and its copies swapped.

    By the spec a columnwise copy is the rowwise quantize of the transpose, so this holds unless
    the columnwise copy is transformed (RHT) or the direction picks the rounding bits
    (stochastic rounding draws per direction and position)."""
    return not (self.uses_rht(quantizer, "columnwise") or self.needs_key(quantizer))

  def transposed_quantizer(self, quantizer: Quantizer) -> Optional[Quantizer]:
    """A quantizer whose copies of `W` are `quantizer`'s copies of `W^T` swapped, bit for bit
    (so a weight is quantized as it is stored, never transposed first), or None: the quantizer
    itself where `copies_swap_with_transpose` holds."""
    return quantizer if self.copies_swap_with_transpose(quantizer) else None

  def columnwise_is_transposed_rowwise(self, quantizer: Quantizer) -> bool:
    """Whether the columnwise copy is the rowwise copy transposed, payload and block scales
    alike (per-tensor scales, or square 2-D blocks, with nothing that depends on the
    direction), so one copy can serve both GEMMs of a weight that read it either way."""
    return self.transposable(quantizer)

  def exact_in_bf16(self, quantizer: Quantizer) -> bool:
    """Whether every decoded value (before the GEMM factor) is exact in bfloat16."""
    return True

  def elements_per_byte(self, quantizer: Quantizer) -> int:
    """Payload elements per byte (2 for a packed 4-bit payload)."""
    return 1

  def variants(self) -> tuple[Quantizer, ...]:
    """Quantizers covering the format's options (what the completeness test runs)."""
    raise self._undefined("variants")

  # ------------------------------------------- quantizer level --------------------------------
  # Questions about a quantizer as a whole; a Hybrid's format answers them for its two halves.

  def halves(self, quantizer: Quantizer) -> Optional[tuple[Quantizer, Quantizer]]:
    """(rowwise, columnwise) quantizers when each direction is quantized separately (a Hybrid,
    with a state per half); None when one quantizer makes both copies (in one pass)."""
    return None

  def split_state(self, quantizer: Quantizer, state: Any) -> tuple[Any, Any]:
    """(rowwise state, columnwise state) of `state`."""
    return state, state

  def columnwise_from_rowwise(self, quantizer: Quantizer) -> bool:
    """Whether the columnwise copy is quantized from the decoded rowwise copy."""
    return False

  def key_path(self, quantizer: Quantizer, direction: str) -> tuple[int, ...]:
    """The `jax.random.fold_in` indices that take the caller's key to `direction`'s
    stochastic-rounding key."""
    return (0,) if direction == "rowwise" else (1,)

  def needs_key(self, quantizer: Quantizer) -> bool:
    """Whether quantizing needs a PRNG key (stochastic rounding)."""
    return False

  def stateful(self, quantizer: Quantizer) -> bool:
    """Whether the quantizer keeps state between steps (`jaxquant.init_state`)."""
    return bool(quantizer.stateful)

  def init_state(self, quantizer: Quantizer) -> Any:
    """Fresh state (None when stateless)."""
    return None

  def update_state(self, quantizer: Quantizer, state: Any, amax: Any) -> Any:
    """State after quantizing a tensor whose amax was `amax` (unchanged when stateless)."""
    return state

  def needs_current_amax(self, quantizer: Quantizer) -> bool:
    """Whether a stateful quantize needs the tensor's amax before its scale is known."""
    return False

  def state_update_kernel(self, quantizer: Quantizer) -> Optional[str]:
    """The FFI kernel that runs `update_state` ("delayed-update"), or None (the update above
    runs as XLA operations)."""
    return None

  # -------------------------------------------- kernels ---------------------------------------

  def quantize_kernel(self, quantizer: Quantizer) -> Optional[str]:
    """The FFI quantize family that serves it ("fp8-current", "fp8-delayed", "mxfp8",
    "fp8-block", "nvfp4"), or None (the reference quantizes it)."""
    raise self._undefined("quantize_kernel")

  def fused_producer_kernel(self, quantizer: Quantizer) -> Optional[str]:
    """The quantize family the fused producer kernels (`ffi/fused`: a normalization or an
    activation that writes the quantized copies of its output) serve it with, or None. They
    reuse the tile kernels of `FUSED_PRODUCER_FAMILIES`; a quantizer with a format per direction
    (a Hybrid) or without storage has none."""
    if self.halves(quantizer) is not None or self.high_precision:
      return None
    family = self.quantize_kernel(quantizer)
    return family if family in FUSED_PRODUCER_FAMILIES else None

  def xla_fused(self, quantizer: Quantizer) -> bool:
    """Whether the XLA-fused quantize (`jaxquant.backends.xla`) serves it."""
    return False

  def gemm_family(self, quantizer: Quantizer) -> str:
    """How the FFI GEMM multiplies its storage: "fp8", "fp8-block", "mxfp8", "nvfp4" or "hp"."""
    raise self._undefined("gemm_family")

  def grouped_quantize_kernel(self, quantizer: Quantizer,
                              direction: str) -> tuple[Optional[str], Optional[str]]:
    """(route, reason) of a grouped quantize of `direction`: "fp8" (the grouped FP8 kernel),
    "nvfp4" (the grouped NVFP4 kernel) or "single" (the single-tensor kernel on the padded
    layout plus the grouped amax); (None, why) when no kernel route serves it."""
    raise self._undefined("grouped_quantize_kernel")

  def expert_rows_multiple(self, quantizer: Quantizer, direction: str) -> Optional[int]:
    """For the "single" route of expert weights `[G, rows, cols]` (one single-tensor launch on
    `[G * rows, cols]`): what `rows` must be a multiple of so no block spans two experts; None
    when that launch cannot give every expert its own result."""
    return None

  def grouped_gemm_scaling(self, quantizer: Quantizer) -> Optional[int]:
    """The grouped GEMM kernels' scaling code (0 per-tensor FP8, 1 MXFP8, 2 / 3 NVFP4 1x16 /
    16x16, 4 / 5 Float8Block 1x128 / 128x128 with power-of-two scales), or None."""
    raise self._undefined("grouped_gemm_scaling")

  def grouped_gemm_operand(self, quantizer: Quantizer) -> str:
    """How the grouped GEMM's rejection names an operand of this format."""
    return type(quantizer).__name__


def no_grouped_kernel(quantizer: Quantizer) -> tuple[None, str]:
  """The (route, reason) of a format no grouped quantize kernel serves."""
  return None, f"no grouped quantize kernel for {type(quantizer).__name__}"


_REGISTRY: dict[type, Format] = {}


def register(quantizer_type: type, fmt: Format, *, storage: bool = True) -> None:
  """Make `fmt` the format of `quantizer_type` (and `ScaledTensor.dequantize` use it, unless
  the format has no storage of its own: `storage=False`, a Hybrid)."""
  _REGISTRY[quantizer_type] = fmt
  if storage:
    register_decoder(quantizer_type, dequantize_scaled)


def unregister(quantizer_type: type) -> None:
  """Remove a registration (tests register toy formats and remove them again)."""
  _REGISTRY.pop(quantizer_type, None)
  register_decoder(quantizer_type, None)


def registered() -> dict[type, Format]:
  """The registered formats by quantizer class (a copy)."""
  return dict(_REGISTRY)


def format_of(quantizer: Quantizer) -> Format:
  try:
    return _REGISTRY[type(quantizer)]
  except KeyError:
    raise TypeError(f"quantizer: no format is registered for {type(quantizer).__name__}; "
                    f"expected one of {sorted(t.__name__ for t in _REGISTRY)}") from None


def dequantize_scaled(t: ScaledTensor) -> jax.Array:
  """Float32 values of a ScaledTensor: raw blocks times the GEMM factor, RHT undone."""
  fmt = format_of(t.quantizer)
  values = fmt.dequantize_raw(t)
  factor = fmt.gemm_factor(t)
  if factor is not None:
    values = values * (factor[..., None] if factor.ndim else factor)
  if t.rht:
    values = rht16_inverse(values)
  return values


def pad_to_blocks(mat: jax.Array, block_rows: int, block_cols: int) -> jax.Array:
  """Zero-pad a `[rows, cols]` matrix up to whole blocks (zeros never change a block's amax)."""
  rows, cols = mat.shape[-2:]
  pad_rows = -rows % block_rows
  pad_cols = -cols % block_cols
  if pad_rows == 0 and pad_cols == 0:
    return mat
  return jnp.pad(mat, [(0, 0)] * (mat.ndim - 2) + [(0, pad_rows), (0, pad_cols)])


def block_view(mat: jax.Array, block_rows: int, block_cols: int) -> jax.Array:
  """`[R, C]` (already padded) -> `[R/br, br, C/bc, bc]`."""
  rows, cols = mat.shape
  return mat.reshape(rows // block_rows, block_rows, cols // block_cols, block_cols)


def abs_max(x: jax.Array, axis=None) -> jax.Array:
  """Max |x| over `axis` as float32, NaN-propagating on every backend.

  Taken over the bits of |x|: for non-negative floats the uint32 order is the float order and
  every NaN sorts above +inf. (A float `jnp.max` is not enough: XLA:CPU's YNN reduction fusion,
  on by default in jax 0.10.2, drops NaNs from float max reductions and can even return -inf.)
  """
  bits = jax.lax.bitcast_convert_type(jnp.abs(x.astype(jnp.float32)), jnp.uint32)
  return jax.lax.bitcast_convert_type(jnp.max(bits, axis=axis), jnp.float32)


def block_amax(mat: jax.Array, block_rows: int, block_cols: int) -> jax.Array:
  """Max |x| per block of a padded matrix: `[R/br, C/bc]` float32, NaN-propagating."""
  return abs_max(block_view(mat, block_rows, block_cols), axis=(1, 3))


def expand_blocks(per_block: jax.Array, block_rows: int, block_cols: int) -> jax.Array:
  """Broadcast a `[R/br, C/bc]` array to the padded `[R, C]` element grid."""
  return jnp.repeat(jnp.repeat(per_block, block_rows, axis=0), block_cols, axis=1)


def tensor_amax(mat: jax.Array) -> jax.Array:
  return abs_max(mat)
