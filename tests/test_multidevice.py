"""Runs tests/multidevice in fresh processes with 8 host CPU devices.

XLA's CPU backend exposes several devices only if `--xla_force_host_platform_device_count` is
set before it starts, which this process cannot do any more (and the rest of the suite runs on
one device). The directory is split into `SHARDS` interleaved parts (`--jaxquant-shard`,
tests/multidevice/conftest.py), one test per part, each running its part in one child process:
pytest-xdist hands the parts to its workers like any other test, so the ~8 CPU-minutes of
multi-device tests spread over the workers (a process per core: they are compile-bound and
XLA compiles a program on one thread) instead of holding one worker for all of them. Every
test of the directory is in exactly one part. A part's summary and failures are shown when it
fails.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

TESTS = pathlib.Path(__file__).resolve().parent
# Parts of ~1-2 CPU-minutes each: small enough that xdist's workers finish together, large
# enough that each child's start (jax import, 8 devices) stays a small share of its time.
SHARDS = 6


@pytest.mark.multidevice
@pytest.mark.parametrize("shard", range(SHARDS), ids=lambda i: f"part{i}of{SHARDS}")
def test_multidevice_suite_on_8_host_devices(shard):
  env = dict(os.environ, JAXQUANT_MULTIDEVICE="1", JAX_PLATFORMS="cpu")
  child = subprocess.run(
      [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
       f"--jaxquant-shard={shard}/{SHARDS}", str(TESTS / "multidevice")],
      cwd=TESTS.parent, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
      timeout=1500)
  lines = [line for line in child.stdout.splitlines() if not line.startswith("[jaxquant tests]")]
  print(f"--- tests/multidevice part {shard}/{SHARDS}:\n" + "\n".join(lines[-5:]))
  # pytest's exit code 5: the part collected no tests (a sharding error), a failure too.
  assert child.returncode == 0, (
      f"tests/multidevice part {shard}/{SHARDS} failed (exit {child.returncode}):\n" +
      "\n".join(lines[-80:]))
