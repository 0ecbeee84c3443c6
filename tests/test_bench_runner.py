"""`bench/run.py`, the GPU runner, on this machine: job lists parse (and every list in
bench/jobs/ names scripts and tests that exist), jobs run one per GPU slot then the mesh jobs on
all of them, a timeout or the deadline stops or skips a job, and the summary says so."""

from __future__ import annotations

import importlib.util
import json
import pathlib
import re
import subprocess
import sys
import tarfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def run():
  spec = importlib.util.spec_from_file_location("bench_run", ROOT / "bench" / "run.py")
  module = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = module  # dataclasses look their module up there
  spec.loader.exec_module(module)
  yield module
  del sys.modules[spec.name]


def _runner(tmp_path, jobs: str, *args: str) -> tuple[subprocess.CompletedProcess, dict]:
  (tmp_path / "jobs.txt").write_text(jobs)
  out = tmp_path / "out"
  result = subprocess.run(
      [sys.executable, str(ROOT / "bench" / "run.py"), "--jobs", str(tmp_path / "jobs.txt"),
       "--no-build", "--no-check", "--out", str(out), *args],
      capture_output=True, text=True, timeout=120)
  return result, json.loads((out / "summary.json").read_text())


def test_a_job_list_gives_variables_options_and_commands(run):
  jobs, variables = run.parse_jobs([
      "# a comment", "", "BASE := --layers 2", "MORE := $BASE --steps ${N}",
      "one: python bench/x.py $MORE --json $JOB_OUT/x.json",
      "two [mesh, timeout=30]: echo $NGPU", "three [early]: true"], "list.txt")
  assert variables == {"BASE": "--layers 2", "MORE": "--layers 2 --steps ${N}"}
  assert [(j.name, j.mesh, j.early, j.timeout) for j in jobs] == [
      ("one", False, False, None), ("two", True, False, 30.0), ("three", False, True, None)]
  assert jobs[0].command == "python bench/x.py --layers 2 --steps ${N} --json $JOB_OUT/x.json"
  assert jobs[1].source == "list.txt:6"


@pytest.mark.parametrize("line, message", [
    ("one [fast]: true", "list.txt:1: unknown job option 'fast'"),
    ("one [timeout=soon]: true", "list.txt:1: 'timeout=soon' is not a number"),
    ("no colon here", "list.txt:1: expected 'name [options]: command'")])
def test_a_malformed_line_is_refused_with_its_place(run, line, message):
  with pytest.raises(run.JobListError, match=re.escape(message)):
    run.parse_jobs([line], "list.txt")


def test_job_names_must_differ_and_not_be_the_runners_own(run):
  jobs, _ = run.parse_jobs(["a: true", "a: false"], "list.txt")
  with pytest.raises(run.JobListError, match="'a' is already used at list.txt:1"):
    run.check_unique(jobs)
  with pytest.raises(run.JobListError, match="runner's own files"):
    run.check_unique(run.parse_jobs(["build: true"], "list.txt")[0])
  assert run.parse_job_argument("python bench/gemm.py --json x:y", 3).name == "job3"


@pytest.mark.parametrize("path", sorted((ROOT / "bench" / "jobs").glob("*.txt")),
                         ids=lambda p: p.name)
def test_every_job_list_parses_and_names_files_that_exist(run, path):
  jobs, _ = run.parse_jobs(path.read_text().splitlines(), path.name)
  run.check_unique(jobs)
  assert jobs, f"{path.name} holds no job"
  for job in jobs:
    files = re.findall(r"\b((?:bench|tests|examples|ffi)/[\w/.-]+\.(?:py|cu|txt))", job.command)
    for name in files:
      assert (ROOT / name).exists(), f"{job.source}: {name} does not exist"


def test_jobs_run_one_per_gpu_then_the_mesh_jobs_on_all(tmp_path):
  result, summary = _runner(tmp_path, "\n".join([
      "ok: echo $NGPU $CUDA_VISIBLE_DEVICES; echo '{\"x\": 1}' > $JOB_OUT/r.json",
      "slow [timeout=1]: sleep 30",
      "bad: exit 3",
      "mesh [mesh]: echo $CUDA_VISIBLE_DEVICES; python -c 'import lm; print(lm.__name__)'"]),
      "--gpus", "2")
  assert result.returncode == 1, result.stdout  # two jobs are not ok
  jobs = {j["name"]: j for j in summary["jobs"]}
  assert [j["name"] for j in summary["jobs"]][-1] == "mesh"
  assert (jobs["ok"]["status"], jobs["ok"]["tail"], jobs["ok"]["results"]) == (
      "ok", [f"2 {jobs['ok']['gpus']}"], {"r.json": {"x": 1}})
  assert {jobs["ok"]["gpus"], jobs["slow"]["gpus"]} == {"0", "1"}  # side by side
  assert jobs["slow"]["status"] == "timeout" and jobs["slow"]["seconds"] < 20
  assert (jobs["bad"]["status"], jobs["bad"]["exit_code"]) == ("failed", 3)
  assert (jobs["mesh"]["status"], jobs["mesh"]["gpus"], jobs["mesh"]["tail"]) == (
      "ok", "0,1", ["0,1", "lm"])  # examples/lm importable: PYTHONPATH has examples/
  with tarfile.open(tmp_path / "out" / "jobs.tar.gz") as tar:
    assert {"ok.log", "ok/r.json", "slow.log", "bad.log", "mesh.log"} <= set(tar.getnames())


def test_the_deadline_skips_what_would_start_too_late(tmp_path):
  result, summary = _runner(tmp_path, "first: sleep 2\nsecond: echo late\nthird [mesh]: true",
                            "--gpus", "0", "--deadline", "4", "--min-left", "3")
  statuses = {j["name"]: (j["status"], j.get("why", "")) for j in summary["jobs"]}
  assert statuses["first"] == ("ok", "")
  for name in ("second", "third"):
    assert statuses[name][0] == "skipped" and statuses[name][1].endswith("s left"), statuses
  assert result.returncode == 1


def test_the_build_takes_the_carried_cutlass_headers_unless_a_folder_is_named(run, tmp_path):
  """A call's `.cutlass/include` (what the device README says to carry) is the build's CUTLASS
  folder when JAXQUANT_CUTLASS_DIR is unset; a folder without cutlass/version.h is not."""
  assert run.carried_cutlass(tmp_path, {}) is None
  include = tmp_path / ".cutlass" / "include"
  (include / "cutlass").mkdir(parents=True)
  assert run.carried_cutlass(tmp_path, {}) is None  # no headers in it
  (include / "cutlass" / "version.h").write_text("#define CUTLASS_MAJOR 4\n")
  assert run.carried_cutlass(tmp_path, {}) == include
  assert run.carried_cutlass(tmp_path, {"JAXQUANT_CUTLASS_DIR": "/elsewhere"}) is None
