"""`bench/e2e.py`'s measurement options on the tiny CPU model: interleaved timing rounds
(`--rounds`) run the same trajectory as one variant after another, `--seed` draws another one,
and `--amax-report` lists delayed scaling's histories stalest first."""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
VARIANTS = "modules_bf16,modules_fp8_delayed"


def _env() -> dict:
  return dict(os.environ, JAX_PLATFORMS="cpu",
              PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "examples"), str(ROOT / "bench")]))


def _e2e(tmp_path, name: str, *args: str) -> tuple[str, dict]:
  out = tmp_path / f"{name}.json"
  proc = subprocess.run(
      [sys.executable, str(ROOT / "bench" / "e2e.py"), "--size", "tiny", "--steps", "5",
       "--time-from", "1", "--profile-steps", "0", "--json", str(out), *args],
      capture_output=True, text=True, env=_env(), timeout=600, check=False)
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
  return proc.stdout, {row["variant"]: row for row in json.loads(out.read_text())}


@pytest.fixture(scope="module")
def sequential(tmp_path_factory):
  return _e2e(tmp_path_factory.mktemp("e2e"), "sequential", "--variants", VARIANTS,
              "--amax-report", "4")


def test_rounds_time_every_variant_in_turn_on_the_same_trajectory(sequential, tmp_path):
  _, one_by_one = sequential
  _, rounds = _e2e(tmp_path, "rounds", "--variants", VARIANTS, "--rounds", "2")
  assert set(rounds) == set(one_by_one) == set(VARIANTS.split(","))
  for name, row in rounds.items():
    assert len(row["round_ms"]) == 2 and all(t > 0 for t in row["round_ms"])
    assert row["step_ms"] == pytest.approx(sorted(row["round_ms"])[0] / 2 +
                                           sorted(row["round_ms"])[1] / 2, rel=1e-3)
    assert len(one_by_one[name]["round_ms"]) == 1
    assert row["steps"] == one_by_one[name]["steps"] == 5
    for key in ("loss_1", "loss_last", "loss_tail"):  # CPU: the same bits in either order
      assert row[key] == one_by_one[name][key], (name, key)


def test_seed_draws_another_trajectory(sequential, tmp_path):
  _, seed0 = sequential
  _, seed1 = _e2e(tmp_path, "seed1", "--variants", "modules_bf16", "--seed", "1")
  assert seed1["modules_bf16"]["loss_1"] != seed0["modules_bf16"]["loss_1"]


def test_amax_report_lists_the_stalest_histories_first(sequential):
  stdout, _ = sequential
  head = re.search(r"modules_fp8_delayed: (\d+) amax histories", stdout)
  assert head is not None, stdout[-2000:]
  assert int(head.group(1)) > 4  # three roles a quantized contraction
  ratios = [float(r) for r in re.findall(r"^\s+([\d.]+)x  max at step", stdout, re.M)]
  assert len(ratios) == 4 and ratios == sorted(ratios, reverse=True) and ratios[-1] >= 1.0


def test_rounds_must_leave_a_step_to_each_round():
  proc = subprocess.run(
      [sys.executable, str(ROOT / "bench" / "e2e.py"), "--size", "tiny", "--steps", "5",
       "--time-from", "1", "--rounds", "5"], capture_output=True, text=True, env=_env(),
      timeout=300, check=False)
  assert proc.returncode == 2
  assert "--rounds 5 must be in [1, --steps - --time-from = 4]" in proc.stderr


def _e2e_module():
  for folder in (str(ROOT / "examples"), str(ROOT / "bench")):
    if folder not in sys.path:
      sys.path.insert(0, folder)
  import e2e  # noqa: PLC0415  (bench/ is not a package)
  return e2e


def test_embedding_suffix_picks_the_module_and_the_step_peers():
  """`<base>_jqembed` / `_flaxembed` force the model's embedding module; a row's ratios are
  taken against the bf16 and Flax rows of the same embedding and timing mode."""
  e2e = _e2e_module()
  import e2e_model  # noqa: PLC0415
  assert e2e.split_variant("flax_fp8_direct_jqembed@noepi+fetch") == (
      "flax_fp8_direct", "jaxquant", "noepi")
  assert [e2e.embedding_of(v) for v in ("bf16", "modules_bf16", "modules_bf16_flaxembed",
                                        "bf16_jqembed+fetch")] == [
      "flax", "jaxquant", "flax", "jaxquant"]
  cfg = e2e_model.SIZES["tiny"]
  flax_embed, jq_embed = "flax.linen.linear.Embed", "jaxquant.flax.embed.Embed"
  for name, want in (("bf16", flax_embed), ("modules_fp8_current", jq_embed),
                     ("bf16_jqembed", jq_embed), ("modules_bf16_flaxembed", flax_embed)):
    model, _, _ = e2e.build_variant(name, cfg, True)
    tokens = jnp.zeros((1, cfg.seq), jnp.int32)
    modules = {type(m).__module__ + "." + type(m).__name__
               for m in _submodules(model, tokens) if type(m).__name__ == "Embed"}
    assert modules == {want}, (name, modules)
  rows = [dict(variant=v, step_ms=1.0) for v in (
      "bf16", "flax_fp8_direct", "flax_fp8_direct_jqembed", "modules_bf16", "modules_fp8_delayed",
      "modules_fp8_delayed_flaxembed", "modules_bf16_flaxembed", "bf16+fetch",
      "modules_bf16+fetch", "modules_fp8_delayed+fetch", "modules_fp8_delayed@noepi")]
  by = {r["variant"]: r for r in rows}
  name = lambda row: row and row["variant"]
  peers = lambda v: tuple(map(name, e2e.peer_rows(by[v], rows)))
  assert peers("modules_fp8_delayed") == ("modules_bf16", "flax_fp8_direct_jqembed",
                                          "modules_bf16")
  assert peers("modules_fp8_delayed@noepi") == peers("modules_fp8_delayed")
  assert peers("modules_fp8_delayed_flaxembed") == ("modules_bf16_flaxembed", "flax_fp8_direct",
                                                    "modules_bf16_flaxembed")
  assert peers("modules_fp8_delayed+fetch") == ("modules_bf16+fetch", None, "modules_bf16")
  assert peers("flax_fp8_direct") == ("bf16", "flax_fp8_direct", "bf16")


def _submodules(model, tokens):
  """Every module instance bound while `model` initializes on `tokens`."""
  import flax.linen as nn  # noqa: PLC0415
  seen = []
  def record(next_fun, args, kwargs, context):
    seen.append(context.module)
    return next_fun(*args, **kwargs)
  with nn.intercept_methods(record):
    jax.eval_shape(model.init, jax.random.key(0), tokens)
  return seen


def test_the_embedding_changes_the_gradient_not_the_forward(tmp_path):
  """The tiny model with either embedding: the same first loss (the lookup is the same), then
  trajectories that part by the embedding gradient's rounding only."""
  _, rows = _e2e(tmp_path, "embed", "--variants", "modules_bf16,modules_bf16_flaxembed")
  jq_row, flax_row = rows["modules_bf16"], rows["modules_bf16_flaxembed"]
  assert jq_row["loss_1"] == flax_row["loss_1"]
  assert jq_row["loss_last"] == pytest.approx(flax_row["loss_last"], rel=0.01)
