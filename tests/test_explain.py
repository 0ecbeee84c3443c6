"""`jaxquant.explain`: every quantize / GEMM decision is reported with the path taken and, when
the slower reference path serves an op, the reason (no silent fallback)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

import jaxquant as jq
from jaxquant.ops import dispatch

ROLE = jq.QuantizerRole("linear", "input", "fc1")


def _forward(x, w):
  qx = jq.ops.quantize(x, jq.MXFP8Quantizer(), columnwise=False, role=ROLE)
  qw = jq.ops.quantize(w, jq.NVFP4Quantizer(block_2d=True), columnwise=False)
  return jq.ops.gemm(qx.rowwise, qw.rowwise, role=ROLE)


ARGS = (jax.ShapeDtypeStruct((16, 64), jnp.bfloat16), jax.ShapeDtypeStruct((32, 64), jnp.bfloat16))


def test_explain_reports_the_reference_path_and_why_when_it_is_forced(monkeypatch):
  monkeypatch.setenv("JAXQUANT_BACKEND", "reference")
  report = jq.explain(_forward, *ARGS)
  assert [d.op for d in report] == ["quantize", "quantize", "gemm"]
  assert report.paths() == {"reference"}
  assert all(d.reason == "JAXQUANT_BACKEND=reference" for d in report)
  assert report[0].role == ROLE and "MXFP8Quantizer" in report[0].detail
  assert "rowwise" in report[0].detail and "NVFP4Quantizer" in report[1].detail
  assert report[2].detail == "MXFP8 x NVFP4"
  text = str(report)
  assert "reference" in text and "JAXQUANT_BACKEND=reference" in text and str(ROLE) in text


def test_explain_gives_a_reason_whenever_the_reference_path_serves_without_being_forced(
    monkeypatch):
  monkeypatch.delenv("JAXQUANT_BACKEND", raising=False)
  report = jq.explain(_forward, *ARGS)
  assert len(report) == 3
  for decision in report:
    assert decision.path  # e.g. "reference", "ffi-cpu", a kernel name
    if decision.path == "reference":
      assert decision.reason, decision


def test_explain_says_the_extension_is_not_built_when_it_is_not(monkeypatch):
  monkeypatch.delenv("JAXQUANT_BACKEND", raising=False)
  monkeypatch.setattr(dispatch, "ffi_module", lambda: None)
  report = jq.explain(_forward, *ARGS)
  assert report.paths() == {"reference"}
  assert all(d.reason == "jaxquant FFI extension not built" for d in report)


def test_identity_quantize_is_reported_without_a_fallback_reason(monkeypatch):
  monkeypatch.delenv("JAXQUANT_BACKEND", raising=False)
  report = jq.explain(lambda x: jq.ops.quantize(x, jq.IdentityQuantizer()), ARGS[0])
  assert [(d.op, d.path, d.reason) for d in report] == [("quantize", "reference", "")]


def test_explain_traces_abstractly_and_retraces_jitted_functions(monkeypatch):
  monkeypatch.setenv("JAXQUANT_BACKEND", "reference")
  jitted = jax.jit(_forward)
  jitted(jnp.ones((16, 64), jnp.bfloat16), jnp.ones((32, 64), jnp.bfloat16))  # traced, cached
  first = jq.explain(jitted, *ARGS)
  second = jq.explain(jitted, *ARGS)
  assert len(first) == len(second) == 3


def test_explain_recording_collects_decisions_around_any_code(monkeypatch):
  monkeypatch.setenv("JAXQUANT_BACKEND", "reference")
  quantize = jax.jit(lambda x: jq.ops.quantize(x, jq.Float8CurrentScalingQuantizer(),
                                                columnwise=False))
  with jq.explain_recording() as report:
    quantize(jnp.ones((4, 32)))
  assert len(report) == 1 and report[0].op == "quantize"
  assert str(jq.Report()) == "(no quantized ops traced)"
