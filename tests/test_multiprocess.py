"""`examples/train_lm.py` as several processes through `jax.distributed`, on this machine's CPU.

Two processes with 4 host CPU devices each (gloo carries the collectives between them) train
the same tiny model as one process with 8 devices, on the same mesh, from the same parameters
and batches. Each process loads only its rows of every batch, so equal losses also show that the
global batch was assembled right. A checkpoint written by the two processes (each its own
shards, delayed-scaling state included) resumes in two processes bit for bit. A bad launch
(process counts that disagree, a process that never comes, an unreachable coordinator, a mesh
larger than all devices) ends on its own within seconds, naming the flag to fix.

Tolerance of the 2-process vs 1-process losses: the two runs compile the same SPMD program; they
differ only in who carries the collectives (gloo between processes, XLA's in-process CPU
collectives within one), so a sum of partial results (the loss over batch shards, gradients
over data shards, partial GEMM sums over `tp`) may be added in another order. Step 1's loss
(same parameters) may then differ by float32 rounding of an 8-term sum: relative 1e-6. The runs
train with SGD (`--optimizer sgd`), whose update is linear in the gradient, so later steps
inherit differences as small as the gradients' (Adam would turn a reduction-order difference in
a near-zero gradient element into a full-size step of either sign: 5e-4 by step 4 in one run
here), plus the odd element a quantizer rounds into the neighbouring FP8/FP4 code: relative
1e-5 over these four steps for FP8. NVFP4 gradients (the hybrid's backward) have codes a
third apart at the top of a block, so one such flip moves a gradient element by up to a third
of itself: relative 2.3e-4 and 5.6e-4 at steps 3 and 4 in one run here (session 28, replay
with JAXQUANT_TEST_SEED=1773181253), so that recipe's later steps are held to 2e-3. Both stay
far below what a wrong batch row or a missing gradient reduction does (percents). Most runs
here came out equal bit for bit.

Every test here starts processes (`-m "not multiprocess"` deselects them); each is bounded by a
timeout and kills what it started.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import shutil
import signal
import subprocess
import time
import warnings

import jax
import numpy as np
import pytest
from lm import data, distributed, launch, report  # examples/lm: pytest's pythonpath

ROOT = pathlib.Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
TRAIN_LM = str(EXAMPLES / "train_lm.py")
# The smallest model every recipe shards over tp=4 (MXFP8's 32-long blocks on d_model / 4) and
# fsdp=8 (one sequence per device). `--backend auto`: the FFI kernels' CPU handlers where the
# extension is built (as in CI; their steps compile in half the CPU time of the pure-JAX
# reference's, which serves where it is not built).
TINY_LM = ["--d-model", "128", "--layers", "1", "--heads", "4", "--seq", "32", "--batch", "8",
           "--data-mb", "0.3", "--eval-batches", "1", "--no-progress", "--steps", "4",
           "--eval-every", "2", "--lr", "1e-2", "--warmup", "1", "--checkpoint-every", "2",
           "--backend", "auto"]
# One recipe per mesh (both recipes on both meshes took ~1 CPU-minute more): the hybrid's block
# formats (MXFP8 forward, NVFP4 backward) where tp splits d_model into 32-long blocks, and FP8
# current scaling, whose per-tensor amaxes are reduced over every shard, where fsdp splits every
# weight between the processes.
MESH_RECIPES = {"dp=2,tp=4": "mxfp8_fwd_nvfp4_bwd", "fsdp=8": "fp8_current"}
RUN_TIMEOUT = 420  # seconds: a hang ends here, killed (a run takes ~1 min on 2 free cores)
FIRST_STEP_RTOL = 1e-6
LATER_STEPS_RTOL = {"mxfp8_fwd_nvfp4_bwd": 2e-3, "fp8_current": 1e-5}  # per recipe (above)


def _host_devices(count: int) -> dict[str, str]:
  """Environment of a child with `count` host CPU devices (the suite's XLA_FLAGS kept)."""
  flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
           if "xla_force_host_platform_device_count" not in f]
  path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
  return {"XLA_FLAGS": " ".join([*flags, f"--xla_force_host_platform_device_count={count}"]),
          "JAX_PLATFORMS": "cpu", "PYTHONPATH": path}


def _start(args: list[str], processes: int, devices_each: int):
  return launch.LocalRun([TRAIN_LM, *args], processes, env_for=lambda i: _host_devices(
      devices_each), cwd=str(ROOT))


def _finish(run, timeout: float = RUN_TIMEOUT, expect_success: bool = True):
  results = run.wait(timeout)
  if expect_success:
    _assert_succeeded(run, results)
  return results


def _assert_succeeded(run, results) -> None:
  assert all(r.returncode == 0 for r in results), (
      f"a process of `{' '.join(run.processes[0].args[1:])}` failed (a hung one's threads "
      "are listed):\n" + launch.report(results, lines=250))


