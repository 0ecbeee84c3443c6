"""Bad input: every validation error is raised with a message naming the offending argument."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxquant as jq
from jaxquant.numerics.random_bits import key_words
from helpers import quantize
from jaxquant.ops import dispatch

pytestmark = pytest.mark.usefixtures("core_backend")

X = jnp.ones((32, 48), jnp.float32)


# ------------------------------------------------------------------------------------------------
# Quantizer options (ValueError at construction, naming the option)

BAD_QUANTIZERS = [
    (lambda: jq.Float8CurrentScalingQuantizer(jnp.bfloat16),
     r"Float8CurrentScalingQuantizer: dtype=.*bfloat16.*not a supported float8"),
    (lambda: jq.Float8CurrentScalingQuantizer(object()), r"Float8CurrentScalingQuantizer: dtype="),
    (lambda: jq.Float8CurrentScalingQuantizer(amax_epsilon=-1.0), r"amax_epsilon=-1.0"),
    (lambda: jq.Float8CurrentScalingQuantizer(amax_epsilon=float("nan")), r"amax_epsilon=nan"),
    (lambda: jq.Float8CurrentScalingQuantizer(amax_epsilon=float("inf")), r"amax_epsilon=inf"),
    (lambda: jq.Float8CurrentScalingQuantizer(amax_epsilon="0.1"), r"amax_epsilon='0.1'"),
    (lambda: jq.Float8DelayedScalingQuantizer(jnp.float16),
     r"Float8DelayedScalingQuantizer: dtype"),
    (lambda: jq.Float8DelayedScalingQuantizer(amax_history_len=0), r"amax_history_len=0"),
    (lambda: jq.Float8DelayedScalingQuantizer(amax_history_len=8.0), r"amax_history_len=8.0"),
    (lambda: jq.Float8DelayedScalingQuantizer(amax_compute_algo="mean"),
     r"amax_compute_algo='mean'; expected 'max' or 'most_recent'"),
    (lambda: jq.Float8DelayedScalingQuantizer(margin=-1), r"margin=-1"),
    (lambda: jq.Float8DelayedScalingQuantizer(margin=0.5), r"margin=0.5"),
    (lambda: jq.MXFP8Quantizer(jnp.float4_e2m1fn), r"MXFP8Quantizer: dtype=.*float4"),
    (lambda: jq.NVFP4Quantizer(row_scaled=1), r"row_scaled=1 must be a bool"),
    (lambda: jq.NVFP4Quantizer(block_2d="yes"), r"block_2d='yes' must be a bool"),
    (lambda: jq.NVFP4Quantizer(rht=None), r"rht=None must be a bool"),
    (lambda: jq.NVFP4Quantizer(stochastic_rounding=0), r"stochastic_rounding=0 must be a bool"),
    (lambda: jq.NVFP4Quantizer(row_scaled=True, block_2d=True),
     r"row_scaled=True cannot be combined with block_2d=True"),
    (lambda: jq.NVFP4Quantizer(rht=True, block_2d=True),
     r"rht=True cannot be combined with block_2d=True"),
    (lambda: jq.Float8BlockQuantizer((1, 64)), r"block=\(1, 64\); expected \(1, 128\) or"),
    (lambda: jq.Float8BlockQuantizer((128, 1)), r"block=\(128, 1\)"),
    (lambda: jq.Float8BlockQuantizer(dtype=jnp.float32), r"Float8BlockQuantizer: dtype="),
    (lambda: jq.Float8BlockQuantizer(amax_epsilon=-0.5), r"amax_epsilon=-0.5"),
    (lambda: jq.IdentityQuantizer(jnp.float8_e4m3fn), r"IdentityQuantizer: dtype="),
    (lambda: jq.IdentityQuantizer(jnp.int32), r"IdentityQuantizer: dtype="),
    (lambda: jq.HybridQuantizer(rowwise=jq.HybridQuantizer()),
     r"rowwise is a HybridQuantizer; hybrids cannot nest"),
    (lambda: jq.HybridQuantizer(columnwise=jq.HybridQuantizer()),
     r"columnwise is a HybridQuantizer; hybrids cannot nest"),
    (lambda: jq.HybridQuantizer(rowwise="mxfp8"), r"rowwise='mxfp8' is not a jaxquant Quantizer"),
    (lambda: jq.HybridQuantizer(columnwise=3), r"columnwise=3 is not a jaxquant Quantizer"),
    (lambda: jq.HybridQuantizer(columnwise_source="dequantized"),
     r"columnwise_source='dequantized'; expected 'original' or 'rowwise_dequantized'"),
]


@pytest.mark.parametrize("make,match", BAD_QUANTIZERS, ids=range(len(BAD_QUANTIZERS)))
def test_invalid_quantizer_option_raises_value_error_naming_it(make, match):
  with pytest.raises(ValueError, match=match):
    make()


def test_valid_quantizers_are_frozen_and_hashable():
  q = jq.NVFP4Quantizer(rht=True)
  assert hash(q) == hash(jq.NVFP4Quantizer(rht=True))
  with pytest.raises(dataclasses.FrozenInstanceError):
    q.rht = False


def test_for_direction_rejects_unknown_direction():
  with pytest.raises(ValueError, match=r"direction='both'; expected 'rowwise' or 'columnwise'"):
    jq.MXFP8Quantizer().for_direction("both")


# ------------------------------------------------------------------------------------------------
# ops.quantize / dequantize / transpose


def test_quantize_rejects_a_non_quantizer():
  with pytest.raises(TypeError, match="quantizer: expected a jaxquant Quantizer, got str"):
    jq.ops.quantize(X, "mxfp8")


def test_quantize_rejects_no_direction():
  with pytest.raises(ValueError, match="rowwise and columnwise are both False"):
    jq.ops.quantize(X, jq.MXFP8Quantizer(), rowwise=False, columnwise=False)


@pytest.mark.parametrize("dtype", [jnp.int32, jnp.float8_e4m3fn], ids=["int32", "fp8"])
def test_quantize_rejects_non_float_input_dtype(dtype):
  with pytest.raises(TypeError, match=f"x: dtype {np.dtype(dtype).name} cannot be quantized"):
    jq.ops.quantize(X.astype(dtype), jq.MXFP8Quantizer())


def test_quantize_rejects_a_non_array_and_a_scalar():
  with pytest.raises(TypeError, match="x: expected a jax array, got list"):
    jq.ops.quantize([1.0, 2.0], jq.MXFP8Quantizer())
  with pytest.raises(ValueError, match="x: a scalar cannot be quantized"):
    jq.ops.quantize(jnp.float32(1.0), jq.MXFP8Quantizer())


@pytest.mark.parametrize("q", [
    jq.NVFP4Quantizer(stochastic_rounding=True),
    jq.HybridQuantizer(jq.MXFP8Quantizer(), jq.NVFP4Quantizer(stochastic_rounding=True)),
], ids=["nvfp4", "hybrid"])
def test_stochastic_rounding_without_key_raises(q):
  with pytest.raises(ValueError, match="key: .*stochastic rounding and needs a PRNG key"):
    jq.ops.quantize(X, q)


@pytest.mark.parametrize("q", [
    jq.Float8DelayedScalingQuantizer(),
    jq.HybridQuantizer(jq.Float8DelayedScalingQuantizer(), jq.MXFP8Quantizer()),
], ids=["delayed", "hybrid"])
def test_stateful_quantizer_without_state_raises(q):
  with pytest.raises(ValueError, match=r"state: .* is stateful; pass state=jaxquant.init_state"):
    jq.ops.quantize(X, q)


def test_delayed_scaling_with_a_foreign_state_raises():
  with pytest.raises(ValueError, match="state: Float8DelayedScalingQuantizer needs its "
                     "DelayedScalingState.*got dict"):
    jq.ops.quantize(X, jq.Float8DelayedScalingQuantizer(), state={"scale": 1.0})


@pytest.mark.parametrize("q", [
    jq.NVFP4Quantizer(rht=True),
    jq.HybridQuantizer(jq.MXFP8Quantizer(), jq.NVFP4Quantizer(rht=True)),
], ids=["nvfp4", "hybrid"])
def test_rht_columnwise_needs_rows_multiple_of_16(q):
  x = jax.ShapeDtypeStruct((17, 32), jnp.float32)  # traced abstractly: nothing is computed
  with pytest.raises(ValueError, match=r"x: NVFP4Quantizer\(rht=True\) .* got 17 rows"):
    jax.eval_shape(lambda x: jq.ops.quantize(x, q), x)


def test_rht_row_count_is_not_checked_when_only_rowwise_is_asked():
  qt = quantize(jnp.ones((17, 32)), jq.NVFP4Quantizer(rht=True), columnwise=False)
  assert qt.rowwise.shape == (17, 32) and not qt.rowwise.rht


def test_quantizer_without_a_registered_format_raises(monkeypatch):
  monkeypatch.setenv("JAXQUANT_BACKEND", "reference")  # the reference's format registry

  @dataclasses.dataclass(frozen=True)
  class Int4Quantizer(jq.Quantizer):
    pass

  with pytest.raises(TypeError, match="quantizer: no format is registered for Int4Quantizer"):
    jq.ops.quantize(X, Int4Quantizer())


def test_dequantize_rejects_a_plain_array_and_an_empty_quantized_tensor():
  with pytest.raises(TypeError, match="t: expected a QuantizedTensor or ScaledTensor, got"):
    jq.ops.dequantize(X)
  with pytest.raises(ValueError, match="neither a rowwise nor a columnwise copy"):
    jq.QuantizedTensor(None, None, jq.MXFP8Quantizer()).dequantize()


def test_transpose_rejects_block_scaled_data_and_non_scaled_tensors():
  qt = quantize(X, jq.MXFP8Quantizer(), columnwise=False)
  with pytest.raises(ValueError, match="t: transpose needs per-tensor FP8 data"):
    jq.ops.transpose(qt.rowwise)
  with pytest.raises(TypeError, match="t: expected a ScaledTensor, got QuantizedTensor"):
    jq.ops.transpose(qt)


def test_key_words_rejects_a_non_key_array():
  with pytest.raises(ValueError, match=r"key: expected a JAX PRNG key, got an array of shape"):
    key_words(jnp.array([1], jnp.uint32))


def test_delayed_scaling_update_rejects_another_quantizer():
  state = jq.init_state(jq.Float8DelayedScalingQuantizer(amax_history_len=2))
  with pytest.raises(TypeError, match="quantizer: expected Float8DelayedScalingQuantizer"):
    jq.delayed_scaling_update(state, jnp.float32(1.0), jq.MXFP8Quantizer())


# ------------------------------------------------------------------------------------------------
# ops.gemm


@pytest.fixture(scope="module")
def operands():
  a = quantize(jnp.ones((32, 48)), jq.NVFP4Quantizer(rht=True))
  b = quantize(jnp.ones((8, 48)), jq.MXFP8Quantizer(), columnwise=False)
  return a, b


def test_gemm_rejects_a_quantized_tensor_pair(operands):
  a, b = operands
  with pytest.raises(TypeError, match=r"a: pass one direction of the QuantizedTensor"):
    jq.ops.gemm(a, b.rowwise)
  with pytest.raises(TypeError, match=r"b: pass one direction of the QuantizedTensor"):
    jq.ops.gemm(b.rowwise, a)


def test_gemm_rejects_integer_arrays(operands):
  _, b = operands
  with pytest.raises(TypeError, match="b: expected a ScaledTensor or a bfloat16/float16/float32"):
    jq.ops.gemm(b.rowwise, jnp.ones((4, 48), jnp.int32))


def test_gemm_rejects_operands_that_are_not_2d(operands):
  _, b = operands
  with pytest.raises(ValueError, match=r"a: expected a 2-D \[rows, contraction\] operand, got "
                     r"shape \(2, 4, 48\)"):
    jq.ops.gemm(jnp.ones((2, 4, 48)), b.rowwise)


def test_gemm_rejects_different_contraction_lengths(operands):
  a, b = operands
  with pytest.raises(ValueError, match=r"a and b: contraction lengths differ \(32 vs 48\)"):
    jq.ops.gemm(a.columnwise, b.rowwise)


def test_gemm_rejects_an_rht_mismatch(operands):
  a, _ = operands
  plain = quantize(jnp.ones((32, 16)), jq.NVFP4Quantizer(), rowwise=False).columnwise
  with pytest.raises(ValueError, match=r"a and b disagree on the random Hadamard transform "
                     r"\(a.rht=True, b.rht=False\)"):
    jq.ops.gemm(a.columnwise, plain)
  with pytest.raises(ValueError, match=r"\(a.rht=False, b.rht=True\)"):
    jq.ops.gemm(jnp.ones((4, 32)), a.columnwise)


def test_gemm_rejects_a_bias_of_the_wrong_shape(operands):
  _, b = operands
  with pytest.raises(ValueError, match=r"bias: expected shape \(8,\), got \(4,\)"):
    jq.ops.gemm(jnp.ones((2, 48)), b.rowwise, bias=jnp.ones((4,)))


# ------------------------------------------------------------------------------------------------
# Backend selection


def test_unknown_backend_name_raises(monkeypatch):
  monkeypatch.setenv("JAXQUANT_BACKEND", "cuda")
  with pytest.raises(ValueError, match=r"JAXQUANT_BACKEND='cuda'; expected one of"):
    jq.ops.quantize(X, jq.MXFP8Quantizer())


def test_forcing_ffi_where_it_cannot_serve_is_an_error_not_a_fallback(monkeypatch):
  monkeypatch.setenv("JAXQUANT_BACKEND", "ffi")
  monkeypatch.setattr(dispatch, "ffi_module", lambda: None)  # as if the extension were not built
  with pytest.raises(RuntimeError, match="JAXQUANT_BACKEND=ffi, but the FFI path cannot serve "
                     "this quantize: jaxquant FFI extension not built"):
    jq.ops.quantize(X, jq.MXFP8Quantizer())
  with pytest.raises(RuntimeError, match="cannot serve this gemm"):
    jq.ops.gemm(X, X)
