"""The ragged expert exchange's arithmetic (`jaxquant.expert_parallel.ragged`) against numpy, and
the choice between the exchanges (`jaxquant.expert_parallel.choose`), on one CPU device.

`ragged_all_to_all` itself does not run on XLA:CPU; here its documented semantics are simulated
in numpy (`simulate_ragged_all_to_all`) on the offsets the library computes, and the result must
be the layout the fixed-size exchange produces: each receiver's rows grouped by local expert,
senders in order within an expert, zero rows after. tests/multidevice/test_expert_parallel_ragged.py
runs the real collective on GPUs.
"""

from __future__ import annotations

import numpy as np
import pytest
from jax.sharding import AbstractMesh

from jaxquant import expert_parallel
from jaxquant.expert_parallel import ragged

SHAPES = [(2, 1), (2, 4), (4, 2), (8, 1), (4, 3)]  # (ep, local experts)


def random_counts(rng, ep: int, local: int) -> np.ndarray:
  """`[ep, E]` assignments per (sender, expert), with empty experts and empty senders."""
  counts = rng.integers(0, 6, size=(ep, ep * local))
  counts[rng.random(counts.shape) < 0.25] = 0
  counts[rng.integers(ep)] = 0 if rng.random() < 0.5 else counts[rng.integers(ep)]
  return counts.astype(np.int32)


def oracle_send_plan(counts: np.ndarray, device: int, local: int):
  """Loop form: walk each receiver's experts, then senders, handing out rows in turn."""
  ep, experts = counts.shape
  write = np.zeros((ep, experts), np.int64)  # [sender, expert]: start on the expert's device
  for receiver in range(ep):
    cursor = 0
    for e in range(receiver * local, (receiver + 1) * local):
      for sender in range(ep):
        write[sender, e] = cursor
        cursor += counts[sender, e]
  input_offsets = np.concatenate([[0], np.cumsum(counts[device])[:-1]])
  recv_sizes = np.array([counts[s, device * local + e] for s in range(ep) for e in range(local)])
  return input_offsets, counts[device], write[device], recv_sizes, write


def simulate_ragged_all_to_all(operands, outputs, plans):
  """`jax.lax.ragged_all_to_all`'s docstring, per device `d` with `plans[d]` = (input_offsets,
  send_sizes, output_offsets, recv_sizes): slice `i` of `d` goes to device `i // per_device`,
  written there at `output_offsets[i]`."""
  results = [np.array(o, copy=True) for o in outputs]
  ep = len(operands)
  for sender, (input_offsets, send_sizes, output_offsets, _) in enumerate(plans):
    per_device = len(input_offsets) // ep
    for i in range(len(input_offsets)):
      receiver, size = i // per_device, send_sizes[i]
      # the receiver's recv_sizes must agree with what is sent
      assert plans[receiver][3][sender * per_device + i % per_device] == size
      results[receiver][output_offsets[i]:output_offsets[i] + size] = (
          operands[sender][input_offsets[i]:input_offsets[i] + size])
  return results


def sorted_rows(rng, counts_row: np.ndarray, width: int = 3) -> np.ndarray:
  """A sender's rows sorted by expert, each row tagged (sender-unique random values)."""
  return rng.standard_normal((int(counts_row.sum()), width))


@pytest.mark.parametrize("ep,local", SHAPES)
def test_send_plan_equals_the_loop_oracle(ep, local, rng):
  counts = random_counts(rng, ep, local)
  for device in range(ep):
    *want, write = oracle_send_plan(counts, device, local)
    got = ragged.send_plan(counts, device, local)
    for name, g, w in zip(("input_offsets", "send_sizes", "output_offsets", "recv_sizes"),
                          got, want):
      np.testing.assert_array_equal(np.asarray(g), w, err_msg=f"{name} of device {device}")
    np.testing.assert_array_equal(
        np.asarray(ragged.write_offsets(counts, local)).reshape(ep, -1), write)


