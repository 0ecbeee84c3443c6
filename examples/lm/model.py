"""A small GPT-style decoder whose every projection is a `jaxquant.flax.Dense`.

Token embedding (`lm.embedding`: `nn.Embed` with a one-hot GEMM gradient), rotary (or learned)
positions, pre-norm blocks of causal multi-head attention (`qkv`, `proj`) and an MLP (`fc1`,
`fc2`), a final norm and an `lm_head` (a quantized Dense, or the transposed token embedding when
tied). The recipe is a module attribute handed down to every
Dense, so the module names above are the `QuantizerRole.name`s a factory dispatches on. With
`moe`, each MLP is a routed mixture of `GroupedDense` experts (`lm.moe`, roles
`("grouped_linear", ..., "fc1" | "fc2")`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

import jaxquant
import jaxquant.flax
from lm.embedding import EMBEDDING_GRADIENTS, TokenEmbed
from lm.moe import MoEMLP


# `LMConfig.attention`'s choices: the attention core written in jnp, or cuDNN's fused kernel.
ATTENTIONS = ("xla", "cudnn")


@dataclasses.dataclass(frozen=True)
class LMConfig:
  """Model hyperparameters.

  Attributes:
    vocab: vocabulary size (256 for byte-level tokens).
    seq: maximum sequence length (learned positions need it).
    d_model: residual width.
    layers: number of decoder blocks.
    heads: attention heads (`d_model` must divide into them).
    mlp_ratio: MLP hidden width as a multiple of `d_model`.
    positions: "rope" (rotary) or "learned".
    tie_embeddings: use the token embedding as the output projection instead of `lm_head`.
    dtype: compute dtype (parameters stay float32).
    moe: `(experts, top_k)` to replace every MLP by a routed mixture of experts
      (`lm.moe.MoEMLP`), or None for the dense MLP.
    moe_aux_weight: weight of the load-balancing loss added to the objective under `moe`.
    moe_capacity: under a mesh with `ep`, the all-to-all buffers' capacity factor (rows per
      device pair = factor x an even share of a device's assignments; the excess is dropped);
      None: dropless (buffers for every assignment).
    moe_exchange: under a mesh with `ep`, how rows reach their experts' devices: "auto"
      (fixed-size buffers: XLA's ragged all-to-all of the real rows measured slower on H100s),
      "ragged" or "fixed" (`jaxquant.expert_parallel.EXCHANGES`).
    remat: recompute each block's activations in the backward pass (`nn.remat`): the memory of
      one block instead of all of them, for large models (seq 2048 x d_model 4096). The
      quantized weights are kept (`jaxquant.remat_policy`), so the recomputed forward does
      not quantize them again.
    scan_layers: run the blocks as one `nn.scan` over stacked parameters (`blocks/...`, leading
      axis `layers`): compile time independent of depth. Same math, different parameter tree.
    embedding_gradient: how the token embedding's gradient is formed (`lm.embedding`):
      "auto" (a one-hot GEMM for vocabularies up to 4096, a float32 scatter-add above),
      "one-hot", "float32-scatter" or "scatter" (`nn.Embed`'s bfloat16 scatter-add). Same
      forward pass and parameters either way.
    attention: the attention core (scores, causal softmax, weighted sum): "xla" (written out
      in jnp: the [batch, heads, seq, seq] float32 scores are materialized, on any backend) or
      "cudnn" (`jax.nn.dot_product_attention(implementation="cudnn")`: cuDNN's fused flash
      attention, GPUs only, head size a multiple of 8 up to 128). Same parameters; the
      results agree within bf16 rounding, not bit for bit.
  """

  vocab: int = 256
  seq: int = 128
  d_model: int = 128
  layers: int = 2
  heads: int = 4
  mlp_ratio: int = 4
  positions: str = "rope"
  tie_embeddings: bool = False
  dtype: Any = jnp.bfloat16
  moe: Optional[tuple[int, int]] = None
  moe_aux_weight: float = 0.01
  moe_capacity: Optional[float] = None
  moe_exchange: str = "auto"
  remat: bool = False
  scan_layers: bool = False
  embedding_gradient: str = "auto"
  attention: str = "xla"

  def __post_init__(self):
    if self.attention not in ATTENTIONS:
      raise ValueError(f"attention={self.attention!r}; expected one of {ATTENTIONS}")
    if self.embedding_gradient not in EMBEDDING_GRADIENTS:
      raise ValueError(f"embedding_gradient={self.embedding_gradient!r}; expected one of "
                       f"{EMBEDDING_GRADIENTS}")
    if self.moe is not None and not 1 <= self.moe[1] <= self.moe[0]:
      raise ValueError(f"moe={self.moe}: expected (experts, top_k) with 1 <= top_k <= experts")
    if self.d_model % self.heads:
      raise ValueError(f"d_model={self.d_model} must be a multiple of heads={self.heads}")
    if self.positions not in ("rope", "learned"):
      raise ValueError(f"positions={self.positions!r}; expected 'rope' or 'learned'")
    if self.positions == "rope" and (self.d_model // self.heads) % 2:
      raise ValueError(f"rotary positions need an even head size; got "
                       f"{self.d_model // self.heads}")


def rotary(x: jax.Array) -> jax.Array:
  """Rotary position embedding of `x[batch, seq, heads, head_dim]` (half-split convention)."""
  seq, head_dim = x.shape[1], x.shape[-1]
  inv_freq = 1.0 / (10000.0 ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
  angles = jnp.arange(seq, dtype=jnp.float32)[:, None] * inv_freq[None, :]
  cos, sin = jnp.cos(angles)[None, :, None, :], jnp.sin(angles)[None, :, None, :]
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x.dtype)


def attention_core(q: jax.Array, k: jax.Array, v: jax.Array, implementation: str) -> jax.Array:
  """Causal softmax attention of `q, k, v[batch, seq, heads, head_dim]`, same shape out.

  "xla" writes it out (float32 scores and softmax, weights cast to the compute dtype);
  "cudnn" is cuDNN's fused kernel, which never materializes the [seq, seq] scores.
  """
  if implementation == "cudnn":
    if jax.default_backend() != "gpu":
      raise ValueError(f"attention='cudnn' runs on GPUs only; this backend is "
                       f"{jax.default_backend()!r} (use attention='xla')")
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
  seq, head_dim = q.shape[1], q.shape[-1]
  logits = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32)
  logits = logits / jnp.sqrt(jnp.float32(head_dim))
  causal = jnp.tril(jnp.ones((seq, seq), dtype=bool))
  logits = jnp.where(causal[None, None], logits, jnp.finfo(jnp.float32).min)
  weights = jax.nn.softmax(logits, axis=-1).astype(q.dtype)
  return jnp.einsum("bhqk,bkhd->bqhd", weights, v)


# Logical axis names (mapped to mesh axes by `lm.sharding.logical_rules` under --mesh): the
# parameters' `embed`/`heads`/`mlp`/`vocab`, and `act_*` for the activations entering a Dense.
ACT_EMBED = ("act_batch", "act_len", "act_embed")


class CausalSelfAttention(nn.Module):
  config: LMConfig
  recipe: Optional[jaxquant.Recipe] = None

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    cfg = self.config
    batch, seq, _ = x.shape
    head_dim = cfg.d_model // cfg.heads
    qkv = jaxquant.flax.Dense(3 * cfg.d_model, dtype=cfg.dtype, recipe=self.recipe,
                              kernel_axes=("embed", "heads"), input_axes=ACT_EMBED,
                              name="qkv")(x)
    # [heads, (q, k, v), head_dim] per position: a tensor-parallel shard of `qkv`'s output holds
    # whole heads, so splitting q/k/v moves nothing.
    q, k, v = (qkv.reshape(batch, seq, cfg.heads, 3, head_dim)[:, :, :, i] for i in range(3))
    if cfg.positions == "rope":
      q, k = rotary(q), rotary(k)
    out = attention_core(q, k, v, cfg.attention).reshape(batch, seq, cfg.d_model)
    return jaxquant.flax.Dense(cfg.d_model, dtype=cfg.dtype, recipe=self.recipe,
                               kernel_axes=("heads", "embed"),
                               input_axes=("act_batch", "act_len", "act_heads"),
                               name="proj")(out)


class MLP(nn.Module):
  config: LMConfig
  recipe: Optional[jaxquant.Recipe] = None

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    cfg = self.config
    h = jaxquant.flax.Dense(cfg.mlp_ratio * cfg.d_model, dtype=cfg.dtype, recipe=self.recipe,
                            kernel_axes=("embed", "mlp"), input_axes=ACT_EMBED, name="fc1")(x)
    h = nn.gelu(h)
    return jaxquant.flax.Dense(cfg.d_model, dtype=cfg.dtype, recipe=self.recipe,
                               kernel_axes=("mlp", "embed"),
                               input_axes=("act_batch", "act_len", "act_mlp"), name="fc2")(h)


class Block(nn.Module):
  config: LMConfig
  recipe: Optional[jaxquant.Recipe] = None

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    cfg = self.config
    x = x + CausalSelfAttention(cfg, self.recipe, name="attn")(
        nn.LayerNorm(dtype=cfg.dtype, name="ln1")(x))
    mlp = (MoEMLP if cfg.moe is not None else MLP)(cfg, self.recipe, name="mlp")
    return x + mlp(nn.LayerNorm(dtype=cfg.dtype, name="ln2")(x))


class ScannedBlock(nn.Module):
  """`Block` in `nn.scan`'s carry form: `(x, None) -> (block(x), None)`."""

  config: LMConfig
  recipe: Optional[jaxquant.Recipe] = None

  @nn.compact
  def __call__(self, x: jax.Array, _) -> tuple[jax.Array, None]:
    return _block_class(self.config)(self.config, self.recipe, name="block")(x), None


def _block_class(cfg: LMConfig) -> type:
  """`Block`, rematerialized under `cfg.remat` with the quantized weights kept."""
  return nn.remat(Block, policy=jaxquant.remat_policy()) if cfg.remat else Block


def blocks(cfg: LMConfig, recipe: Optional[jaxquant.Recipe], x: jax.Array) -> jax.Array:
  """The decoder blocks, unrolled (`block_0`, ...) or scanned (`blocks`), remat or not."""
  if cfg.scan_layers:
    scanned = nn.scan(ScannedBlock, length=cfg.layers,
                      variable_axes={"params": 0, "_overwrite_with_gradient": 0,
                                     "intermediates": 0, jaxquant.flax.WEIGHT_CACHE: 0},
                      split_rngs={"params": True, "quantize": True},
                      metadata_params={nn.PARTITION_NAME: "layers"})
    return scanned(cfg, recipe, name="blocks")(x, None)[0]
  block = _block_class(cfg)
  for i in range(cfg.layers):
    x = block(cfg, recipe, name=f"block_{i}")(x)
  return x


class GPT(nn.Module):
  """Decoder-only LM: `tokens[batch, seq]` (int) -> `logits[batch, seq, vocab]` (float32)."""

  config: LMConfig
  recipe: Optional[jaxquant.Recipe] = None

  @nn.compact
  def __call__(self, tokens: jax.Array) -> jax.Array:
    cfg = self.config
    embed = TokenEmbed(cfg.vocab, cfg.d_model, dtype=cfg.dtype, gradient=cfg.embedding_gradient,
                       embedding_init=nn.initializers.normal(0.02), name="embed")
    x = embed(tokens)
    if cfg.positions == "learned":
      pos = nn.Embed(cfg.seq, cfg.d_model, dtype=cfg.dtype,
                     embedding_init=nn.initializers.normal(0.02), name="pos_embed")
      x = x + pos(jnp.arange(tokens.shape[1]))[None]
    x = blocks(cfg, self.recipe, x)
    x = nn.LayerNorm(dtype=cfg.dtype, name="ln_f")(x)
    if cfg.tie_embeddings:
      logits = embed.attend(x)
    else:
      logits = jaxquant.flax.Dense(cfg.vocab, dtype=cfg.dtype, recipe=self.recipe,
                                   kernel_axes=("embed", "vocab"), input_axes=ACT_EMBED,
                                   name="lm_head")(x)
    return logits.astype(jnp.float32)
