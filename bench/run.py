"""The GPU runner: builds the extension, runs a list of benchmark / test jobs on a GPU machine,
and leaves their logs and a JSON summary in one folder.

    python bench/run.py --jobs bench/jobs/grouped.txt             # build, then the file's jobs
    python bench/run.py --no-build --job "gemm: python bench/gemm.py --json \\$JOB_OUT/gemm.json"
    python bench/run.py --jobs bench/jobs/mesh.txt --dry-run      # the plan, nothing run

Phases, all inside `--deadline` seconds:
1. Build: `pip wheel` of this checkout (no build isolation) and its extension unpacked into
   jaxquant/, so every job imports the source tree with the kernels (`--no-build`: use what is
   there; `--prebuilt DIR`: the one bench/prebuilt.py built elsewhere from the same sources,
   ~3 minutes of a fresh machine's time saved). Single-GPU jobs marked `early` (they need no
   kernels: bf16 runs) start meanwhile.
2. Single-GPU jobs, in parallel: one per GPU (`CUDA_VISIBLE_DEVICES`), in file order as GPUs
   free up.
3. Mesh jobs (`mesh`), one at a time on all GPUs.
A job is stopped at its `timeout=` or at the deadline, whichever comes first, and skipped when
less than `--min-left` seconds remain. It runs under `bash -c` in the checkout's root with
`PYTHONPATH=<root>:<root>/examples`, `python` = this interpreter, `$NGPU` (the GPU count),
`$JOB_OUT` (its own folder, for JSON and traces), NCCL's NVLink multicast off and
XLA_PYTHON_CLIENT_MEM_FRACTION=0.97 (one process per GPU; see `ENVIRONMENT`).

Out folder (`--out`, else `$OUT`, else /tmp/jaxquant_bench): `summary.json` (the cards, the
build, and per job its command, GPUs, status, exit code, seconds, the tail of its log and the
JSON files it wrote; rewritten after every job), `log.txt`, `jobs.tar.gz` (every log and job
folder) — three files, within the device tool's eight.

A job list (bench/jobs/*.txt) holds one job per line; `#` starts a comment:

    DENSE := --d-model 4096 --layers 8         a variable: $DENSE in later lines is replaced
    name: command                              a single-GPU job
    name [mesh, timeout=300]: command          options: mesh, early, timeout=SECONDS
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import pathlib
import re
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
import time
import zipfile
from typing import Optional, Sequence

ROOT = pathlib.Path(__file__).resolve().parents[1]

# Set for every job unless the caller's environment sets them. One process per GPU may use
# nearly all of it (the d4096 model on one H100 needs ~26 GB of state beside ~44 GiB of
# temporaries, more than XLA's default 75%); NVLink multicast stays off (the device tool's rule).
ENVIRONMENT = {
    "PYTHONUNBUFFERED": "1",
    "XLA_PYTHON_CLIENT_PREALLOCATE": "false",
    "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.97",
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}
OPTIONS = ("mesh", "early", "timeout=SECONDS")
_VARIABLE = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)\s*:=\s*(.*)$")
_JOB = re.compile(r"^([A-Za-z0-9_.-]+)\s*(?:\[([^\]]*)\])?\s*:\s*(.+)$")
_REFERENCE = re.compile(r"\$(?:\{([A-Za-z_][A-Za-z0-9_]*)\}|([A-Za-z_][A-Za-z0-9_]*))")


def carried_cutlass(root: pathlib.Path, environ) -> Optional[pathlib.Path]:
  """The CUTLASS headers a call carried (`<root>/.cutlass/include`, from nvidia-cutlass==4.2.0.0)
  when `JAXQUANT_CUTLASS_DIR` is unset: without them the build leaves the CUTLASS grouped
  kernels out and says so only in the extension's status line. None otherwise."""
  include = root / ".cutlass" / "include"
  if environ.get("JAXQUANT_CUTLASS_DIR") or not (include / "cutlass" / "version.h").is_file():
    return None
  return include


@dataclasses.dataclass(frozen=True)
class Job:
  """One command of a job list: where it runs and for how long at most."""

  name: str
  command: str
  mesh: bool = False  # on all GPUs, after the single-GPU jobs
  early: bool = False  # needs no extension: may start while it builds
  timeout: Optional[float] = None  # seconds; None: until the deadline
  source: str = ""  # "file:line", for errors and the summary


class JobListError(ValueError):
  """A malformed job list line; the message names the file and line."""