@pytest.mark.parametrize("ep,local", SHAPES)
def test_the_exchange_delivers_the_fixed_paths_layout(ep, local, rng):
  """Receiver r: rows of its local expert 0 from sender 0, 1, ..., then expert 1, ...; zeros
  after the last real row; `received_group_sizes` counts them."""
  counts = random_counts(rng, ep, local)
  assignments = int(counts.sum(axis=1).max()) + 1  # each device's static A
  sent = [sorted_rows(rng, counts[s]) for s in range(ep)]
  operands = [np.concatenate([rows, np.full((assignments - len(rows), 3), np.nan)])
              for rows in sent]  # junk past the real rows must not travel
  plans = [[np.asarray(a) for a in ragged.send_plan(counts, d, local)] for d in range(ep)]
  received = simulate_ragged_all_to_all(operands, [np.zeros((ep * assignments, 3))] * ep, plans)
  starts = np.concatenate([np.zeros((ep, 1), np.int64), np.cumsum(counts, axis=1)], axis=1)
  for r in range(ep):
    want = [sent[s][starts[s, e]:starts[s, e + 1]]
            for e in range(r * local, (r + 1) * local) for s in range(ep)]
    want = np.concatenate(want)
    np.testing.assert_array_equal(received[r][:len(want)], want)
    assert not received[r][len(want):].any()
    sizes = np.asarray(ragged.received_group_sizes(counts, r, local))
    np.testing.assert_array_equal(sizes, counts[:, r * local:(r + 1) * local].sum(axis=0))
    assert sizes.sum() == len(want)


@pytest.mark.parametrize("ep,local", SHAPES)
def test_the_return_plan_brings_every_row_home(ep, local, rng):
  counts = random_counts(rng, ep, local)
  assignments = int(counts.sum(axis=1).max())
  sent = [np.concatenate([sorted_rows(rng, counts[s]),
                          np.zeros((assignments - counts[s].sum(), 3))]) for s in range(ep)]
  plans = [[np.asarray(a) for a in ragged.send_plan(counts, d, local)] for d in range(ep)]
  received = simulate_ragged_all_to_all(sent, [np.zeros((ep * assignments, 3))] * ep, plans)
  outputs = [received[r] * 2.0 + 1.0 for r in range(ep)]  # an "expert" on every row
  back_plans = [[np.asarray(a) for a in ragged.return_plan(counts, d, local)]
                for d in range(ep)]
  back = simulate_ragged_all_to_all(outputs, [np.zeros((assignments, 3))] * ep, back_plans)
  for s in range(ep):
    real = int(counts[s].sum())
    np.testing.assert_array_equal(back[s][:real], sent[s][:real] * 2.0 + 1.0)


def _layout(ep: int = 4, **kwargs) -> expert_parallel.ExpertSharding:
  mesh = AbstractMesh((2, ep), ("dp", "ep"))
  return expert_parallel.ExpertSharding(mesh, ("dp", "ep"), "ep", 8, **kwargs)


@pytest.mark.parametrize("kwargs,platform,path,reason", [
    ({}, "cuda", "all-to-all", "measured slower than the fixed-size exchange"),
    ({}, "cpu", "all-to-all", "XLA:CPU does not compile ragged_all_to_all"),
    ({"capacity_factor": 1.5}, "cuda", "all-to-all", "capacity_factor=1.5"),
    ({"exchange": "fixed"}, "cuda", "all-to-all", "exchange='fixed' asked for"),
    ({"exchange": "ragged"}, "cpu", "ragged-all-to-all", ""),
], ids=["auto-cuda", "auto-cpu", "capacity", "fixed", "ragged-forced"])
def test_choose_takes_the_ragged_exchange_only_when_asked_or_measured_faster(kwargs, platform,
                                                                           path, reason):
  got_path, got_reason = expert_parallel.choose(_layout(**kwargs), platform)
  assert got_path == path
  assert (reason in got_reason) if reason else got_reason == ""


def test_choose_sends_nothing_without_an_expert_axis():
  layout = expert_parallel.ExpertSharding(AbstractMesh((4,), ("dp",)), ("dp",), None, 8)
  assert expert_parallel.choose(layout, "cuda") == ("local", "")


def test_a_bad_exchange_name_is_an_error():
  with pytest.raises(ValueError, match=r"exchange='ring'; expected one of \('auto', 'ragged', "
                                       r"'fixed'\)"):
    _layout(exchange="ring")


def test_a_capacity_with_the_ragged_exchange_is_an_error():
  with pytest.raises(ValueError, match="exchange='ragged' is dropless"):
    _layout(exchange="ragged", capacity_factor=1.25)
