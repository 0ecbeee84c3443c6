"""The examples run end to end (tiny settings) and produce what they promise.

Each example exposes `main(argv)`; these tests call it in-process with a tiny model and a few
steps, and check the outputs a user relies on: the CSV columns and recipes, a PNG, a falling
loss, malformed or impossible flags refused clearly, and `jaxquant.explain` naming the roles the
custom factory dispatched. The `--moe` run is in test_grouped_moe.py.
"""

from __future__ import annotations

import csv
import dataclasses
import importlib

import numpy as np
import pytest

import jaxquant

TINY_LM = ["--d-model", "32", "--layers", "1", "--heads", "2", "--seq", "32", "--batch", "8",
           "--data-mb", "0.3", "--eval-batches", "1", "--no-progress"]
# The examples' own default on CPU is the pure-JAX reference path, which
# test_train_lm_writes_csv_and_plot_and_loss_falls keeps; the other runs take the FFI kernels'
# CPU handlers (`--backend auto`), whose steps compile in about half the CPU time (~40 CPU-s
# less here; the reference's numerics are tested op by op against them elsewhere).
AUTO = ["--backend", "auto"]


def _example(name: str):
  """An example module (`train_lm`, `lm.data`, ...): pytest puts examples/ on the path
  (pyproject.toml, `pythonpath`)."""
  return importlib.import_module(name)


