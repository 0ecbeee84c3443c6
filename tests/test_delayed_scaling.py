"""Delayed scaling (docs/design.md §5 "Numerics"): quantize with the stored scale, then update
the amax
history and the scale; values worked out by hand step by step."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxquant as jq
import oracle
from helpers import data_codes, quantize, rowwise

pytestmark = pytest.mark.usefixtures("core_backend")

DELAYED = jq.Float8DelayedScalingQuantizer


def _state(scale, history):
  return jq.DelayedScalingState(jnp.float32(scale), jnp.asarray(history, jnp.float32))


def _steps(quantizer, amaxes, state=None):
  """[(scale, history)] after each `delayed_scaling_update` (jitted: one compilation)."""
  update = jax.jit(jq.delayed_scaling_update, static_argnums=2)
  state = jq.init_state(quantizer) if state is None else state
  out = []
  for amax in amaxes:
    state = update(state, jnp.float32(amax), quantizer)
    out.append((float(state.scale), np.asarray(state.amax_history).tolist()))
  return out


def test_init_state_is_no_scale_yet_and_zero_history():
  state = jq.init_state(DELAYED(amax_history_len=5))
  assert float(state.scale) == 0.0 and state.scale.dtype == jnp.float32  # 0: none yet
  assert np.asarray(state.amax_history).tolist() == [0.0] * 5
  assert float(jq.init_state(DELAYED(first_scale="one")).scale) == 1.0  # TE's start
  assert jq.init_state(DELAYED()).amax_history.shape == (1024,)  # TE's default length
  assert jq.init_state(jq.MXFP8Quantizer()) is None


def test_quantizes_with_the_stored_scale_hand_bytes():
  # stored scale 2 (scale_inv 0.5), E4M3:
  #  100  -> 200: quantum 16 -> 12.5 quanta, a tie -> even 12 -> 192 = 1.5 * 2^7 -> 0x74
  # -300  -> -600 > 448: saturates -> 0xFE
  #  0.75 -> 1.5 -> 0 0111 100 = 0x3C;  0 -> 0x00
  q = DELAYED(amax_history_len=4)
  t = rowwise(jnp.array([[100.0, -300.0, 0.75, 0.0]], jnp.float32), q,
              state=_state(2.0, [0, 0, 0, 0]))
  assert data_codes(t).tolist() == [[0x74, 0xFE, 0x3C, 0x00]]
  assert float(t.scale_inv) == 0.5 and float(t.amax) == 300.0


def test_special_values_are_quantized_with_the_stored_scale():
  # scale 2: +-inf saturate (0x7E, 0xFE); NaN -> 0x7F; 1e-40 * 2 < 2^-10 -> 0x00; -0.0 -> 0x80;
  # 1 -> 2 = 0 1000 000 = 0x40. The amax is NaN (propagates), so the update keeps the scale.
  q = DELAYED(amax_history_len=2)
  state = _state(2.0, [0, 0])
  t = rowwise(jnp.array([[np.inf, -np.inf, np.nan, 1e-40, -0.0, 1.0]], jnp.float32), q,
              state=state)
  assert data_codes(t).tolist() == [[0x7E, 0xFE, 0x7F, 0x00, 0x80, 0x40]]
  assert np.isnan(float(t.amax))
  assert float(jq.delayed_scaling_update(state, t.amax, q).scale) == 2.0


def test_max_algorithm_over_a_rolling_history():
  # L = 3, "max", margin 0, E4M3 (fmax 448); each step: hist[0] = amax, a = max(hist),
  # scale = 448 / a, then roll by -1 and zero hist[0]:
  # amax 2: hist [2,0,0] -> a 2 -> 224; roll -> [0,0,2] -> zero [0] -> [0,0,2]
  # amax 8: hist [8,0,2] -> a 8 -> 56;  roll -> [0,2,8] -> [0,2,8]
  # amax 1: hist [1,2,8] -> a 8 -> 56;  roll -> [2,8,1] -> [0,8,1]
  # amax 4: hist [4,8,1] -> a 8 -> 56;  roll -> [8,1,4] -> [0,1,4]   (8 falls out)
  # amax .5: hist [.5,1,4] -> a 4 -> 112; roll -> [1,4,.5] -> [0,4,.5]
  assert _steps(DELAYED(amax_history_len=3), [2, 8, 1, 4, 0.5]) == [
      (224.0, [0, 0, 2]), (56.0, [0, 2, 8]), (56.0, [0, 8, 1]), (56.0, [0, 1, 4]),
      (112.0, [0, 4, 0.5])]


def test_most_recent_algorithm_uses_only_the_current_amax():
  # same amaxes as above; scale = 448 / amax each step; history rolls the same way
  got = _steps(DELAYED(amax_history_len=3, amax_compute_algo="most_recent"), [2, 8, 1, 4])
  assert [s for s, _ in got] == [224.0, 56.0, 448.0, 112.0]
  assert got[-1][1] == [0, 1, 4]


def test_margin_divides_the_scale_by_two_to_the_margin():
  # margin 2: scale = 448 / a / 4. L = 2: amax 7 -> 16; amax 3.5 (max(3.5, 7) = 7) -> 16;
  # amax 1: the 7 has rolled out, max(1, 3.5) = 3.5 -> 448 / 3.5 / 4 = 32
  assert [s for s, _ in _steps(DELAYED(amax_history_len=2, margin=2), [7, 3.5, 1])] == [
      16.0, 16.0, 32.0]


def test_e5m2_uses_its_own_fmax():
  # 57344 / 7 = 8192
  assert _steps(DELAYED(jnp.float8_e5m2, amax_history_len=2), [7])[0][0] == 8192.0


@pytest.mark.parametrize("bad", [np.inf, np.nan, 0.0], ids=["inf", "nan", "zero"])
def test_non_finite_or_zero_amax_keeps_the_scale(bad):
  # L = 2. step 1: hist [4, 0] -> 448 / 4 = 112, history after the roll [0, 4].
  # step 2: hist [bad, 4] -> a = max(bad, 4): inf or NaN (NaN propagates) -> keep 112; for a
  #   zero amax a = 4 -> 112 again. History after the roll: [0, bad] (the 4 falls out).
  # step 3: hist [2, bad] -> a = max(2, bad): inf / NaN -> keep 112; zero -> 448 / 2 = 224.
  # step 4: hist [2, 2] -> 224 in every case (the bad value has rolled out).
  got = _steps(DELAYED(amax_history_len=2), [4.0, bad, 2.0, 2.0])
  assert [s for s, _ in got] == [112.0, 112.0, 224.0 if bad == 0.0 else 112.0, 224.0]
  if not np.isnan(bad):
    assert got[1][1] == [0.0, bad]


def test_scale_is_clamped_to_flt_max():
  # amax 1e-37: 448 / 1e-37 overflows -> FLT_MAX
  assert _steps(DELAYED(amax_history_len=1), [1e-37])[0][0] == float(oracle.FLT_MAX)


def test_update_state_feeds_the_quantized_tensors_amax(rng):
  q = DELAYED(amax_history_len=4)
  x = jnp.asarray(oracle.random_matrix(rng, (8, 16)))
  state = _state(3.0, [0, 5.0, 0.25, 0])
  qt = quantize(x, q, state=state)
  new = jq.update_state(q, state, qt)
  want = jq.delayed_scaling_update(state, jnp.max(jnp.abs(x)), q)
  assert float(new.scale) == float(want.scale)
  np.testing.assert_array_equal(np.asarray(new.amax_history), np.asarray(want.amax_history))
  a = max(float(jnp.max(jnp.abs(x))), 5.0)
  assert float(new.scale) == float(np.float32(448) / np.float32(a))


@pytest.mark.parametrize("first_scale", ["current", "one"])
def test_three_training_steps_use_the_previous_steps_scale(rng, first_scale):
  """Step t > 1 quantizes with the scale computed after step t-1 (never the current amax);
  step 1 with the scale of its own amax ("current") or with 1 ("one")."""
  q = DELAYED(amax_history_len=8, first_scale=first_scale)

  @jax.jit
  def step(state, x):
    qt = jq.ops.quantize(x, q, columnwise=False, state=state)
    return jq.update_state(q, state, qt), qt.rowwise

  state = jq.init_state(q)
  xs = [jnp.asarray(oracle.random_matrix(rng, (4, 32), spread=False)) * s for s in (1, 10, 3)]
  running_max = 0.0
  for i, x in enumerate(xs):
    if i == 0:
      amax = np.float32(jnp.max(jnp.abs(x)))
      expected_scale = float(np.float32(448) / amax) if first_scale == "current" else 1.0
    else:
      expected_scale = float(np.float32(448) / np.float32(running_max))
    state, t = step(state, x)
    assert float(t.scale_inv) == float(np.float32(1) / np.float32(expected_scale)), i
    want = oracle.cast_codes(oracle.f32(x) * np.float32(expected_scale), oracle.E4M3)
    np.testing.assert_array_equal(data_codes(t), want)
    running_max = max(running_max, float(jnp.max(jnp.abs(x))))


def test_hybrid_state_is_a_pair_updated_per_direction(rng):
  q = jq.HybridQuantizer(rowwise=DELAYED(amax_history_len=2),
                         columnwise=DELAYED(jnp.float8_e5m2, amax_history_len=3))
  state = jq.init_state(q)
  assert isinstance(state, tuple) and len(state) == 2
  assert state[0].amax_history.shape == (2,) and state[1].amax_history.shape == (3,)
  x = jnp.asarray(oracle.random_matrix(rng, (16, 16)))
  new = jq.update_state(q, state, quantize(x, q, state=state))
  amax = np.float32(jnp.max(jnp.abs(x)))
  assert float(new[0].scale) == float(np.float32(448) / amax)
  assert float(new[1].scale) == float(np.float32(57344) / amax)
