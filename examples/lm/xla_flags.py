"""XLA flags that let a sharded training step overlap its collectives with compute on GPUs.

`train_lm.py` and `bench/scaling.py` add these to `XLA_FLAGS` before JAX starts its backend
(`--no-xla-overlap` leaves `XLA_FLAGS` alone); flags already present in `XLA_FLAGS` win:

* `--xla_gpu_enable_latency_hiding_scheduler`: schedule the async collectives (all-reduce,
  reduce-scatter, all-gather, all-to-all start/done pairs) so that independent compute runs
  between a start and its done, e.g. a layer's weight-gradient reduction during the previous
  layer's backward GEMMs.
* `--xla_gpu_enable_pipelined_{all_reduce,reduce_scatter}`: XLA's collective pipeliner moves
  a collective of one iteration of a while loop (the `--scan-layers` loop over the blocks) into
  the next iteration, so it overlaps that iteration's compute instead of ending its own. The
  all-gather pipeliner is left off: with the double buffering below, jax 0.11.2's XLA failed to
  compile an `fsdp=4` step on H100s (`RET_CHECK ... all-gather-done is not scheduled after its
  control predecessor`); without it the same step compiled and ran.
* `--xla_gpu_enable_while_loop_double_buffering`: unrolls that loop by two so the pipelined
  collectives have compute of the other iteration to hide behind.
* `--xla_gpu_enable_highest_priority_async_stream`: collectives' stream at the highest priority,
  so a collective is not starved by the compute it overlaps.

All are `xla_gpu_*` debug options: ignored by the CPU backend, understood by the jaxlib these
examples run with (0.10-0.11). An XLA that dropped one stops at start-up naming it
(`Unknown flags in XLA_FLAGS`); `--no-xla-overlap` then runs without them.
"""

from __future__ import annotations

import os

OVERLAP_FLAGS = (
    "--xla_gpu_enable_latency_hiding_scheduler=true",
    "--xla_gpu_enable_pipelined_all_reduce=true",
    "--xla_gpu_enable_pipelined_reduce_scatter=true",
    "--xla_gpu_enable_while_loop_double_buffering=true",
    "--xla_gpu_enable_highest_priority_async_stream=true",
)


def with_overlap_flags(xla_flags: str) -> str:
  """`xla_flags` plus every overlap flag whose name it does not set already."""
  present = {f.split("=", 1)[0] for f in xla_flags.split()}
  extra = [f for f in OVERLAP_FLAGS if f.split("=", 1)[0] not in present]
  return " ".join([xla_flags.strip()] + extra).strip()


def apply_overlap_flags(enabled: bool = True) -> str:
  """Add the overlap flags to `$XLA_FLAGS` (call before JAX initializes its backend; later it
  has no effect). Returns the resulting `XLA_FLAGS`."""
  if enabled:
    os.environ["XLA_FLAGS"] = with_overlap_flags(os.environ.get("XLA_FLAGS", ""))
  return os.environ.get("XLA_FLAGS", "")
