"""Start the processes of a multi-process run on this machine (tests, benchmarks, trying it out).

`LocalRun(argv, n)` starts `python argv... --coordinator localhost:PORT --num-processes n
--process-id i` for i = 0 ... n-1 (a free port picked here; n = 1 starts one plain process),
each with its own environment additions (`env_for(i)`: `CUDA_VISIBLE_DEVICES`, host device
counts), its output captured to a file. `wait` returns every process's exit status and output;
when one fails the others get `grace` seconds to stop (a peer blocked in a collective waits for
the runtime's heartbeat timeout otherwise), then they are killed: first with SIGABRT, on which
Python's faulthandler (enabled in every child) prints where each thread was, then SIGKILL. Leaving
the `with` block kills whatever still runs, so no process outlives its caller.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Callable, Mapping, Optional, Sequence


def free_port() -> int:
  """A TCP port nothing listens on now (the OS's choice; free until someone else takes it)."""
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
    probe.bind(("localhost", 0))
    return probe.getsockname()[1]


@dataclasses.dataclass(frozen=True)
class Finished:
  """One process's end: exit status (None: killed at the timeout) and its output."""

  process_id: int
  returncode: Optional[int]
  output: str

  def tail(self, lines: int = 60) -> str:
    return "\n".join(self.output.splitlines()[-lines:])


class LocalRun:
  """The processes of one run on this machine (see the module docstring).

  Args:
    argv: the script and its arguments, without the launch flags.
    num_processes: how many processes; 1 runs the script as is.
    env_for: process id -> environment variables to add (or None).
    env: the base environment (default: this process's).
    cwd: working directory of every process.
  """

  def __init__(self, argv: Sequence[str], num_processes: int,
               env_for: Optional[Callable[[int], Mapping[str, str]]] = None,
               env: Optional[Mapping[str, str]] = None, cwd: Optional[str] = None):
    if num_processes < 1:
      raise ValueError(f"num_processes={num_processes}: expected >= 1")
    self._logs = tempfile.TemporaryDirectory(prefix="jaxquant-run-")
    self.coordinator = f"localhost:{free_port()}" if num_processes > 1 else None
    self.processes: list[subprocess.Popen] = []
    self._files = []
    try:
      for i in range(num_processes):
        launch = ([] if num_processes == 1 else
                  ["--coordinator", self.coordinator, "--num-processes", str(num_processes),
                   "--process-id", str(i)])
        child_env = dict(os.environ if env is None else env)
        child_env.update(env_for(i) if env_for else {})
        child_env.setdefault("PYTHONUNBUFFERED", "1")  # output up to a kill is kept
        child_env.setdefault("PYTHONFAULTHANDLER", "1")  # SIGABRT prints every thread's stack
        out = open(pathlib.Path(self._logs.name) / f"process{i}.log", "w+")  # noqa: SIM115
        self._files.append(out)
        self.processes.append(subprocess.Popen(
            [sys.executable, *argv, *launch], env=child_env, cwd=cwd, stdout=out,
            stderr=subprocess.STDOUT, start_new_session=True))
    except BaseException:
      self.kill()
      raise

  def wait(self, timeout: float, grace: float = 30.0) -> list[Finished]:
    """Wait for every process, up to `timeout` seconds in all (and `grace` more after the first
    failure); kill the rest. Returns each process's status and output, process 0 first."""
    deadline = time.monotonic() + timeout
    while any(p.poll() is None for p in self.processes) and time.monotonic() < deadline:
      if any(p.poll() not in (None, 0) for p in self.processes):
        deadline = min(deadline, time.monotonic() + grace)
      time.sleep(0.1)
    killed = {i for i, p in enumerate(self.processes) if p.poll() is None}
    self._signal(killed, signal.SIGABRT)  # where they hung, in their output
    stop = time.monotonic() + 10.0
    while any(self.processes[i].poll() is None for i in killed) and time.monotonic() < stop:
      time.sleep(0.1)
    self.kill()
    results = []
    for i, (process, out) in enumerate(zip(self.processes, self._files, strict=True)):
      out.flush()
      out.seek(0)
      results.append(Finished(i, None if i in killed else process.returncode, out.read()))
    return results

  def _signal(self, which, signum: int) -> None:
    for i in which:
      if self.processes[i].poll() is None:
        try:
          os.killpg(self.processes[i].pid, signum)
        except ProcessLookupError:
          pass

  def kill(self) -> None:
    """Kill every process still running (and its process group) and reap them all."""
    self._signal(range(len(self.processes)), signal.SIGKILL)
    for process in self.processes:
      process.wait()

  def close(self) -> None:
    self.kill()
    for out in self._files:
      out.close()
    self._logs.cleanup()

  def __enter__(self) -> LocalRun:
    return self

  def __exit__(self, *exc) -> None:
    self.close()


def report(results: Sequence[Finished], lines: int = 60) -> str:
  """Every process's exit status and the last lines of its output (for error messages)."""
  return "\n".join(f"--- process {r.process_id}: "
                   f"{'killed at the timeout' if r.returncode is None else f'exit {r.returncode}'}"
                   f"\n{r.tail(lines)}" for r in results)
