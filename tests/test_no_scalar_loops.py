"""The compiled training step of every built-in recipe holds no loop the model did not ask for.

Scale math (scales, inverses, NVFP4's second-level scales, the delayed-scaling update) is
per-tensor or per-block scalar work; as a loop it runs on a GPU as a `while` with one kernel
launch per iteration (docs/design.md §6.1 "Conventions", no scalar loops at run time). A
two-layer MLP of
`jaxquant.flax.Dense` is stepped with AdamW through `jaxquant.flax.apply_gradients`; its
compiled step must hold as many `while` ops as the same step with no recipe (the model's own).

One exception, on CPU only: JAX lowers its own threefry PRNG (Flax's `make_rng` and the
`fold_in` that seeds NVFP4's stochastic rounding) as a rolled five-round loop on CPU and
unrolled on GPU; those loops (named `threefry` in their metadata) are not counted on CPU.
"""

from __future__ import annotations

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest

import jaxquant as jq
import jaxquant.flax as jf

M, K, HIDDEN, N = 32, 64, 64, 32  # NVFP4's RHT needs M % 16 == 0; MXFP8 blocks of 32


class _MLP(nn.Module):
  recipe: jq.Recipe | None

  @nn.compact
  def __call__(self, x):
    x = jf.Dense(HIDDEN, recipe=self.recipe, name="fc1")(x)
    return jf.Dense(N, recipe=self.recipe, name="fc2")(nn.gelu(x))


def _while_ops_in_compiled_step(recipe, rng) -> int:
  model = _MLP(recipe)
  x = jnp.asarray(rng.standard_normal((M, K)), jnp.float32)
  target = jnp.asarray(rng.standard_normal((M, N)), jnp.float32)
  tx = optax.adamw(1e-3)
  # The step is compiled, never run: shapes suffice (an eager init ran the quantized forward
  # op by op).
  variables = jax.eval_shape(model.init, jax.random.key(0), x)
  opt_state = jax.eval_shape(lambda v: jf.init_optimizer(tx, v), variables)

  def step(variables, opt_state, x, target, key):
    def loss(v):
      y = model.apply(v, x, rngs={jf.QUANTIZE_RNG: key})
      return jnp.mean((y - target) ** 2)
    grads = jax.grad(loss)(variables)
    return jf.apply_gradients(tx, variables, grads, opt_state)

  text = jax.jit(step).lower(variables, opt_state, x, target,
                             jax.random.key(1)).compile().as_text()
  loops = [line for line in text.splitlines() if re.search(r"\bwhile\(", line)]
  if jax.default_backend() == "cpu":
    loops = [line for line in loops if "threefry" not in line]
  return len(loops)


_BASELINE: dict = {}  # the unquantized step's count, compiled once per process


@pytest.mark.parametrize("recipe_name", sorted(jq.BUILTIN_RECIPES))
def test_compiled_training_step_has_no_loop_the_model_did_not_ask_for(rng, recipe_name):
  if "loops" not in _BASELINE:
    _BASELINE["loops"] = _while_ops_in_compiled_step(None, rng)
  baseline = _BASELINE["loops"]
  quantized = _while_ops_in_compiled_step(jq.BUILTIN_RECIPES[recipe_name](), rng)
  assert quantized == baseline, (
      f"{recipe_name}: {quantized} while ops in the compiled step, {baseline} without a recipe")