def _options(text: str, where: str) -> dict:
  options = {}
  for item in filter(None, (s.strip() for s in re.split(r"[,\s]+", text or ""))):
    if item in ("mesh", "early"):
      options[item] = True
    elif item.startswith("timeout="):
      try:
        options["timeout"] = float(item.split("=", 1)[1])
      except ValueError:
        raise JobListError(f"{where}: {item!r} is not a number of seconds") from None
    else:
      raise JobListError(f"{where}: unknown job option {item!r}; expected one of {OPTIONS}")
  return options


def parse_jobs(lines: Sequence[str], source: str,
               variables: Optional[dict] = None) -> tuple[list[Job], dict]:
  """Jobs and variables of a job list. `variables` (updated) holds those of earlier lists.
  A variable's `$NAME` / `${NAME}` in a later value or a command is replaced here by its value;
  anything else (`$NGPU`, `$JOB_OUT`, `$((...))`) is left to the job's shell."""
  variables = {} if variables is None else variables
  jobs = []

  def substitute(text: str) -> str:
    return _REFERENCE.sub(lambda m: variables.get(m.group(1) or m.group(2), m.group(0)), text)

  for number, raw in enumerate(lines, 1):
    line = raw.strip()
    where = f"{source}:{number}"
    if not line or line.startswith("#"):
      continue
    if match := _VARIABLE.match(line):
      name, value = match.groups()
      variables[name] = substitute(value.strip())
      continue
    match = _JOB.match(line)
    if match is None:
      raise JobListError(f"{where}: expected 'name [options]: command' or 'NAME := value', got "
                         f"{line!r}")
    name, options, command = match.groups()
    jobs.append(Job(name, substitute(command.strip()), source=where,
                    **_options(options, where)))
  return jobs, variables


def parse_job_argument(text: str, index: int) -> Job:
  """A `--job` argument: 'name [options]: command', or a bare command named job<index>."""
  if _JOB.match(text.strip()):
    return parse_jobs([text], f"--job {index}")[0][0]
  return Job(f"job{index}", text.strip(), source=f"--job {index}")


RESERVED_NAMES = ("build", "bin", "wheel")  # the runner's own files in its work folder


def check_unique(jobs: Sequence[Job]) -> None:
  """JobListError unless every job has its own name, and none of `RESERVED_NAMES`."""
  seen = {}
  for job in jobs:
    if job.name in RESERVED_NAMES:
      raise JobListError(f"{job.source}: {job.name!r} names one of the runner's own files "
                         f"{RESERVED_NAMES}; rename the job")
    if job.name in seen:
      raise JobListError(f"{job.source}: job name {job.name!r} is already used at "
                         f"{seen[job.name]}; names name the logs, so they must differ")
    seen[job.name] = job.source


# ---------------------------------------------- machine ---------------------------------------

def gpus() -> list[dict]:
  """The visible GPUs (index, name, memory, driver, max SM clock), [] without nvidia-smi."""
  query = "index,name,memory.total,driver_version,clocks.max.sm"
  try:
    out = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"],
                         capture_output=True, text=True, timeout=60, check=True).stdout
  except (OSError, subprocess.SubprocessError):
    return []
  rows = [dict(zip(query.split(","), (v.strip() for v in line.split(","))))
          for line in out.splitlines() if line.strip()]
  visible = os.environ.get("CUDA_VISIBLE_DEVICES")
  if visible is not None:
    wanted = [v.strip() for v in visible.split(",") if v.strip()]
    rows = [r for r in rows if r["index"] in wanted]
  return rows


def _git_commit() -> Optional[str]:
  try:
    return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                          text=True, timeout=30, check=True).stdout.strip()
  except (OSError, subprocess.SubprocessError):
    return None


_CHECK = """
import json, jax, jaxquant
from jaxquant.backends.ffi import registry
ext = registry.extension_function
info = {"jax": jax.__version__, "device": jax.devices()[0].device_kind,
        "extension": registry.extension_built(),
        "unserved_cuda": registry.unserved_reason("cuda")}
for name in ("has_cuda", "cuda_archs", "grouped_sm90_status"):
  info[name] = ext(name)() if ext(name) else None
print(json.dumps(info, default=str))
"""


# ---------------------------------------------- running ---------------------------------------

