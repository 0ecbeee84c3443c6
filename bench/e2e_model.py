"""The models of `bench/e2e.py`: a decoder-only transformer LM of the lm1b kind.

`StandardLM` is built from the Flax blocks users already have: `nn.Embed`, `nn.LayerNorm`,
`nn.MultiHeadDotProductAttention` (causal) and an `nn.Dense` MLP (`fc1`, gelu, `fc2`), a final
`nn.LayerNorm` and an `nn.Dense` `lm_head`. `fp8_cls` puts one of Flax's FP8 dot-general
modules (`fp8_ops.Fp8DirectDotGeneralOp`, `Fp8DotGeneralOp`) into every `nn.Dense`, and into the
attention projections when `fp8_attention` is set; jaxquant instead swaps the layers from the
outside with `jaxquant.flax.quantize_dense`.

`ModulesLM` is the same network written with jaxquant's modules: `jaxquant.flax.Embed` (the
same lookup, its table gradient summed in float32), a `LayerNormDense` for the norm + `qkv`
projection, `jaxquant.flax.DenseGeneral` for the attention
output, a `LayerNormMLP` for norm + MLP and a `LayerNormDense` `lm_head`; the recipe comes from
`jaxquant.autocast`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

import jaxquant.flax as jqf

try:  # examples/ must be on the path: PYTHONPATH=examples (bench/run.py sets it)
  from lm import data  # examples/lm/data.py: the stdlib byte corpus
  from lm.model import attention_core  # examples/lm/model.py: "xla" or cuDNN's fused kernel
except ModuleNotFoundError as err:
  if err.name not in ("lm", "train_lm", "nnx_quantize"):
    raise
  raise SystemExit(f"bench/e2e.py imports examples/ ({err}): run it as "
                   "PYTHONPATH=examples python bench/e2e.py") from err


@dataclasses.dataclass(frozen=True)
class Config:
  vocab: int
  d_model: int
  layers: int
  heads: int
  mlp: int
  seq: int
  batch: int
  dtype: Any = jnp.bfloat16
  # The softmax core of attention: "xla" (Flax's `dot_product_attention`, the [seq, seq] scores
  # written out) or "cudnn" (cuDNN's fused kernel, as TransformerEngine's users run theirs).
  attention: str = "xla"
  # The token and position embeddings: "flax" (`nn.Embed`, its table gradient a bfloat16
  # scatter-add) or "jaxquant" (`jaxquant.flax.Embed`, the same lookup with the gradient summed
  # in float32); None: the model's own (StandardLM "flax", ModulesLM "jaxquant").
  embed: Optional[str] = None

  @property
  def tokens(self) -> int:
    return self.batch * self.seq

  def params_count(self) -> int:
    d = self.d_model
    return self.layers * (4 * d * d + 2 * d * self.mlp) + 2 * self.vocab * d + self.seq * d

  def matmul_flops(self) -> int:
    """FLOPs of one training step's projections and lm_head (fwd + dgrad + wgrad), and of the
    attention score/value products (fwd + two backward products, causal mask not exploited)."""
    d, t = self.d_model, self.tokens
    proj = self.layers * (4 * d * d + 2 * d * self.mlp) + self.vocab * d
    attention = self.layers * 2 * 2 * self.batch * self.seq * self.seq * d
    return 3 * (2 * t * proj + attention)


SIZES = {
    "tiny": Config(vocab=512, d_model=64, layers=2, heads=4, mlp=256, seq=32, batch=4),
    "d2048": Config(vocab=32000, d_model=2048, layers=4, heads=16, mlp=8192, seq=1024, batch=16),
    "d4096": Config(vocab=32000, d_model=4096, layers=8, heads=32, mlp=16384, seq=1024, batch=8),
}


EMBEDS = {"flax": nn.Embed, "jaxquant": jqf.Embed}


def embeddings(cfg: Config, default: str, tokens: jax.Array) -> jax.Array:
  """The token embedding plus the learned position embedding, with `cfg.embed`'s module."""
  embed = EMBEDS[cfg.embed or default]
  x = embed(cfg.vocab, cfg.d_model, dtype=cfg.dtype, name="embed")(tokens)
  return x + embed(cfg.seq, cfg.d_model, dtype=cfg.dtype, name="pos")(
      jnp.arange(tokens.shape[1])[None])


class MLP(nn.Module):
  config: Config
  fp8_cls: Optional[type] = None

  @nn.compact
  def __call__(self, x):
    cfg = self.config
    h = nn.Dense(cfg.mlp, dtype=cfg.dtype, dot_general_cls=self.fp8_cls, name="fc1")(x)
    h = nn.gelu(h)
    return nn.Dense(cfg.d_model, dtype=cfg.dtype, dot_general_cls=self.fp8_cls, name="fc2")(h)


def _cudnn_attention_fn(query, key, value, *args, **kwargs):
  """`nn.MultiHeadDotProductAttention`'s `attention_fn` on cuDNN's causal kernel (the causal
  mask it is also given is the same mask)."""
  del args, kwargs
  return attention_core(query, key, value, "cudnn")