def test_train_lm_writes_csv_and_plot_and_loss_falls(tmp_path, seed):
  train_lm = _example("train_lm")
  result = train_lm.main(["--recipe", "bf16,fp8_delayed", "--steps", "12", "--eval-every", "6",
                          "--lr", "1e-2", "--warmup", "2", "--seed", str(seed % 10_000),
                          "--out", str(tmp_path), *TINY_LM])
  with open(tmp_path / "losses.csv", newline="") as f:
    reader = csv.DictReader(f)
    assert tuple(reader.fieldnames) == ("step", "recipe", "train_loss", "val_loss", "time")
    rows = list(reader)
  assert [(r["recipe"], int(r["step"])) for r in rows] == [
      (recipe, step) for recipe in ("bf16", "fp8_delayed") for step in (0, 6, 12)]
  for recipe in ("bf16", "fp8_delayed"):
    curve = [r for r in rows if r["recipe"] == recipe]
    assert float(curve[-1]["train_loss"]) < float(curve[0]["train_loss"]) - 0.3, curve
    assert float(curve[-1]["val_loss"]) < float(curve[0]["val_loss"]) - 0.3, curve
  assert (tmp_path / "losses.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  assert "fp8_delayed" in result["summary"] and "bf16" in result["summary"]
  # steps.csv: every step's loss, read back to the same float.
  steps = _example("lm.report").read_steps_csv(tmp_path / "steps.csv")
  assert {recipe: [loss for loss, _ in rows] for recipe, rows in steps.items()} == {
      h.recipe: h.step_losses for h in result["histories"]}
  assert all(len(rows) == 12 for rows in steps.values())


def test_train_lm_recipe_all_covers_every_builtin_and_zoo_recipe():
  recipes = _example("lm.recipes")
  names = recipes.parse("all")
  assert names == ["bf16", *jaxquant.BUILTIN_RECIPES, *jaxquant.factories.ZOO]
  assert recipes.parse("mxfp8, bf16,mxfp8") == ["mxfp8", "bf16"]
  # `-` reads as `_` on the command line, in lists and in `make`.
  assert recipes.parse("fp8-current,moe-nvfp4-fwd-mxfp8-bwd,fp8_current") == [
      "fp8_current", "moe_nvfp4_fwd_mxfp8_bwd"]
  assert recipes.make("fp8-delayed") == recipes.make("fp8_delayed") == jaxquant.DelayedScaling()
  with pytest.raises(ValueError, match="unknown recipe 'fp8_nine'"):
    recipes.parse("fp8-nine")
  with pytest.raises(ValueError, match="unknown recipe 'fp9'"):
    recipes.parse("bf16,fp9")


def test_train_lm_trains_bf16_and_fp8_current_by_default():
  train_lm = _example("train_lm")
  args = train_lm.build_parser().parse_args([])
  assert _example("lm.recipes").parse(args.recipe) == ["bf16", "fp8_current"]


def test_train_lm_prints_each_recipes_final_gap_to_bf16():
  report, training = _example("lm.report"), _example("lm.training")
  histories = [training.History(name, rows=[{"val_loss": loss}])
               for name, loss in (("bf16", 2.0), ("fp8_current", 2.05), ("mxfp8", 1.99))]
  gaps = report.final_gaps(histories)
  assert len(gaps) == 2
  assert "fp8_current - bf16: +0.0500" in gaps[0] and "+2.50%" in gaps[0]
  assert "mxfp8 - bf16: -0.0100" in gaps[1]
  assert report.final_gaps(histories[1:]) == []  # no baseline, no gap


def test_train_lm_mesh_larger_than_the_devices_is_refused_clearly():
  # The sharded runs themselves are in tests/multidevice (they need 8 devices).
  train_lm = _example("train_lm")
  with pytest.raises(ValueError, match=r"needs 8 devices, found 1"):
    train_lm.main(["--mesh", "dp=2,tp=4", *TINY_LM, "--steps", "1"])


def test_train_lm_rejects_malformed_mesh():
  train_lm = _example("train_lm")
  with pytest.raises(SystemExit):
    train_lm.main(["--mesh", "dp2"])


def test_dense_dropin_trains_both_models_from_the_same_parameters(seed):
  dense_dropin = _example("dense_dropin")
  result = dense_dropin.main(["--recipe", "fp8_current", "--steps", "25", "--batch", "64",
                              "--hidden", "64", "--dim", "32", "--classes", "8", "--lr", "1e-2",
                              "--print-every", "5", "--seed", str(seed % 10_000), *AUTO])
  baseline, quantized = (result["losses"][n] for n in result["names"])
  assert len(baseline) == len(quantized) == 25
  # Same initial parameters and batch: FP8 rounding moves the first loss only slightly ...
  assert abs(baseline[0] - quantized[0]) < 0.05
  # ... both learn, and the drop-in tracks the baseline.
  for losses in (baseline, quantized):
    assert np.mean(losses[-5:]) < losses[0] - 0.4
  assert abs(np.mean(baseline[-5:]) - np.mean(quantized[-5:])) < 0.1


def test_custom_factory_explain_shows_which_quantizer_served_each_role():
  custom_factory = _example("custom_factory")
  result = custom_factory.main(["--steps", "3", "--d-model", "32", "--layers", "1",
                                "--heads", "2", "--seq", "32", "--batch", "4",
                                "--data-mb", "0.3", "--no-progress", *AUTO])
  quantize = [d for d in result["report"] if d.op == "quantize"]
  served = {(d.role.name, d.role.tensor_type, d.detail.split(":")[0]): d.detail for d in quantize}
  assert {name for name, _, _ in served} == {"qkv", "proj", "fc1", "fc2", "lm_head"}
  for tensor_type in ("input", "weight", "grad_output"):  # kept in BF16
    assert "IdentityQuantizer" in served[("lm_head", tensor_type, "rowwise+columnwise")]
  for name in ("qkv", "proj", "fc1", "fc2"):
    assert "NVFP4Quantizer" in served[(name, "input", "rowwise")]
    assert "block_2d=True" in served[(name, "weight", "rowwise")]
    assert "MXFP8Quantizer" in served[(name, "weight", "columnwise")]
    assert "float8_e5m2" in served[(name, "grad_output", "rowwise+columnwise")]
  history = result["history"]
  assert [row["step"] for row in history.rows][-1] == 3
  assert all(np.isfinite(row["val_loss"]) for row in history.rows)


def test_lm_scan_layers_and_remat_compute_the_unrolled_models_loss_and_gradients(seed):
  """`--scan-layers` stacks the blocks' parameters (`blocks/block/...`, leading axis = layer) and
  `--remat` recomputes activations: with the unrolled model's parameters restacked, both give
  its loss and gradients (float32 reduction-order tolerance: XLA may fuse the scanned body
  differently)."""
  import flax.linen as nn
  import jax
  import jax.numpy as jnp
  _example("train_lm")
  from lm.model import GPT, LMConfig
  from lm import training
  base = LMConfig(seq=16, d_model=32, layers=3, heads=2, dtype=jnp.float32)
  recipe = jaxquant.BUILTIN_RECIPES["fp8_current"]()
  tokens = np.random.default_rng(seed).integers(0, 256, (4, 17), np.int32)
  key = jax.random.key(seed)
  unrolled = GPT(base, recipe)
  params = nn.meta.unbox(jax.jit(unrolled.init)({"params": jax.random.key(seed)},
                                                tokens[:, :-1]))
  loss_grad = lambda model, v: jax.jit(jax.value_and_grad(
      lambda v: training.next_token_loss(model, v, jnp.asarray(tokens), key)))(v)
  want_loss, want_grads = loss_grad(unrolled, params)
  blocks = [params["params"].pop(f"block_{i}") for i in range(base.layers)]
  stacked = {**params["params"],
             "blocks": {"block": jax.tree.map(lambda *a: jnp.stack(a), *blocks)}}
  for remat in (False, True):
    model = GPT(dataclasses.replace(base, scan_layers=True, remat=remat), recipe)
    loss, grads = loss_grad(model, {"params": stacked})
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    got_blocks = grads["params"]["blocks"]["block"]
    for i in range(base.layers):
      jax.tree.map(lambda g, w: np.testing.assert_allclose(g[i], w, rtol=1e-4, atol=1e-6),
                   got_blocks, want_grads["params"][f"block_{i}"])
    np.testing.assert_allclose(grads["params"]["lm_head"]["kernel"],
                               want_grads["params"]["lm_head"]["kernel"], rtol=1e-4, atol=1e-6)


def test_nnx_quantize_trains_bf16_and_the_swapped_fp8_model_alike(capsys, monkeypatch):
  nnx_quantize = _example("nnx_quantize")
  monkeypatch.setenv("JAXQUANT_BACKEND", "auto")  # (AUTO: this example has no --backend)
  result = nnx_quantize.main(["--steps", "60", "--d-model", "32", "--layers", "1", "--heads",
                              "2", "--seq", "32", "--batch", "8", "--data-mb", "0.3",
                              "--warmup", "5", "--log-every", "20", "--lr", "1e-2"])
  out = capsys.readouterr().out
  assert "fp8_current: swapped 5 modules (Einsum, Linear)" in out
  for name, curve in result["curves"].items():  # [train at 20, 40, 60, validation]
    assert len(curve) == 4 and max(curve) < 0.6 * np.log(256), (name, curve)  # learned bytes
  # the full default run (300 steps) lands within 2%; 60 tiny steps within 5%
  assert result["relative_difference"] < 0.05, result["summary"]
  with pytest.raises(ValueError, match="expected one quantized recipe"):
    nnx_quantize.main(["--recipe", "bf16"])
