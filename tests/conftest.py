"""Shared fixtures: random inputs drawn fresh each run, with the seed recorded.

`rng` is a `numpy.random.Generator` seeded from `secrets` (or from `JAXQUANT_TEST_SEED` to replay
a failure); `prng_key` is a JAX key from the same seed. The seed is printed (visible with `-s` or
in the captured output of a failing test) and appended to the report of every failing test that
used either fixture, so any failure can be reproduced with `JAXQUANT_TEST_SEED=<seed>`.

The suite compiles many small programs and almost no time is spent running them, so XLA's LLVM
backend optimization level is lowered to 0 (about 30% less CPU; IEEE float semantics do not
depend on it). Set `--xla_backend_optimization_level` in `XLA_FLAGS` to choose another level.
"""

from __future__ import annotations

import os
import secrets

if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             " --xla_backend_optimization_level=0").strip()

# tests/multidevice needs 8 host devices, set before jax starts: it runs in its own process
# (tests/test_multidevice.py launches it with JAXQUANT_MULTIDEVICE=1).
collect_ignore = [] if os.environ.get("JAXQUANT_MULTIDEVICE") == "1" else ["multidevice"]

import jax  # noqa: E402  (after XLA_FLAGS)
import numpy as np  # noqa: E402
import pytest  # noqa: E402


@pytest.fixture
def seed(request) -> int:
  value = os.environ.get("JAXQUANT_TEST_SEED")
  value = int(value) if value else secrets.randbits(31)
  request.node.jaxquant_seed = value
  print(f"[jaxquant tests] {request.node.nodeid}: seed={value} "
        f"(replay with JAXQUANT_TEST_SEED={value})")
  return value


@pytest.fixture
def rng(seed) -> np.random.Generator:
  return np.random.default_rng(seed)


@pytest.fixture
def prng_key(seed) -> jax.Array:
  return jax.random.key(seed)


@pytest.fixture
def core_backend(monkeypatch):
  """Run on the reference path (the specification) unless `JAXQUANT_BACKEND` is set, so the
  core tests check the spec even where the FFI extension is built; run the same tests with
  `JAXQUANT_BACKEND=ffi` to hold the kernels to the same expectations."""
  if not os.environ.get("JAXQUANT_BACKEND"):
    monkeypatch.setenv("JAXQUANT_BACKEND", "reference")


# Tests of a minute or more on two cores (whole training runs, several processes, the
# multi-device parts), started first: under `-n 2 --dist worksteal` (the README's command) the
# worker holding them runs them while the other drains the short tests and steals the rest, so
# no long test starts last beside an idle worker (the last tenth of a run took ~9 minutes so).
LONG_TESTS = ("test_multidevice.py::", "test_checkpoint.py::", "test_multiprocess.py::test_two_",
              "test_multiprocess.py::test_a_checkpoint", "test_weights_once.py::test_grad_accum",
              "test_weights_once.py::test_train_lm", "test_examples.py::",
              "test_grouped_moe.py::test_train_lm", "test_format_completeness.py::test_every_layer")


def pytest_collection_modifyitems(config, items):
  """The long tests first, in `LONG_TESTS`'s order (longest first), then the rest as collected
  (a stable sort)."""
  def rank(item) -> int:
    return next((i for i, name in enumerate(LONG_TESTS) if name in item.nodeid), len(LONG_TESTS))
  items.sort(key=rank)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
  report = yield
  seed_value = getattr(item, "jaxquant_seed", None)
  if seed_value is not None and report.failed:
    report.sections.append(("jaxquant seed", f"JAXQUANT_TEST_SEED={seed_value}"))
  return report
