"""Multi-device tests: 8 host CPU devices in CI, or the 2, 4 or 8 GPUs of the machine.

These tests need several devices, which XLA's CPU backend only provides when
`--xla_force_host_platform_device_count` is set before the backend starts. So this directory is
collected only in a process that asked for it (`JAXQUANT_MULTIDEVICE=1`, set by the launcher
`tests/test_multidevice.py`, which `python -m pytest tests` runs), and this conftest adds the
flag (next to the suite's own XLA_FLAGS) before any test starts jax:

    JAXQUANT_MULTIDEVICE=1 python -m pytest -q tests/multidevice     # directly (CPU or GPUs)
"""

from __future__ import annotations

import os

DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count=8"

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + DEVICE_COUNT_FLAG).strip()

import jax  # noqa: E402
import pytest  # noqa: E402


def pytest_addoption(parser):
  parser.addoption("--jaxquant-shard", default="0/1",
                   help="I/N: run the I-th of N interleaved parts of the multidevice tests (the "
                   "launcher runs N processes side by side)")


def pytest_collection_modifyitems(config, items):
  index, count = (int(v) for v in config.getoption("--jaxquant-shard").split("/"))

  def shard(i: int) -> int:  # snake order 0,1,1,0,...: neighbours (one parameter apart) split
    p = i % (2 * count)
    return p if p < count else 2 * count - 1 - p

  def group(item):  # tests sharing a compiled single-device program stay in one process
    params = item.callspec.params if hasattr(item, "callspec") else {}
    if "recipe_name" in params:
      return (params["recipe_name"], params.get("backend"))
    return item.nodeid

  groups = {g: shard(i) for i, g in enumerate(dict.fromkeys(group(item) for item in items))}
  keep = [item for item in items if groups[group(item)] == index]
  if len(keep) != len(items):
    config.hook.pytest_deselected(items=[item for item in items if item not in keep])
    items[:] = keep
  for item in items:
    item.add_marker(pytest.mark.multidevice)


@pytest.fixture(scope="session")
def devices():
  """The devices the meshes use: 8, 4 or 2 of them (the most of these the machine has: 8 host
  CPUs in CI, 2 or 4 GPUs); `sharded.make_mesh` shapes its meshes to the count."""
  found = jax.devices()
  if len(found) < 2:
    pytest.fail(f"multi-device tests need >= 2 devices, got {len(found)}: start them through "
                "tests/test_multidevice.py or with JAXQUANT_MULTIDEVICE=1 in a fresh process")
  return found[:max(n for n in (2, 4, 8) if n <= len(found))]
