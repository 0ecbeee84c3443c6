"""Quantize an unmodified Flax NNX transformer with one call: `jaxquant.nnx.quantize_model`.

    python examples/nnx_quantize.py                          # FP8 current scaling vs bf16
    python examples/nnx_quantize.py --recipe mxfp8 --steps 500
    python examples/nnx_quantize.py --d-model 2048 --layers 4 --seq 1024 --batch 8   # a GPU

The model is written the way Flax's own Gemma is: attention through `nnx.Einsum` (one
`'BTD,SNDH->SBTNH'` for q, k and v, `'BTNH,NHD->BTD'` for the output), a gated MLP through
`nnx.Linear`, RMS norms, rotary positions, and the token embedding reused as the output layer.
Nothing in it knows about jaxquant. The quantized run builds the same model from the same seed,
calls `quantize_model(model, recipe)` (every Einsum and Linear swapped in place, the parameters
untouched) and trains exactly like the baseline: `nnx.Optimizer`, an `nnx.jit` step, the same
batches of byte-level text (the Python standard library's sources). Prints both loss curves.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jaxquant
import jaxquant.nnx

from lm import data, recipes, training  # shared with train_lm.py (examples/lm)


@dataclasses.dataclass(frozen=True)
class Config:
  vocab: int = data.VOCAB
  d_model: int = 128
  layers: int = 2
  heads: int = 4
  mlp_ratio: int = 4
  dtype: jnp.dtype = jnp.bfloat16

  @property
  def head_dim(self) -> int:
    return self.d_model // self.heads


def rope(x: jax.Array) -> jax.Array:
  """Rotary positions on `x[B, T, N, H]` (half-split, base 10000)."""
  half = x.shape[-1] // 2
  freq = 1.0 / 10000 ** (jnp.arange(half, dtype=jnp.float32) / half)
  angle = jnp.arange(x.shape[1], dtype=jnp.float32)[:, None] * freq
  sin, cos = jnp.sin(angle)[None, :, None], jnp.cos(angle)[None, :, None]
  a, b = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
  return jnp.concatenate([a * cos - b * sin, b * cos + a * sin], -1).astype(x.dtype)


class Attention(nnx.Module):
  def __init__(self, cfg: Config, rngs: nnx.Rngs):
    self.qkv_einsum = nnx.Einsum("BTD,SNDH->SBTNH", (3, cfg.heads, cfg.d_model, cfg.head_dim),
                                 dtype=cfg.dtype, rngs=rngs)
    self.attn_vec_einsum = nnx.Einsum("BTNH,NHD->BTD", (cfg.heads, cfg.head_dim, cfg.d_model),
                                      dtype=cfg.dtype, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    q, k, v = self.qkv_einsum(x)
    q, k = rope(q), rope(k)
    logits = jnp.einsum("BTNH,BSNH->BNTS", q, k).astype(jnp.float32) / np.sqrt(q.shape[-1])
    causal = jnp.tril(jnp.ones((x.shape[1], x.shape[1]), bool))
    probs = jax.nn.softmax(jnp.where(causal, logits, -1e30), -1).astype(v.dtype)
    return self.attn_vec_einsum(jnp.einsum("BNTS,BSNH->BTNH", probs, v))


class FeedForward(nnx.Module):
  def __init__(self, cfg: Config, rngs: nnx.Rngs):
    hidden = cfg.mlp_ratio * cfg.d_model
    self.gate_proj = nnx.Linear(cfg.d_model, hidden, use_bias=False, dtype=cfg.dtype, rngs=rngs)
    self.up_proj = nnx.Linear(cfg.d_model, hidden, use_bias=False, dtype=cfg.dtype, rngs=rngs)
    self.down_proj = nnx.Linear(hidden, cfg.d_model, use_bias=False, dtype=cfg.dtype,
                                rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    return self.down_proj(jax.nn.gelu(self.gate_proj(x)) * self.up_proj(x))


class Block(nnx.Module):
  def __init__(self, cfg: Config, rngs: nnx.Rngs):
    self.pre_attention_norm = nnx.RMSNorm(cfg.d_model, dtype=cfg.dtype, rngs=rngs)
    self.attn = Attention(cfg, rngs)
    self.pre_ffw_norm = nnx.RMSNorm(cfg.d_model, dtype=cfg.dtype, rngs=rngs)
    self.mlp = FeedForward(cfg, rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    x = x + self.attn(self.pre_attention_norm(x))
    return x + self.mlp(self.pre_ffw_norm(x))


class Transformer(nnx.Module):
  def __init__(self, cfg: Config, rngs: nnx.Rngs):
    self.embedder = nnx.Embed(cfg.vocab, cfg.d_model, dtype=cfg.dtype, rngs=rngs)
    self.layers = nnx.List([Block(cfg, rngs) for _ in range(cfg.layers)])
    self.final_norm = nnx.RMSNorm(cfg.d_model, dtype=cfg.dtype, rngs=rngs)

  def __call__(self, tokens: jax.Array) -> jax.Array:
    x = self.embedder(tokens) * np.sqrt(self.embedder.features).astype(np.float32)
    for layer in self.layers:
      x = layer(x)
    return self.embedder.attend(self.final_norm(x)).astype(jnp.float32)  # tied output


def loss_fn(model: Transformer, tokens: jax.Array) -> jax.Array:
  logits = model(tokens[:, :-1])
  return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


@nnx.jit
def train_step(model: Transformer, optimizer: nnx.Optimizer, tokens: jax.Array) -> jax.Array:
  loss, grads = nnx.value_and_grad(loss_fn, argnums=jaxquant.nnx.diff_state(0))(model, tokens)
  jaxquant.nnx.apply_gradients(optimizer, model, grads)  # also advances delayed scaling
  return loss


@nnx.jit
def eval_loss(model: Transformer, tokens: jax.Array) -> jax.Array:
  return loss_fn(model, tokens)


def build(cfg: Config, recipe_name: str, seed: int):
  """The model from `seed`, quantized by `recipe_name` with one call (none for bf16)."""
  model = Transformer(cfg, nnx.Rngs(seed))
  swaps = []
  recipe = recipes.make(recipe_name)
  if recipe is not None:
    model, swaps = jaxquant.nnx.quantize_model(model, recipe, rngs=nnx.Rngs(quantize=seed))
  return model, swaps


def run(recipe_name: str, cfg: Config, args, corpus: data.Corpus, log) -> list[float]:
  model, swaps = build(cfg, recipe_name, args.seed)
  if swaps:
    log(f"{recipe_name}: swapped {len(swaps)} modules "
        f"({', '.join(sorted({s.original.__name__ for s in swaps}))}), e.g. {swaps[0].path}")
  schedule = optax.warmup_cosine_decay_schedule(0.0, args.lr, args.warmup, args.steps,
                                                args.lr * 0.1)
  optimizer = nnx.Optimizer(model, optax.adamw(schedule, weight_decay=0.0), wrt=nnx.Param)
  batches = data.random_batches(corpus.train, args.batch, args.seq, args.seed)
  val = jnp.asarray(data.fixed_batches(corpus.val, args.batch, args.seq, 1)[0])
  losses, start = [], time.perf_counter()
  for step in range(1, args.steps + 1):
    loss = train_step(model, optimizer, jnp.asarray(next(batches)))
    if step % args.log_every == 0 or step == args.steps:
      losses.append(float(loss))
      log(f"{recipe_name:>14s} step {step:5d}  train {losses[-1]:.4f}  "
          f"({time.perf_counter() - start:.1f} s)")
  final_val = float(eval_loss(model, val))
  log(f"{recipe_name:>14s} validation loss {final_val:.4f}")
  return losses + [final_val]


def main(argv: Optional[Sequence[str]] = None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--recipe", default="fp8_current",
                      help="quantized recipe to compare with bf16: "
                      f"{', '.join(recipes.available()[1:])}")
  parser.add_argument("--steps", type=int, default=300)
  parser.add_argument("--d-model", type=int, default=128)
  parser.add_argument("--layers", type=int, default=2)
  parser.add_argument("--heads", type=int, default=4)
  parser.add_argument("--seq", type=int, default=64)
  parser.add_argument("--batch", type=int, default=16)
  parser.add_argument("--lr", type=float, default=3e-3)
  parser.add_argument("--warmup", type=int, default=30)
  parser.add_argument("--log-every", type=int, default=50)
  parser.add_argument("--data-mb", type=float, default=2.0)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--quiet", action="store_true")
  args = parser.parse_args(argv)
  name = recipes.parse(args.recipe)
  if len(name) != 1 or name[0] == recipes.BASELINE:
    raise ValueError(f"--recipe {args.recipe!r}: expected one quantized recipe")
  if args.d_model % args.heads:
    raise ValueError(f"--d-model {args.d_model} must be a multiple of --heads {args.heads}")
  log = (lambda *_: None) if args.quiet else print
  cfg = Config(d_model=args.d_model, layers=args.layers, heads=args.heads)
  corpus = data.load_corpus(int(args.data_mb * 1e6))
  with training.jaxquant_backend(training.default_backend()):
    curves = {n: run(n, cfg, args, corpus, log) for n in (recipes.BASELINE, name[0])}
  base, quant = curves[recipes.BASELINE], curves[name[0]]
  rel = abs(quant[-2] - base[-2]) / base[-2]
  summary = (f"final train loss: bf16 {base[-2]:.4f}, {name[0]} {quant[-2]:.4f} "
             f"({100 * rel:.2f}% apart); validation: bf16 {base[-1]:.4f}, "
             f"{name[0]} {quant[-1]:.4f}")
  log(summary)
  return {"curves": curves, "relative_difference": rel, "summary": summary}


if __name__ == "__main__":
  main()
