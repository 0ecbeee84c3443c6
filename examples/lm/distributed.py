"""Several processes (one per host, or per GPU) training one model through `jax.distributed`.

Each process names the coordinator (process 0's `HOST:PORT`), the process count and its own id,
by flag or environment variable (the flag wins):

    --coordinator HOST:PORT   JAX_COORDINATOR_ADDRESS   (JAX's own variable)
    --num-processes N         JAX_NUM_PROCESSES
    --process-id I            JAX_PROCESS_ID            (0 ... N-1; process 0 runs the coordinator)

A bad launch fails within `--init-timeout` seconds with an error naming the flag to fix, instead
of JAX's runtime waiting or aborting without saying which setting is wrong:
- a process whose coordinator never answers says `--coordinator`;
- a process still waiting for the others when the timeout ends says `--num-processes` /
  `--process-id` (fewer processes started than `--num-processes` says; JAX's runtime ends the
  process then, so a watchdog thread prints the error and exits with status 2 first);
- processes launched with different settings (`--num-processes`, `--mesh`, `--batch`, ...,
  or corpora that differ) all stop at `check_same_settings`, naming the flags that differ.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import socket
import sys
import threading
import time
import traceback
import zlib
from typing import Any, Iterator, Mapping, Optional

import jax
import numpy as np

ENV = {"coordinator": "JAX_COORDINATOR_ADDRESS", "num_processes": "JAX_NUM_PROCESSES",
       "process_id": "JAX_PROCESS_ID"}
FLAGS = {"coordinator": "--coordinator", "num_processes": "--num-processes",
         "process_id": "--process-id"}
DEFAULT_INIT_TIMEOUT = 120  # seconds for every process to reach the coordinator
_RUNTIME_GRACE = 30  # JAX's own connect timeout runs this much longer than the watchdog's
_initialized = False


@dataclasses.dataclass(frozen=True)
class Launch:
  """Where this process stands in the run: one process (`num_processes == 1`) or several."""

  coordinator: Optional[str] = None
  num_processes: int = 1
  process_id: int = 0
  init_timeout: float = DEFAULT_INIT_TIMEOUT

  @property
  def multi_process(self) -> bool:
    return self.num_processes > 1

  def describe(self) -> str:
    return (f"process {self.process_id} of {self.num_processes} (--process-id, "
            f"--num-processes), coordinator {self.coordinator} (--coordinator)")


def _int_setting(name: str, flag_value: Optional[int], environ: Mapping[str, str]):
  if flag_value is not None:
    return flag_value
  raw = environ.get(ENV[name], "").strip()
  if not raw:
    return None
  try:
    return int(raw)
  except ValueError:
    raise ValueError(f"${ENV[name]}={raw!r}: expected an integer (or pass "
                     f"{FLAGS[name]})") from None


def resolve_launch(coordinator: Optional[str], num_processes: Optional[int],
                   process_id: Optional[int], init_timeout: float = DEFAULT_INIT_TIMEOUT,
                   environ: Mapping[str, str] = os.environ) -> Launch:
  """The launch from flags (None: not given), else the environment variables; validated.

  Raises:
    ValueError naming the flag (and variable) that is missing or out of range.
  """
  coordinator = coordinator or environ.get(ENV["coordinator"], "").strip() or None
  count = _int_setting("num_processes", num_processes, environ)
  pid = _int_setting("process_id", process_id, environ)
  if init_timeout <= 0:
    raise ValueError(f"--init-timeout {init_timeout}: expected a positive number of seconds")
  if count is None:
    given = [FLAGS[k] for k, v in (("coordinator", coordinator), ("process_id", pid))
             if v is not None and not (k == "process_id" and v == 0)]
    if given:
      raise ValueError(f"{' and '.join(given)} given without --num-processes "
                       f"(${ENV['num_processes']}): pass the number of processes of the run")
    return Launch(None, 1, 0, init_timeout)
  if count < 1:
    raise ValueError(f"--num-processes {count}: expected a positive number of processes")
  if pid is not None and not 0 <= pid < count:
    raise ValueError(f"--process-id {pid}: expected 0 ... {count - 1} "
                     f"(--num-processes {count})")
  if count == 1:
    return Launch(coordinator, 1, 0, init_timeout)
  if coordinator is None:
    raise ValueError(f"--num-processes {count} needs --coordinator HOST:PORT (or "
                     f"${ENV['coordinator']}): process 0's address, the same for every process")
  _split_address(coordinator)
  if pid is None:
    raise ValueError(f"--num-processes {count} needs --process-id (or ${ENV['process_id']}): "
                     f"this process's id, 0 ... {count - 1}, a different one per process")
  return Launch(coordinator, count, pid, init_timeout)


def _split_address(address: str) -> tuple[str, int]:
  host, sep, port = address.rpartition(":")
  if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
    raise ValueError(f"--coordinator {address!r}: expected HOST:PORT such as 10.0.0.1:12345")
  return host.strip("[]"), int(port)


def initialize(launch: Launch) -> None:
  """Join the run (no-op for one process): `jax.distributed.initialize`, bounded in time.

  Call before anything starts a JAX backend. CPU devices talk through gloo (jax's CPU
  collectives) unless `$JAX_CPU_COLLECTIVES_IMPLEMENTATION` chooses another.
  """
  global _initialized
  if not launch.multi_process or _initialized:
    return
  deadline = time.monotonic() + launch.init_timeout
  host, port = _split_address(launch.coordinator)
  if launch.process_id == 0:
    _check_port_free(launch, port)
  else:
    _wait_reachable(launch, host, port, deadline)
  if "JAX_CPU_COLLECTIVES_IMPLEMENTATION" not in os.environ:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
  remaining = max(1.0, deadline - time.monotonic())
  print(f"[{launch.describe()}] connecting; waiting up to {remaining:.0f} s for all "
        f"{launch.num_processes} processes (--init-timeout)", file=sys.stderr, flush=True)
  watchdog = threading.Timer(remaining, _give_up, args=(launch, host, port))
  watchdog.daemon = True
  watchdog.start()
  try:
    jax.distributed.initialize(launch.coordinator, launch.num_processes, launch.process_id,
                               initialization_timeout=int(remaining) + _RUNTIME_GRACE)
  finally:
    watchdog.cancel()
  _initialized = True


def initialized() -> bool:
  """Whether this process joined a multi-process run through `initialize`."""
  return _initialized


def is_primary() -> bool:
  """Process 0 (or the only process): the one that logs, writes CSVs and plots."""
  return not _initialized or jax.process_index() == 0


def _check_port_free(launch: Launch, port: int) -> None:
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
    probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
      probe.bind(("", port))
    except OSError as err:
      raise ValueError(f"--coordinator {launch.coordinator}: process 0 runs the coordinator "
                       f"on port {port}, which this host cannot listen on ({err}); pick a free "
                       "port and pass the same --coordinator to every process (or, if another "
                       "process 0 of this run holds it, check --process-id)") from None


def _reachable(host: str, port: int) -> bool:
  try:
    with socket.create_connection((host, port), timeout=2.0):
      return True
  except OSError:
    return False


def _wait_reachable(launch: Launch, host: str, port: int, deadline: float) -> None:
  while not _reachable(host, port):
    if time.monotonic() >= deadline:
      raise ValueError(
          f"--coordinator {launch.coordinator}: nothing accepted a connection there within "
          f"{launch.init_timeout:.0f} s (--init-timeout); start process 0 (--process-id 0) "
          "and pass its address as this host reaches it")
    time.sleep(0.25)


def _give_up(launch: Launch, host: str, port: int) -> None:
  """The watchdog: print which flags to check and end the process (JAX would abort later)."""
  problem = (f"not all {launch.num_processes} processes joined: start one process per "
             f"--process-id 0 ... {launch.num_processes - 1}, each with --num-processes "
             f"{launch.num_processes} and --coordinator {launch.coordinator} (or raise "
             "--init-timeout if hosts start slowly)")
  if launch.process_id != 0 and not _reachable(host, port):
    problem += "; the coordinator no longer answers (process 0 stopped, or gave up too)"
  print(f"error: [{launch.describe()}] gave up after {launch.init_timeout:.0f} s "
        f"(--init-timeout): {problem}", file=sys.stderr, flush=True)
  _exit_now(2)


def _digest(value: Any) -> int:
  return zlib.crc32(json.dumps(value, sort_keys=True, default=str).encode())


def check_same_settings(settings: Mapping[str, Any]) -> None:
  """Raise in every process if any setting differs between processes (no-op for one process).

  `settings` maps a flag name (`"--mesh"`) to this process's value; all processes must pass the
  same keys. Compared by CRC32 of their JSON, gathered from every process.
  """
  if not _initialized:
    return
  from jax.experimental import multihost_utils  # noqa: PLC0415

  names = sorted(settings)
  # int32 (JAX's default integer width): the uint32 digests' bits
  mine = np.array([_digest(names)] + [_digest(settings[n]) for n in names], np.uint32)
  mine = mine.view(np.int32)
  every = np.asarray(multihost_utils.process_allgather(mine))  # [processes, 1 + len(names)]
  if (every[:, 0] != mine[0]).any():
    raise ValueError("the processes run different versions of the script (their settings "
                     "have different names); launch the same code everywhere")
  differ = [name for i, name in enumerate(names, 1) if (every[:, i] != mine[i]).any()]
  if differ:
    by_process = {n: [int(p) for p in np.nonzero(every[:, i] != every[0, i])[0]]
                  for i, n in enumerate(names, 1) if n in differ}
    raise ValueError(f"{', '.join(differ)} {'differs' if len(differ) == 1 else 'differ'} "
                     "between processes (processes differing "
                     f"from process 0: {by_process}; this process, {jax.process_index()}, "
                     f"has {', '.join(f'{n} {settings[n]!r}' for n in differ)}); launch every "
                     "process with the same settings")


@contextlib.contextmanager
def exit_on_error() -> Iterator[None]:
  """In a multi-process run, an exception ends this process at once (traceback, status 1).

  Otherwise Python's exit would wait in JAX's shutdown barrier for peers that may be blocked in
  a collective on this process; exiting lets the runtime stop them (heartbeat timeout) instead.
  """
  try:
    yield
  except SystemExit as err:  # argparse's errors and sys.exit("message")
    if not _initialized or not err.code:
      raise
    if not isinstance(err.code, int):
      print(err.code, file=sys.stderr)
    _exit_now(err.code if isinstance(err.code, int) else 1)
  except BaseException:  # noqa: BLE001 - re-raised for one process
    if not _initialized:
      raise
    traceback.print_exc()
    _exit_now(1)


def _exit_now(status: int) -> None:
  sys.stdout.flush()
  sys.stderr.flush()
  os._exit(status)