def _crashed_in_the_runtime(results) -> bool:
  """Whether a process died of a native abort or segfault (Python's faulthandler printed
  "Fatal Python error") rather than of a Python error (exit 1) or a hang (killed: None)."""
  native = {-signal.SIGABRT, -signal.SIGSEGV}
  return any(r.returncode in native and "Fatal Python error" in r.output for r in results)


def _run_all(*runs: tuple) -> list[list]:
  """Start the runs `(args, processes, devices_each[, prepare])` together and wait for them,
  all expected to succeed; a run one of whose processes crashed inside the native runtime is
  run once more, alone, with a warning that shows how the first attempt ended. Returns each
  run's results.

  jaxlib's CPU collectives between processes (gloo, several host devices per process) crash
  now and then in native code: openxla/xla#16430 (segfaults with
  `--xla_force_host_platform_device_count` > 1), and once in CI (2026-11-30) glibc's
  `__pthread_tpp_change_priority` assertion in the first step of a resumed run. A Python error,
  a hang, wrong losses or a second crash still fail the test. `prepare()`, where given, runs
  before each attempt (to restore the files a run changes)."""
  def start(spec):
    args, processes, devices_each, *prepare = spec
    for p in prepare:
      p()
    return stack.enter_context(_start(args, processes, devices_each))

  finished = []
  with contextlib.ExitStack() as stack:  # every run started here is killed on the way out
    started = [start(spec) for spec in runs]
    for spec, run in zip(runs, started, strict=True):
      results = run.wait(RUN_TIMEOUT)
      if _crashed_in_the_runtime(results):
        warnings.warn("a process crashed in the native runtime; running again:\n"
                      + launch.report(results, lines=40), stacklevel=2)
        run = start(spec)
        results = run.wait(RUN_TIMEOUT)
      _assert_succeeded(run, results)
      finished.append(results)
  return finished


def _step_losses(out: pathlib.Path) -> dict[str, list[float]]:
  return {recipe: [loss for loss, _ in rows]
          for recipe, rows in report.read_steps_csv(out / "steps.csv").items()}


def _restore(step_dir: pathlib.Path) -> dict:
  """A checkpoint's arrays, whatever processes wrote them, onto this process's one device."""
  import orbax.checkpoint as ocp  # noqa: PLC0415

  one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  with ocp.StandardCheckpointer() as checkpointer:
    tree = checkpointer.metadata(step_dir / "state").item_metadata.tree
    target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=one), tree)
    return checkpointer.restore(step_dir / "state", target)


@pytest.mark.multiprocess
def test_only_a_native_crash_counts_as_one_in_the_runtime(tmp_path):
  # The retry above must not swallow a Python error or a failed run: only an abort or a
  # segfault that faulthandler reports does.
  def ends_of(code: str):
    script = tmp_path / "child.py"
    script.write_text(code)
    with launch.LocalRun([str(script)], 1) as run:
      return run.wait(60)

  assert _crashed_in_the_runtime(ends_of("import os\nos.abort()\n"))
  assert _crashed_in_the_runtime(ends_of("import ctypes\nctypes.string_at(0)\n"))
  assert not _crashed_in_the_runtime(ends_of("raise RuntimeError('a Python error')\n"))
  assert not _crashed_in_the_runtime(ends_of("import sys\nsys.exit(1)\n"))
  assert not _crashed_in_the_runtime(
      ends_of("import os, signal\nos.kill(os.getpid(), signal.SIGTERM)\n"))


@pytest.mark.multiprocess
@pytest.mark.parametrize("mesh", list(MESH_RECIPES))
def test_two_processes_train_like_one_process_with_all_devices(tmp_path, seed, mesh):
  args = [*TINY_LM, "--recipe", MESH_RECIPES[mesh], "--mesh", mesh, "--seed", str(seed % 10_000),
          "--optimizer", "sgd", "--lr", "0.3"]
  _, results = _run_all(([*args, "--out", str(tmp_path / "one")], 1, 8),
                        ([*args, "--out", str(tmp_path / "two")], 2, 4))
  want, got = _step_losses(tmp_path / "one"), _step_losses(tmp_path / "two")
  assert set(got) == set(want) == {MESH_RECIPES[mesh]}
  for recipe in want:
    assert len(got[recipe]) == len(want[recipe]) == 4
    w, g = np.array(want[recipe]), np.array(got[recipe])
    rel = np.abs(g - w) / np.abs(w)
    assert rel[0] <= FIRST_STEP_RTOL and rel.max() <= LATER_STEPS_RTOL[recipe], (
        f"{recipe} on {mesh}: 2 processes {g.tolist()} vs 1 process {w.tolist()} "
        f"(relative {rel.tolist()})")
  # Process 0 alone logged and wrote files; process 1 only said where it connected.
  assert "wrote " in results[0].output and "wrote " not in results[1].output
  assert "step     4" in results[0].output and "step     4" not in results[1].output


