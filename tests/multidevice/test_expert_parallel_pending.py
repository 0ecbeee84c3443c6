"""The experts' MXFP8 dgrad copy patched in place (design decision 56) inside an expert-parallel
`shard_map`: each device patches its own experts' forward copy after its own forward GEMM.

On the host CPU devices the bfloat16 grouped kernel's CPU handler stands in for the CUDA kernel
(as `tests/test_grouped_bf16.py`'s `bf16_device` fixture does), so the forward copy is written in
the weights' layout and the patch runs; on GPUs the CUDA kernels run. The sharded step must be
bit for bit each device's step run alone, and the compiled program must update the forward copy
in place (no copy before the patch call).

    JAXQUANT_MULTIDEVICE=1 python -m pytest -q tests/multidevice/test_expert_parallel_pending.py
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

import jaxquant as jq
from jaxquant.backends.ffi import registry
from jaxquant.backends.ffi.grouped import bf16, decoded, sm90_configs, support
from jaxquant.layers.dense import DenseQuantizers
from jaxquant.layers.grouped_dense import grouped_dense

PATCH = "jaxquant_grouped_patch_mxfp8_rows"
EXPERTS_PER_DEVICE, TOKENS_PER_DEVICE, K, N = 4, 128, 64, 96


@pytest.fixture
def bf16_kernel(monkeypatch):
  """The bfloat16 grouped kernel served (its CPU handler on host devices), default config."""
  if PATCH not in registry.registered_targets(jax.default_backend()):
    pytest.skip(f"jaxquant FFI extension without {PATCH}")
  if jax.default_backend() == "cpu":
    monkeypatch.setattr(bf16, "device_reason", lambda platform=None: None)
  elif bf16.device_reason() is not None:
    pytest.skip(bf16.device_reason())
  monkeypatch.setenv(sm90_configs.ENV, "bf16")
  monkeypatch.delenv(decoded.KERNEL_ENV, raising=False)
  monkeypatch.delenv(support.DGRAD_COPY_ENV, raising=False)
  monkeypatch.delenv("JAXQUANT_BACKEND", raising=False)


def test_expert_parallel_patch_is_each_devices_own(bf16_kernel, rng):
  devices = jax.devices()[:2]
  if len(devices) < 2:
    pytest.skip("needs 2 devices")
  count = len(devices)
  mesh = Mesh(np.array(devices), ("ep",))
  x = jnp.asarray(rng.standard_normal((count * TOKENS_PER_DEVICE, K)), jnp.bfloat16)
  w = jnp.asarray(rng.standard_normal((count * EXPERTS_PER_DEVICE, K, N)) * 0.1, jnp.bfloat16)
  dy = jnp.asarray(rng.standard_normal((count * TOKENS_PER_DEVICE, N)), jnp.bfloat16)
  sizes = jnp.asarray(np.concatenate([rng.multinomial(TOKENS_PER_DEVICE,
                                                      [1 / EXPERTS_PER_DEVICE] * 4)
                                      for _ in range(count)]), jnp.int32)
  quantizers = DenseQuantizers.from_recipe(jq.recipes.MXFP8BlockScaling(), "grouped_linear",
                                           "experts")

  def step(x, w, sizes, dy):
    y, vjp = jax.vjp(lambda x, w: grouped_dense(x, w, sizes, quantizers=quantizers), x, w)
    return (y,) + vjp(dy)

  sharded = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P("ep"),) * 4,
                                  out_specs=(P("ep"),) * 3, check_vma=False))
  out = sharded(x, w, sizes, dy)
  split = lambda a, i, n: a[i * n:(i + 1) * n]
  alone = [jax.jit(step)(split(x, i, TOKENS_PER_DEVICE), split(w, i, EXPERTS_PER_DEVICE),
                         split(sizes, i, EXPERTS_PER_DEVICE), split(dy, i, TOKENS_PER_DEVICE))
           for i in range(count)]
  for j, name in enumerate(("y", "dx", "dw")):
    expected = np.concatenate([np.asarray(a[j]) for a in alone])
    np.testing.assert_array_equal(np.asarray(out[j]).view(np.uint16),
                                  expected.view(np.uint16), err_msg=name)

  lines = sharded.lower(x, w, sizes, dy).compile().as_text().splitlines()
  calls = [line for line in lines if f'custom_call_target="{PATCH}"' in line]
  assert len(calls) == 1, calls
  operand = re.search(r"custom-call\(([^)]*)\)", calls[0]).group(1).split(", ")[2]
  producer = [line for line in lines if re.match(rf"\s*(ROOT )?{re.escape(operand)} = ", line)]
  assert producer and " copy(" not in producer[0], producer  # the forward copy, in place
