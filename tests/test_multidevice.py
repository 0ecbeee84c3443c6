"""Runs tests/multidevice in fresh processes with 8 host CPU devices.

XLA's CPU backend exposes several devices only if `--xla_force_host_platform_device_count` is
set before it starts, which this process cannot do any more (and the rest of the suite runs on
one device). The tests are split over one process per core (they are compile-bound and XLA
compiles a program on one thread); each child's summary and failures are shown when it fails.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

TESTS = pathlib.Path(__file__).resolve().parent


@pytest.mark.multidevice
def test_multidevice_suite_on_8_host_devices():
  env = dict(os.environ, JAXQUANT_MULTIDEVICE="1", JAX_PLATFORMS="cpu")
  count = max(1, min(2, os.cpu_count() or 1))
  children = [subprocess.Popen(
      [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
       f"--jaxquant-shard={i}/{count}", str(TESTS / "multidevice")],
      cwd=TESTS.parent, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
      for i in range(count)]
  failures = []
  for i, child in enumerate(children):
    out, _ = child.communicate(timeout=1500)
    lines = [line for line in out.splitlines() if not line.startswith("[jaxquant tests]")]
    print(f"--- tests/multidevice shard {i}/{count}:\n" + "\n".join(lines[-5:]))
    if child.returncode != 0:
      failures.append(f"--- shard {i}/{count} (exit {child.returncode}):\n" +
                      "\n".join(lines[-80:]))
  assert not failures, "tests/multidevice failed:\n" + "\n".join(failures)