@pytest.mark.multiprocess
def test_a_checkpoint_written_by_two_processes_resumes_in_two_bit_for_bit(tmp_path, seed):
  # fsdp=8: every parameter is split between the processes, so each writes and reads its own
  # shards; fp8_delayed adds the scale and amax history of every Dense.
  args = [*TINY_LM, "--recipe", "fp8_delayed", "--mesh", "fsdp=8", "--seed", str(seed % 10_000),
          "--out", str(tmp_path / "out")]
  _run_all(([*args, "--checkpoint", str(tmp_path / "whole")], 2, 4,
            lambda: shutil.rmtree(tmp_path / "whole", ignore_errors=True)))
  whole_losses = _step_losses(tmp_path / "out")["fp8_delayed"]

  def stopped_after_step_2():  # the same run's files without the step-4 checkpoint
    shutil.rmtree(tmp_path / "broken", ignore_errors=True)
    shutil.copytree(tmp_path / "whole", tmp_path / "broken")
    shutil.rmtree(tmp_path / "broken" / "fp8_delayed" / "4")

  [results] = _run_all(([*args, "--checkpoint", str(tmp_path / "broken")], 2, 4,
                        stopped_after_step_2))
  assert "resumed at step 2 of 4" in results[0].output, results[0].tail()
  assert _step_losses(tmp_path / "out")["fp8_delayed"] == whole_losses  # float ==: bit for bit
  got = _restore(tmp_path / "broken" / "fp8_delayed" / "4")
  want = _restore(tmp_path / "whole" / "fp8_delayed" / "4")
  got_leaves, want_leaves = (jax.tree.flatten_with_path(t)[0] for t in (got, want))
  assert [p for p, _ in got_leaves] == [p for p, _ in want_leaves]
  for (path, g), (_, w) in zip(got_leaves, want_leaves, strict=True):
    g, w = np.asarray(g), np.asarray(w)
    assert g.dtype == w.dtype and g.shape == w.shape and g.tobytes() == w.tobytes(), (
        f"{jax.tree_util.keystr(path)} differs after the resume")
  histories = [np.asarray(leaf) for path, leaf in want_leaves
               if "amax_history" in jax.tree_util.keystr(path)]
  assert histories and all(np.any(h > 0) for h in histories)  # the delayed state is live


def _gpu_ids() -> list[str]:
  """The GPUs the children may use (`$CUDA_VISIBLE_DEVICES`, else `nvidia-smi -L`), found
  without starting a GPU backend in this process."""
  visible = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
  if visible:
    return visible
  smi = shutil.which("nvidia-smi")
  if smi is None:
    return []
  listed = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=60).stdout
  gpus = [row for row in listed.splitlines() if row.startswith("GPU ")]
  return [str(i) for i in range(len(gpus))]


@pytest.mark.gpu
@pytest.mark.multiprocess
def test_two_processes_of_one_gpu_train_like_one_process_with_two(tmp_path, seed):
  gpus = _gpu_ids()[:2]
  if len(gpus) < 2:
    pytest.skip("needs 2 GPUs")
  args = [TRAIN_LM, *TINY_LM, "--recipe", "fp8_current", "--mesh", "dp=2",
          "--seed", str(seed % 10_000), "--optimizer", "sgd", "--lr", "0.3"]
  base = {"XLA_PYTHON_CLIENT_PREALLOCATE": "false", "NCCL_NVLS_ENABLE": "0",
          "PYTHONPATH": _host_devices(1)["PYTHONPATH"]}
  with launch.LocalRun([*args, "--out", str(tmp_path / "one")], 1, cwd=str(ROOT),
                       env_for=lambda i: {**base, "CUDA_VISIBLE_DEVICES": ",".join(gpus)}) as one:
    _finish(one)
  with launch.LocalRun([*args, "--out", str(tmp_path / "two")], 2, cwd=str(ROOT),
                       env_for=lambda i: {**base, "CUDA_VISIBLE_DEVICES": gpus[i]}) as two:
    _finish(two)
  want = np.array(_step_losses(tmp_path / "one")["fp8_current"])
  got = np.array(_step_losses(tmp_path / "two")["fp8_current"])
  rel = np.abs(got - want) / np.abs(want)
  assert rel[0] <= FIRST_STEP_RTOL and rel.max() <= LATER_STEPS_RTOL["fp8_current"], (
      f"2 processes {got.tolist()} vs 1 process {want.tolist()} (relative {rel.tolist()})")


