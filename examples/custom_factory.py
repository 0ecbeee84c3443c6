"""A role-dispatching hybrid recipe: your own `qfactory(role) -> Quantizer` in `CustomRecipe`.

    python examples/custom_factory.py
    python examples/custom_factory.py --keep lm_head,qkv --steps 100

The factory below is called once per tensor slot while the model is traced. It dispatches on
the role:
  * `role is None` (a slot whose consumer is unknown): high precision;
  * `role.name` in `--keep` (default: `lm_head`): high precision (kept in BF16);
  * `module_type == "grouped_linear"` (MoE experts): row-scaled ("per-token") NVFP4 activations
    and NVFP4 weights forward, MXFP8 backward;
  * `module_type == "linear"`: NVFP4 forward (16x16 weight tiles), MXFP8 backward built from the
    *dequantized* forward operands (`columnwise_source="rowwise_dequantized"`, so dgrad and wgrad
    see the forward's quantization error); gradients in MXFP8 E5M2.
It then trains a small byte-level GPT (the model of `train_lm.py`) for a few steps and prints
`jaxquant.explain`: the quantizer and implementation that actually served every role.
"""

from __future__ import annotations

import argparse
import os
from typing import Callable, Iterable, Optional, Sequence

import jax.numpy as jnp

import jaxquant
from jaxquant import (HybridQuantizer, IdentityQuantizer, MXFP8Quantizer, NVFP4Quantizer,
                      Quantizer, QuantizerRole)

from lm import data, training
from lm.model import GPT, LMConfig


def make_factory(keep_in_bf16: Iterable[str] = ("lm_head",)
                 ) -> Callable[[Optional[QuantizerRole]], Quantizer]:
  """The hybrid factory, keeping the layers named in `keep_in_bf16` unquantized."""
  keep = frozenset(keep_in_bf16)

  def factory(role: Optional[QuantizerRole]) -> Quantizer:
    if role is None or role.name in keep:
      return IdentityQuantizer()
    if role.module_type == "grouped_linear":  # MoE experts
      if role.tensor_type == "input":
        return HybridQuantizer(rowwise=NVFP4Quantizer(row_scaled=True),
                               columnwise=MXFP8Quantizer())
      if role.tensor_type == "weight":
        return HybridQuantizer(rowwise=NVFP4Quantizer(), columnwise=MXFP8Quantizer())
      return MXFP8Quantizer(jnp.float8_e5m2)
    if role.tensor_type == "grad_output":  # rowwise -> dgrad, columnwise -> wgrad
      return MXFP8Quantizer(jnp.float8_e5m2)
    return HybridQuantizer(rowwise=NVFP4Quantizer(block_2d=role.tensor_type == "weight"),
                           columnwise=MXFP8Quantizer(),
                           columnwise_source="rowwise_dequantized")

  factory.__name__ = "hybrid_nvfp4_fwd_mxfp8_bwd"
  return factory


def describe_factory(factory: Callable) -> str:
  """What the factory answers for each kind of role (a plain function call per role)."""
  roles: list[Optional[QuantizerRole]] = [None]
  for module_type, name in (("linear", "fc1"), ("linear", "lm_head"),
                            ("grouped_linear", "experts")):
    roles += [QuantizerRole(module_type, t, name) for t in ("input", "weight", "grad_output")]
  return "\n".join(f"  {str(role) if role else 'None (unknown consumer)':34s} -> {factory(role)}"
                   for role in roles)


def build_parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  p.add_argument("--keep", default="lm_head",
                 help="comma-separated module names kept in BF16 ('' for none)")
  p.add_argument("--steps", type=int, default=60)
  p.add_argument("--batch", type=int, default=8)
  p.add_argument("--seq", type=int, default=64)
  p.add_argument("--d-model", type=int, default=64)
  p.add_argument("--layers", type=int, default=2)
  p.add_argument("--heads", type=int, default=4)
  p.add_argument("--lr", type=float, default=3e-3)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--data-mb", type=float, default=1.0)
  p.add_argument("--no-progress", action="store_true")
  p.add_argument("--backend", choices=training.BACKENDS, default=None,
                 help="JAXQUANT_BACKEND; default: $JAXQUANT_BACKEND, else reference on CPU")
  return p


def main(argv: Optional[Sequence[str]] = None) -> dict:
  """Build the recipe, explain one step, train; returns the explain report and the history."""
  args = build_parser().parse_args(argv)
  with training.jaxquant_backend(args.backend or training.default_backend()):
    return run(args)


def run(args: argparse.Namespace) -> dict:
  """Describe the factory, explain one step of a small GPT under it, and train."""
  keep = [n.strip() for n in args.keep.split(",") if n.strip()]
  factory = make_factory(keep)
  recipe = jaxquant.CustomRecipe(factory)
  print(f"factory {factory.__name__} (keeping {keep or 'nothing'} in BF16) answers "
        f"(JAXQUANT_BACKEND={os.environ['JAXQUANT_BACKEND']}):")
  print(describe_factory(factory))

  corpus = data.load_corpus(int(args.data_mb * 1e6))
  model = GPT(LMConfig(seq=args.seq, d_model=args.d_model, layers=args.layers, heads=args.heads),
              recipe)
  cfg = training.TrainConfig(steps=args.steps, lr=args.lr, warmup=max(1, args.steps // 10),
                             eval_every=max(1, args.steps // 4), seed=args.seed,
                             progress=not args.no_progress)
  batches = data.random_batches(corpus.train, args.batch, args.seq, seed=args.seed)
  first = next(batches)
  state = training.create_state(model, first, cfg)
  report = training.explain_step(model, state, first)
  print("\njaxquant.explain, one training step (forward and backward), repeated blocks folded:")
  print(training.condense(report))
  eval_sets = {split: data.fixed_batches(stream, args.batch, args.seq, 2)
               for split, stream in (("train", corpus.train), ("val", corpus.val))}
  print()
  history = training.train("custom hybrid", model, cfg, batches, eval_sets, state,
                           log=training.tqdm.write)
  first_row, last_row = history.rows[0], history.rows[-1]
  print(f"\nval loss {first_row['val_loss']:.4f} -> {last_row['val_loss']:.4f} after "
        f"{args.steps} steps ({1e3 * history.steady_step_time:.0f} ms/step)")
  return {"report": report, "history": history, "factory": factory}


if __name__ == "__main__":
  main()