class Block(nn.Module):
  config: Config
  fp8_cls: Optional[type] = None
  fp8_attention: bool = False

  @nn.compact
  def __call__(self, x, mask):
    cfg = self.config
    attn_cls = self.fp8_cls if self.fp8_attention else None
    core = {"attention_fn": _cudnn_attention_fn} if cfg.attention == "cudnn" else {}
    h = nn.LayerNorm(dtype=cfg.dtype, name="ln1")(x)
    h = nn.MultiHeadDotProductAttention(num_heads=cfg.heads, dtype=cfg.dtype, deterministic=True,
                                        qkv_dot_general_cls=attn_cls,
                                        out_dot_general_cls=attn_cls, name="attn",
                                        **core)(h, mask=mask)
    x = x + h
    h = nn.LayerNorm(dtype=cfg.dtype, name="ln2")(x)
    return x + MLP(cfg, self.fp8_cls, name="mlp")(h)


class StandardLM(nn.Module):
  """Token + learned position embedding, pre-norm blocks, final norm, `lm_head` logits."""

  config: Config
  fp8_cls: Optional[type] = None
  fp8_attention: bool = False

  @nn.compact
  def __call__(self, tokens):
    cfg = self.config
    x = embeddings(cfg, "flax", tokens)
    mask = nn.make_causal_mask(tokens)
    for i in range(cfg.layers):
      x = Block(cfg, self.fp8_cls, self.fp8_attention, name=f"block_{i}")(x, mask)
    x = nn.LayerNorm(dtype=cfg.dtype, name="ln_f")(x)
    return nn.Dense(cfg.vocab, dtype=cfg.dtype, dot_general_cls=self.fp8_cls, name="lm_head")(x)


class ModulesBlock(nn.Module):
  config: Config

  @nn.compact
  def __call__(self, x, mask):
    cfg = self.config
    head_dim = cfg.d_model // cfg.heads
    # q, k and v returned apart (`split_output`): their gradients reach the projection's
    # backward where the attention wrote them, quantized there without a joining copy.
    q, k, v = jqf.LayerNormDense((3, cfg.heads, head_dim), dtype=cfg.dtype, split_output=True,
                                 name="qkv")(x)
    if cfg.attention == "cudnn":
      h = attention_core(q, k, v, "cudnn")
    else:
      h = nn.dot_product_attention(q, k, v, mask=mask, dtype=cfg.dtype)
    x = x + jqf.DenseGeneral(cfg.d_model, axis=(-2, -1), dtype=cfg.dtype, name="out")(h)
    return x + jqf.LayerNormMLP(cfg.mlp, activations="gelu", dtype=cfg.dtype, name="mlp")(x)


class ModulesLM(nn.Module):
  """`StandardLM`'s network with jaxquant's `LayerNormDense` / `LayerNormMLP` blocks."""

  config: Config

  @nn.compact
  def __call__(self, tokens):
    cfg = self.config
    x = embeddings(cfg, "jaxquant", tokens)
    mask = nn.make_causal_mask(tokens)
    for i in range(cfg.layers):
      x = ModulesBlock(cfg, name=f"block_{i}")(x, mask)
    return jqf.LayerNormDense(cfg.vocab, dtype=cfg.dtype, name="lm_head")(x)


def markov_batches(cfg: Config, steps: int, seed: int = 0, successors: int = 4) -> jax.Array:
  """Tokens of a random sparse Markov chain over the whole vocabulary (each token has
  `successors` equally likely successors). Every id is used, but 100 steps learn little of it,
  so losses differ by training noise more than by precision."""
  rng = np.random.default_rng(seed)
  table = rng.integers(0, cfg.vocab, (cfg.vocab, successors))
  chains = steps * cfg.batch
  out = np.empty((chains, cfg.seq + 1), np.int32)
  out[:, 0] = rng.integers(0, cfg.vocab, chains)
  picks = rng.integers(0, successors, (chains, cfg.seq))
  for t in range(cfg.seq):
    out[:, t + 1] = table[out[:, t], picks[:, t]]
  return jnp.asarray(out.reshape(steps, cfg.batch, cfg.seq + 1))


def text_batches(cfg: Config, steps: int, seed: int = 0, pairs: bool = True) -> jax.Array:
  """Tokens of the Python standard library's source (`examples/lm/data.py`, present on every
  machine) at random offsets: real text whose loss falls steadily over the first hundred steps.

  `pairs`: token i is the byte pair (b_i, b_i+1) folded into the vocabulary
  (`(256 * b_i + b_i+1) % vocab`), about 1200 distinct ids in a d2048 batch, like a small BPE
  vocabulary. With `pairs=False` tokens are single bytes (about 100 distinct ids): the
  embedding gradient's scatter-add then piles 16k updates onto few rows, an atomic-contention
  kernel of 11-22 ms per step on an H100 that varies from step to step and blurs the
  differences between variants (bench/RESULTS.md); pairs spread the updates over more rows.
  """
  corpus = data.load_corpus(max_bytes=64 << 20)
  raw = data.random_batches(corpus.train, cfg.batch, cfg.seq + int(pairs), seed)
  tokens = np.stack([next(raw) for _ in range(steps)]).astype(np.int32)
  if pairs:
    tokens = (tokens[..., :-1] * 256 + tokens[..., 1:]) % cfg.vocab
  return jnp.asarray(tokens)


DATA = {
    "pairs": lambda cfg, steps, seed=0: text_batches(cfg, steps, seed, pairs=True),
    "bytes": lambda cfg, steps, seed=0: text_batches(cfg, steps, seed, pairs=False),
    "markov": markov_batches,
}