def _bad_launch(args: list[str], processes: int = 1, timeout: float = 120.0):
  """Run `args` in `processes` plain processes (the launch flags are in `args`, per process when
  `args` is a function of the id); all must fail by themselves. Returns (results, seconds)."""
  argv = args if callable(args) else (lambda i: args)
  runs = [_start([*TINY_LM, "--recipe", "fp8_current", *argv(i)], 1, 4) for i in range(processes)]
  start = time.monotonic()
  try:
    results = [_finish(run, timeout, expect_success=False)[0] for run in runs]
  finally:
    for run in runs:
      run.close()
  assert all(r.returncode not in (None, 0) for r in results), (
      "expected every process to fail by itself:\n" + launch.report(results))
  return results, time.monotonic() - start


@pytest.mark.multiprocess
def test_processes_disagreeing_on_the_process_count_stop_naming_the_flag(tmp_path):
  address = f"localhost:{launch.free_port()}"
  results, _ = _bad_launch(lambda i: ["--coordinator", address, "--num-processes", str(2 + i),
                                      "--process-id", str(i), "--out", str(tmp_path)], 2)
  for r in results:  # both joined (process 0's count rules), then compared their settings
    assert "--num-processes differs between processes" in r.output, r.tail()


@pytest.mark.multiprocess
def test_a_process_that_never_comes_ends_the_others_at_the_init_timeout(tmp_path):
  address = f"localhost:{launch.free_port()}"
  results, seconds = _bad_launch(lambda i: ["--coordinator", address, "--num-processes", "3",
                                            "--process-id", str(i), "--init-timeout", "5",
                                            "--out", str(tmp_path)], 2)
  for r in results:  # process 2 was never started
    assert r.returncode == 2, r.tail()
    assert "not all 3 processes joined" in r.output and "--num-processes 3" in r.output, r.tail()
  assert seconds < 60


@pytest.mark.multiprocess
def test_an_unreachable_coordinator_is_named(tmp_path):
  address = f"localhost:{launch.free_port()}"  # nobody listens there
  (result,), seconds = _bad_launch(["--coordinator", address, "--num-processes", "2",
                                    "--process-id", "1", "--init-timeout", "3",
                                    "--out", str(tmp_path)])
  assert result.returncode == 2, result.tail()
  assert f"--coordinator {address}: nothing accepted a connection" in result.output, result.tail()
  assert seconds < 60


@pytest.mark.multiprocess
def test_a_mesh_larger_than_every_process_s_devices_is_named(tmp_path):
  address = f"localhost:{launch.free_port()}"
  results, _ = _bad_launch(lambda i: ["--mesh", "dp=16", "--coordinator", address,
                                      "--num-processes", "2", "--process-id", str(i),
                                      "--out", str(tmp_path)], 2)
  for r in results:
    assert "--mesh {'dp': 16}: needs 16 devices, found 8 cpu devices over 2 processes" in \
        r.output, r.tail()


# In-process checks of the pieces (no processes started).


def test_the_launch_comes_from_flags_else_the_environment():
  env = {"JAX_COORDINATOR_ADDRESS": "h0:1234", "JAX_NUM_PROCESSES": "4", "JAX_PROCESS_ID": "3"}
  assert distributed.resolve_launch(None, None, None, environ=env) == distributed.Launch(
      "h0:1234", 4, 3)
  assert distributed.resolve_launch("h1:99", 2, 1, environ=env) == distributed.Launch(
      "h1:99", 2, 1)
  assert not distributed.resolve_launch(None, None, None, environ={}).multi_process


@pytest.mark.parametrize("flags, message", [
    ((None, 2, 0), "--num-processes 2 needs --coordinator"),
    (("h0:1", 2, None), "--num-processes 2 needs --process-id"),
    (("h0:1", 2, 2), r"--process-id 2: expected 0 \.\.\. 1"),
    (("h0", 2, 0), "--coordinator 'h0': expected HOST:PORT"),
    (("h0:1", None, 1), "--coordinator and --process-id given without --num-processes"),
    ((None, 1, 1), r"--process-id 1: expected 0 \.\.\. 0"),
])
def test_an_incomplete_launch_names_the_missing_flag(flags, message):
  with pytest.raises(ValueError, match=message):
    distributed.resolve_launch(*flags, environ={})


def test_each_process_loads_its_rows_of_the_batches_every_process_sees(rng):
  stream = rng.integers(0, 256, size=5000).astype(np.uint8)
  rows = np.array([2, 3, 6, 7])  # e.g. one process's share of 8 rows
  seed = int(rng.integers(1 << 30))
  full = data.random_batches(stream, 8, 16, seed=seed, skip=1)
  mine = data.random_batches(stream, 8, 16, seed=seed, skip=1, rows=rows)
  for _ in range(3):
    np.testing.assert_array_equal(next(mine), next(full)[rows])
  np.testing.assert_array_equal(data.fixed_batches(stream, 8, 16, 3, rows=rows),
                                data.fixed_batches(stream, 8, 16, 3)[:, rows])
