"""`jaxquant.flax.Dense` as a drop-in for `flax.linen.Dense`.

    python examples/dense_dropin.py                       # FP8 current scaling vs bf16
    python examples/dense_dropin.py --recipe nvfp4 --steps 300

A small MLP classifier is written once against a `dense` constructor. The baseline builds it with
`nn.Dense`; the quantized copy passes `functools.partial(jaxquant.flax.Dense, recipe=...)` and
nothing else changes: the parameter tree is identical (the baseline's initial parameters are
loaded into the quantized model as they are), both compute in bfloat16 with float32 parameters,
see the same batches and use the same optimizer. The task is synthetic: Gaussian inputs
labelled by a fixed random teacher network. Prints both losses side by side.
"""

from __future__ import annotations

import argparse
import functools
from typing import Any, Callable, Optional, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.training.train_state import TrainState

import jaxquant
import jaxquant.flax

from lm import recipes, training  # shared with train_lm.py (examples/lm)


class MLP(nn.Module):
  """`features[0] -> ... -> classes` with GELU, every layer built by `dense(features, name=...)`."""

  hidden: Sequence[int]
  classes: int
  dense: Callable[..., nn.Module] = nn.Dense

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    for i, width in enumerate(self.hidden):
      x = nn.gelu(self.dense(width, dtype=jnp.bfloat16, name=f"fc{i + 1}")(x))
    return self.dense(self.classes, dtype=jnp.bfloat16, name="head")(x).astype(jnp.float32)


def teacher_task(dim: int, classes: int, seed: int) -> Callable[[np.random.Generator, int], Any]:
  """`sample(rng, n) -> (x[n, dim] float32, labels[n] int32)` from a fixed random teacher."""
  t = np.random.default_rng(seed + 1000)
  w1 = t.standard_normal((dim, 4 * dim)) / np.sqrt(dim)
  w2 = t.standard_normal((4 * dim, classes)) / np.sqrt(4 * dim)

  def sample(rng: np.random.Generator, n: int):
    x = rng.standard_normal((n, dim)).astype(np.float32)
    labels = np.argmax(np.tanh(x @ w1) @ w2, axis=-1).astype(np.int32)
    return x, labels

  return sample


def make_train_step(model: nn.Module) -> Callable:
  def loss_fn(variables, x, labels, key):
    logits = model.apply(variables, x, rngs={"quantize": key})
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    return loss, (logits.argmax(-1) == labels).mean()

  @jax.jit
  def step(state: TrainState, x, labels, key):
    (loss, acc), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params, x, labels, key)
    return state.apply_gradients(grads=grads), loss, acc

  return step


def build_parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  p.add_argument("--recipe", default="fp8_current",
                 help=f"one of {', '.join(n for n in recipes.available() if n != 'bf16')}")
  p.add_argument("--steps", type=int, default=200)
  p.add_argument("--batch", type=int, default=256)
  p.add_argument("--dim", type=int, default=64, help="input features")
  p.add_argument("--hidden", type=int, default=256, help="width of the two hidden layers")
  p.add_argument("--classes", type=int, default=16)
  p.add_argument("--lr", type=float, default=3e-3)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--print-every", type=int, default=20)
  p.add_argument("--backend", choices=training.BACKENDS, default=None,
                 help="JAXQUANT_BACKEND; default: $JAXQUANT_BACKEND, else reference on CPU")
  return p


def main(argv: Optional[Sequence[str]] = None) -> dict:
  """Train the baseline and the quantized MLP side by side; returns their loss lists."""
  parser = build_parser()
  args = parser.parse_args(argv)
  args.recipe = recipes.canonical(args.recipe)
  if args.recipe not in recipes.available() or args.recipe == recipes.BASELINE:
    parser.error(f"--recipe {args.recipe!r}; expected one of "
                 f"{', '.join(n for n in recipes.available() if n != recipes.BASELINE)}")
  with training.jaxquant_backend(args.backend or training.default_backend()):
    return run(args, recipes.make(args.recipe))


def run(args: argparse.Namespace, recipe: jaxquant.Recipe) -> dict:
  """Build both models from one set of parameters and train them on the same batches."""
  hidden = (args.hidden, args.hidden)
  baseline = MLP(hidden, args.classes, dense=nn.Dense)
  quantized = MLP(hidden, args.classes,
                  dense=functools.partial(jaxquant.flax.Dense, recipe=recipe))

  sample = teacher_task(args.dim, args.classes, args.seed)
  x0, _ = sample(np.random.default_rng(args.seed), args.batch)
  base_vars = baseline.init(jax.random.key(args.seed), x0)
  # The quantized model may add quantizer state (delayed scaling); its params are the baseline's.
  quant_vars = dict(jax.jit(quantized.init)({"params": jax.random.key(args.seed),
                                             "quantize": jax.random.key(1)}, x0))
  same_tree = (jax.tree.structure(base_vars["params"])
               == jax.tree.structure(quant_vars["params"]))
  if not same_tree:
    raise RuntimeError("jaxquant.flax.Dense should have nn.Dense's parameter tree")
  quant_vars["params"] = base_vars["params"]
  print(f"parameter trees match ({sum(p.size for p in jax.tree.leaves(base_vars))} params); "
        f"extra collections of the quantized model: "
        f"{sorted(set(quant_vars) - {'params'}) or 'none'}")

  tx = optax.adamw(optax.cosine_decay_schedule(args.lr, args.steps, alpha=0.1))
  states = {"bf16 nn.Dense": TrainState.create(apply_fn=baseline.apply,
                                               params=dict(base_vars), tx=tx),
            f"{args.recipe} jaxquant": TrainState.create(apply_fn=quantized.apply,
                                                          params=quant_vars, tx=tx)}
  steps = {"bf16 nn.Dense": make_train_step(baseline),
           f"{args.recipe} jaxquant": make_train_step(quantized)}
  losses = {name: [] for name in states}
  accs = {name: [] for name in states}

  rng = np.random.default_rng(args.seed)
  names = list(states)
  print(f"{'step':>5s}  " + "  ".join(f"{n:>26s}" for n in names) + "    (loss / accuracy)")
  for step in range(1, args.steps + 1):
    x, labels = sample(rng, args.batch)
    key = jax.random.fold_in(jax.random.key(args.seed + 2), step)
    for name in names:
      states[name], loss, acc = steps[name](states[name], x, labels, key)
      losses[name].append(float(loss))
      accs[name].append(float(acc))
    if step == 1 or step % args.print_every == 0 or step == args.steps:
      print(f"{step:5d}  " + "  ".join(f"{losses[n][-1]:17.4f} / {accs[n][-1]:5.3f}"
                                       for n in names))
  window = max(1, min(10, args.steps // 5))
  for name in names:
    print(f"{name:>26s}: loss {losses[name][0]:.4f} -> "
          f"{np.mean(losses[name][-window:]):.4f} (mean of last {window} steps), "
          f"accuracy {np.mean(accs[name][-window:]):.3f}")
  return {"losses": losses, "accuracy": accs, "names": names}


if __name__ == "__main__":
  main()
