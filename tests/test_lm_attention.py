"""`examples/lm`'s attention core: the jnp form ("xla") and cuDNN's fused kernel ("cudnn")
against float64 causal softmax attention, and the errors for choices that cannot run."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lm.model import GPT, LMConfig, attention_core  # examples/lm (pytest pythonpath)

# bf16 inputs and output: one rounding of the output (2^-9 relative) plus the weights' bf16
# rounding before the weighted sum (flash attention and the jnp form both round them), for
# unit-normal values.
TOLERANCE = 2.0 ** -6

ON_GPU = jax.default_backend() == "gpu"
needs_gpu = pytest.mark.skipif(not ON_GPU, reason="cuDNN attention needs a GPU")


def _causal_attention_f64(q, k, v):
  q, k, v = (np.asarray(t, np.float64) for t in (q, k, v))
  seq, head_dim = q.shape[1], q.shape[-1]
  logits = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(head_dim)
  logits = np.where(np.tril(np.ones((seq, seq), bool)), logits, -np.inf)
  weights = np.exp(logits - logits.max(-1, keepdims=True))
  weights /= weights.sum(-1, keepdims=True)
  return np.einsum("bhqk,bkhd->bqhd", weights, v)


def _qkv(rng, shape):
  return [jnp.asarray(rng.standard_normal(shape), jnp.bfloat16) for _ in range(3)]


def test_unknown_attention_is_refused_with_the_choices():
  with pytest.raises(ValueError, match=r"attention='flash'.*'xla', 'cudnn'"):
    LMConfig(attention="flash")


def test_xla_attention_is_causal_softmax_attention(rng):
  q, k, v = _qkv(rng, (2, 48, 3, 16))
  out = attention_core(q, k, v, "xla")
  assert out.dtype == jnp.bfloat16 and out.shape == q.shape
  np.testing.assert_allclose(np.asarray(out, np.float64), _causal_attention_f64(q, k, v),
                             atol=TOLERANCE, rtol=0)


@pytest.mark.skipif(ON_GPU, reason="the error is for non-GPU backends")
def test_cudnn_attention_off_gpu_is_refused_naming_the_alternative(rng):
  q, k, v = _qkv(rng, (1, 8, 2, 8))
  with pytest.raises(ValueError, match="attention='cudnn' runs on GPUs only.*attention='xla'"):
    attention_core(q, k, v, "cudnn")


@pytest.mark.gpu
@needs_gpu
def test_cudnn_attention_is_causal_softmax_attention_and_its_gradient_matches_xlas(rng):
  q, k, v = _qkv(rng, (2, 256, 4, 64))
  out = jax.jit(attention_core, static_argnums=3)(q, k, v, "cudnn")
  np.testing.assert_allclose(np.asarray(out, np.float64), _causal_attention_f64(q, k, v),
                             atol=TOLERANCE, rtol=0)
  cotangent = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)

  def grads(kind):
    loss = lambda q, k, v: jnp.sum(attention_core(q, k, v, kind).astype(jnp.float32) * cotangent)
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)

  for ours, theirs in zip(grads("cudnn"), grads("xla")):
    scale = float(jnp.max(jnp.abs(theirs.astype(jnp.float32))))
    np.testing.assert_allclose(np.asarray(ours, np.float32), np.asarray(theirs, np.float32),
                               atol=4 * TOLERANCE * scale, rtol=0)


@pytest.mark.gpu
@needs_gpu
def test_gpt_with_cudnn_attention_has_the_xla_models_parameters_and_loss(rng):
  tokens = jnp.asarray(rng.integers(0, 256, (2, 128)), jnp.int32)
  configs = {kind: LMConfig(seq=128, d_model=128, heads=2, attention=kind)
             for kind in ("xla", "cudnn")}
  variables = GPT(configs["xla"]).init(jax.random.PRNGKey(int(rng.integers(1 << 30))), tokens)
  logits = {kind: jax.jit(GPT(cfg).apply)(variables, tokens) for kind, cfg in configs.items()}
  assert logits["cudnn"].shape == logits["xla"].shape
  # one block's bf16 attention differences carried through the rest of the model
  np.testing.assert_allclose(np.asarray(logits["cudnn"]), np.asarray(logits["xla"]),
                             atol=0.05 * float(jnp.max(jnp.abs(logits["xla"]))), rtol=0)