class Runner:
  """Runs the build and the jobs, keeps the log and the summary up to date."""

  def __init__(self, args, jobs: Sequence[Job], variables: dict):
    self.args, self.jobs = args, list(jobs)
    self.start = time.monotonic()
    self.out = pathlib.Path(args.out or os.environ.get("OUT") or "/tmp/jaxquant_bench")
    self.out.mkdir(parents=True, exist_ok=True)
    self.work = pathlib.Path(tempfile.mkdtemp(prefix="jaxquant_bench_"))
    self.cards = gpus()
    count = len(self.cards) if args.gpus is None else args.gpus
    self.slots = [str(i) for i in range(count)] if args.gpus is not None else [
        c["index"] for c in self.cards]
    bin_dir = self.work / "bin"
    bin_dir.mkdir()
    for name in ("python", "python3"):
      # A script, not a symlink: a symlinked venv interpreter outside its venv loses the
      # venv's site-packages (the GPU machine's jax, pytest and torch live in one).
      shim = bin_dir / name
      shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
      shim.chmod(0o755)
    self.env = dict(os.environ)
    for key, value in ENVIRONMENT.items():
      self.env.setdefault(key, value)
    self.env["PATH"] = f"{bin_dir}{os.pathsep}{self.env.get('PATH', '')}"
    self.env["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT), str(ROOT / "examples")] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    self.env["NGPU"] = str(len(self.slots))
    self.env.setdefault("CMAKE_BUILD_PARALLEL_LEVEL", str(os.cpu_count() or 1))
    self.summary = {
        "started": datetime.datetime.now().isoformat(timespec="seconds"),
        "host": socket.gethostname(), "gpus": self.cards, "commit": _git_commit(),
        "python": sys.version.split()[0], "deadline_s": args.deadline,
        "variables": variables, "build": {"status": "pending"}, "jobs": []}
    self.log_file = open(self.out / "log.txt", "a")
    self.limit_at_start: dict[str, float] = {}
    self.build_ok = False

  # -- bookkeeping
  def elapsed(self) -> float:
    return time.monotonic() - self.start

  def left(self) -> float:
    return self.args.deadline - self.elapsed()

  def say(self, text: str) -> None:
    line = f"[{self.elapsed():5.0f} s] {text}"
    print(line, flush=True)
    self.log_file.write(line + "\n")
    self.log_file.flush()

  def write_summary(self) -> None:
    self.summary["elapsed_s"] = round(self.elapsed(), 1)
    tmp = self.out / "summary.json.tmp"
    tmp.write_text(json.dumps(self.summary, indent=1, default=str))
    tmp.replace(self.out / "summary.json")

  def tail(self, log: pathlib.Path) -> list[str]:
    drop = re.compile(self.args.drop) if self.args.drop else None
    lines = [line for line in log.read_text(errors="replace").splitlines()
             if not (drop and drop.search(line))]
    return lines[-self.args.tail:]

  # -- processes
  def spawn(self, name: str, command: str, gpus: Optional[str]) -> subprocess.Popen:
    env = dict(self.env, JOB_OUT=str(self.work / name))
    (self.work / name).mkdir(exist_ok=True)
    if gpus is not None:
      env["CUDA_VISIBLE_DEVICES"] = gpus
    log = open(self.work / f"{name}.log", "w")
    process = subprocess.Popen(["bash", "-c", command], cwd=ROOT, env=env, stdout=log,
                               stderr=subprocess.STDOUT, start_new_session=True)
    log.close()
    return process

  @staticmethod
  def stop(process: subprocess.Popen) -> None:
    """Ends the job's whole process group (it started its own session)."""
    for sig, wait in ((signal.SIGTERM, 5), (signal.SIGKILL, 5)):
      try:
        os.killpg(process.pid, sig)
      except ProcessLookupError:
        return
      try:
        process.wait(wait)
        return
      except subprocess.TimeoutExpired:
        continue

  def limit(self, job: Job) -> float:
    return min(job.timeout if job.timeout is not None else float("inf"), self.left())

  def record(self, job: Job, status: str, gpus: Optional[str], seconds: float = 0.0,
             exit_code: Optional[int] = None, why: str = "") -> None:
    entry = {"name": job.name, "kind": "mesh" if job.mesh else "single", "gpus": gpus,
             "command": job.command, "source": job.source, "status": status,
             "exit_code": exit_code, "seconds": round(seconds, 1)}
    if why:
      entry["why"] = why
    log = self.work / f"{job.name}.log"
    if log.exists():
      entry["log"] = f"{job.name}.log (in jobs.tar.gz)"
      entry["tail"] = self.tail(log)
      entry["results"] = self.results(job)
    self.summary["jobs"].append(entry)
    self.say(f"{job.name}: {status}" + (f", exit {exit_code}" if exit_code is not None else "")
             + (f" after {seconds:.0f} s" if seconds else "") + (f" ({why})" if why else ""))
    for line in entry.get("tail", [])[-self.args.show:]:
      print(f"    {line}", flush=True)
    self.write_summary()

  def results(self, job: Job) -> dict:
    """The JSON files (up to `--max-json` bytes each) the job wrote into its folder."""
    found = {}
    for path in sorted((self.work / job.name).rglob("*.json")):
      relative = str(path.relative_to(self.work / job.name))
      if path.stat().st_size > self.args.max_json:
        found[relative] = f"(not read: {path.stat().st_size} bytes; see jobs.tar.gz)"
        continue
      try:
        found[relative] = json.loads(path.read_text())
      except ValueError as err:
        found[relative] = f"(not JSON: {err})"
    return found

  # -- phases
  def start_build(self) -> Optional[subprocess.Popen]:
    if self.args.no_build:
      self.summary["build"] = {"status": "skipped (--no-build)"}
      return None
    if self.args.prebuilt is not None and self.take_prebuilt(self.args.prebuilt):
      return None
    wheel_dir = self.work / "wheel"
    defines = " ".join(f"-C cmake.define.{d}" for d in self.args.cmake_define)
    cutlass = carried_cutlass(ROOT, os.environ)
    if cutlass is not None:
      self.env["JAXQUANT_CUTLASS_DIR"] = str(cutlass)
      self.say(f"build: JAXQUANT_CUTLASS_DIR={cutlass}")
    command = (f"{sys.executable} -m pip wheel --no-build-isolation --no-deps {defines} "
               f"-w {wheel_dir} {ROOT}")
    self.say(f"build: {command}")
    self.summary["build"] = {"status": "running", "command": command}
    return self.spawn("build", command, None)

  def take_prebuilt(self, folder: pathlib.Path) -> bool:
    """The extension from `folder` (bench/prebuilt.py) when its sources are the tree's and it
    loads with CUDA served; else the reason is logged and the build runs as without it."""
    sys.path.insert(0, str(ROOT / "bench"))
    import prebuilt  # bench/prebuilt.py
    taken, why = prebuilt.accept(ROOT, folder)
    if taken:
      library_dir = prebuilt.cuda_library_dir()
      if library_dir:  # its RUNPATH names the build machine's cuBLASLt folder
        self.env["LD_LIBRARY_PATH"] = os.pathsep.join(
            [library_dir] + [p for p in [self.env.get("LD_LIBRARY_PATH")] if p])
      check = subprocess.run([sys.executable, "-c", _CHECK], cwd=ROOT, env=self.env,
                             capture_output=True, text=True, timeout=300)
      lines = check.stdout.strip().splitlines()
      try:
        info = json.loads(lines[-1])
      except (ValueError, IndexError):
        info = {"error": (check.stdout + check.stderr)[-1000:]}
      if info.get("extension") and info.get("has_cuda") and info.get("unserved_cuda") is None:
        self.summary["build"] = {"status": "prebuilt", "from": why, "check": info}
        self.say(f"prebuilt extension taken: {why}")
        return True
      why = f"it does not serve CUDA here: {info}"
      (ROOT / "jaxquant" / ("_jaxquant_ffi" + sysconfig.get_config_var("EXT_SUFFIX"))).unlink(
          missing_ok=True)
    self.say(f"prebuilt extension not taken ({why}); building")
    self.summary["prebuilt_refused"] = why
    return False

  def finish_build(self, process: Optional[subprocess.Popen], seconds: float) -> bool:
    """Unpacks the built extension into jaxquant/ and records what it serves."""
    build = self.summary["build"]
    if build["status"] == "prebuilt":  # checked when taken
      self.write_summary()
      return True
    if process is not None:
      build["seconds"] = round(seconds, 1)
      build["tail"] = self.tail(self.work / "build.log")
      wheels = sorted((self.work / "wheel").glob("jaxquant-*.whl"))
      if process.returncode != 0 or not wheels:
        build["status"] = f"failed (exit {process.returncode})"
        self.say(f"build failed after {seconds:.0f} s:\n" + "\n".join(build["tail"]))
        self.write_summary()
        return False
      with zipfile.ZipFile(wheels[-1]) as wheel:
        for member in wheel.namelist():
          if re.fullmatch(r"jaxquant/_jaxquant_ffi[^/]*\.(so|pyd)", member):
            target = ROOT / member
            target.unlink(missing_ok=True)
            target.write_bytes(wheel.read(member))
            build.setdefault("installed", []).append(member)
      build["status"] = "ok"
      self.say(f"build done after {seconds:.0f} s: {build.get('installed')}")
    if self.args.no_check:
      self.write_summary()
      return True
    check = subprocess.run([sys.executable, "-c", _CHECK], cwd=ROOT, env=self.env,
                           capture_output=True, text=True, timeout=300)
    try:
      build["check"] = json.loads(check.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
      build["check"] = (check.stdout + check.stderr)[-2000:]
    self.say(f"extension: {build['check']}")
    self.write_summary()
    return True

  def run_single_jobs(self, jobs: list[Job], build: Optional[subprocess.Popen]) -> None:
    pending, running = list(jobs), {}  # slot -> (job, process, started)
    slots = self.slots or [None]
    build_started, built = time.monotonic(), build is None
    build_ok = self.finish_build(None, 0) if build is None else None
    while pending or running or not built:
      if not built and build.poll() is not None:
        built, build_ok = True, self.finish_build(build, time.monotonic() - build_started)
      if not built and self.left() <= 0:
        self.stop(build)
        built, build_ok = True, False
        self.summary["build"]["status"] = "stopped at the deadline"
      for slot, (job, process, started) in list(running.items()):
        seconds = time.monotonic() - started
        if process.poll() is not None:
          status = "ok" if process.returncode == 0 else "failed"
          self.record(job, status, slot, seconds, process.returncode)
          del running[slot]
        elif seconds > self.limit_at_start[job.name]:
          self.stop(process)
          self.record(job, "timeout", slot, seconds, process.returncode,
                      f"stopped after {self.limit_at_start[job.name]:.0f} s")
          del running[slot]
      for slot in [s for s in slots if s not in running]:
        job = next((j for j in pending if j.early or build_ok), None)
        if job is None:
          if built and not build_ok:  # nothing left may run without the extension
            for skipped in pending:
              self.record(skipped, "skipped", None, why="the build failed")
            pending.clear()
          break
        pending.remove(job)
        if self.left() < self.args.min_left:
          self.record(job, "skipped", None, why=f"{self.left():.0f} s left")
          continue
        self.limit_at_start[job.name] = self.limit(job)
        where = f" on GPU {slot}" if slot is not None else ""
        self.say(f"{job.name}: start{where}: {job.command}")
        running[slot] = (job, self.spawn(job.name, job.command, slot), time.monotonic())
      time.sleep(0.2)
    self.build_ok = build_ok

  def run_mesh_jobs(self, jobs: list[Job]) -> None:
    gpus = ",".join(self.slots) if self.slots else None
    for job in jobs:
      if not (self.build_ok or job.early):
        self.record(job, "skipped", gpus, why="the build failed")
        continue
      if self.left() < self.args.min_left:
        self.record(job, "skipped", gpus, why=f"{self.left():.0f} s left")
        continue
      limit = self.limit(job)
      self.say(f"{job.name}: start on GPUs {gpus or 'all'}: {job.command}")
      started, process = time.monotonic(), self.spawn(job.name, job.command, gpus)
      try:
        process.wait(limit)
        status = "ok" if process.returncode == 0 else "failed"
        self.record(job, status, gpus, time.monotonic() - started, process.returncode)
      except subprocess.TimeoutExpired:
        self.stop(process)
        self.record(job, "timeout", gpus, time.monotonic() - started, process.returncode,
                    f"stopped after {limit:.0f} s")

  def run(self) -> int:
    cards = "; ".join(f"{c.get('index')} {c.get('name')}" for c in self.cards)
    self.say(f"{len(self.slots)} GPU(s) ({cards or 'nvidia-smi lists none'}); out {self.out}")
    single = [j for j in self.jobs if not j.mesh]
    build = self.start_build()
    self.run_single_jobs(single, build)
    self.run_mesh_jobs([j for j in self.jobs if j.mesh])
    left_out = []

    def small(info: tarfile.TarInfo) -> Optional[tarfile.TarInfo]:
      if info.isfile() and info.size > self.args.max_file:
        left_out.append(f"{info.name} ({info.size} bytes)")
        return None
      return info

    with tarfile.open(self.out / "jobs.tar.gz", "w:gz") as tar:
      for path in sorted(self.work.iterdir()):
        if path.name not in ("bin", "wheel"):
          tar.add(path, arcname=path.name, filter=small)
    if left_out:
      self.summary["left_out_of_jobs_tar"] = left_out
    self.write_summary()
    failed = [e["name"] for e in self.summary["jobs"] if e["status"] != "ok"]
    self.say("done" + (f"; not ok: {', '.join(failed)}" if failed else ": every job ok"))
    self.log_file.close()
    shutil.rmtree(self.work, ignore_errors=True)
    return 1 if failed or not self.build_ok else 0


def main(argv: Optional[Sequence[str]] = None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--jobs", action="append", default=[], type=pathlib.Path, metavar="FILE",
                 help="a job list (bench/jobs/*.txt); may be repeated")
  p.add_argument("--job", action="append", default=[], metavar="'NAME [OPTIONS]: COMMAND'",
                 help="one job (a bare command is named job<N>); may be repeated")
  p.add_argument("--only", default="", help="comma-separated job names to run, the rest skipped")
  p.add_argument("--out", default=None, help="out folder (default: $OUT, else /tmp/jaxquant_bench)")
  p.add_argument("--deadline", type=float, default=560.0,
                 help="seconds for everything, build included (default 560: a 600 s device call)")
  p.add_argument("--min-left", type=float, default=30.0,
                 help="skip a job that would start with fewer seconds left (default 30)")
  p.add_argument("--no-build", action="store_true", help="use the extension already in jaxquant/")
  p.add_argument("--prebuilt", type=pathlib.Path, default=None, metavar="DIR",
                 help="take the extension bench/prebuilt.py built on another machine from DIR "
                      "when its sources are the tree's and it serves CUDA here (else build)")
  p.add_argument("--cmake-define", action="append", default=[], metavar="NAME=VALUE",
                 help="passed to the build as -C cmake.define.NAME=VALUE "
                      "(e.g. JAXQUANT_GROUPED_SM90=OFF)")
  p.add_argument("--gpus", type=int, default=None,
                 help="use GPUs 0..N-1 (default: those nvidia-smi lists; 0 runs the single-GPU "
                      "jobs one at a time without CUDA_VISIBLE_DEVICES)")
  p.add_argument("--tail", type=int, default=40, help="log lines kept per job in the summary")
  p.add_argument("--show", type=int, default=12, help="log lines printed per finished job")
  p.add_argument("--drop", default=r"^\[jaxquant tests\]",
                 help="regex of log lines left out of tails (default: the tests' seed lines)")
  p.add_argument("--max-json", type=int, default=4 << 20,
                 help="largest JSON file (bytes) a job wrote that the summary includes")
  p.add_argument("--max-file", type=int, default=4 << 20,
                 help="largest file (bytes) of a job folder that jobs.tar.gz takes (the device "
                      "tool returns files of up to 16 MiB)")
  p.add_argument("--no-check", action="store_true",
                 help="do not import jax and jaxquant to record the extension's state")
  p.add_argument("--dry-run", action="store_true", help="print the jobs and exit")
  args = p.parse_args(argv)

  variables, jobs = {}, []
  try:
    for path in args.jobs:
      found, variables = parse_jobs(path.read_text().splitlines(), str(path), variables)
      jobs += found
    jobs += [parse_job_argument(text, i) for i, text in enumerate(args.job, 1)]
    check_unique(jobs)
  except (JobListError, OSError) as err:
    p.error(str(err))
  if args.only:
    wanted = {n.strip() for n in args.only.split(",") if n.strip()}
    unknown = wanted - {j.name for j in jobs}
    if unknown:
      p.error(f"--only: no job named {sorted(unknown)}; jobs: {[j.name for j in jobs]}")
    jobs = [j for j in jobs if j.name in wanted]
  if not jobs:
    p.error("no jobs: give --jobs FILE or --job 'name: command'")
  if args.dry_run:
    for name, value in variables.items():
      print(f"{name} := {value}")
    for job in jobs:
      where = "all GPUs" if job.mesh else "one GPU" + (", early" if job.early else "")
      limit = f", timeout {job.timeout:.0f} s" if job.timeout is not None else ""
      print(f"{job.name} ({where}{limit}; {job.source}): {job.command}")
    return 0
  return Runner(args, jobs, variables).run()


if __name__ == "__main__":
  sys.exit(main())
