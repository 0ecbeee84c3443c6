"""Byte-level text from the Python standard library's own `.py` files (present on every machine).

Files are read in sorted order (deterministic), concatenated with a newline between files and
capped at `max_bytes`; the last `val_fraction` of the files (by count, at least one) is the
validation split. Tokens are bytes, so the vocabulary is 256.
"""

from __future__ import annotations

import dataclasses
import pathlib
import sysconfig
import zlib
from typing import Iterator, Optional

import numpy as np

VOCAB = 256
_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})


def stdlib_files(root: Optional[str] = None) -> list[pathlib.Path]:
  """The standard library's `.py` files in sorted order (installed packages excluded)."""
  root_path = pathlib.Path(root or sysconfig.get_paths()["stdlib"])
  files = [p for p in root_path.rglob("*.py")
           if not _SKIP_DIRS.intersection(p.relative_to(root_path).parts) and p.is_file()]
  if not files:
    raise FileNotFoundError(f"no .py files under {root_path}; pass another corpus root")
  return sorted(files)


@dataclasses.dataclass(frozen=True)
class Corpus:
  """Train and validation byte streams (uint8) and where they came from."""

  train: np.ndarray
  val: np.ndarray
  num_train_files: int
  num_val_files: int
  root: str

  def describe(self) -> str:
    return (f"corpus: {self.num_train_files} train files ({self.train.size / 1e6:.2f} MB), "
            f"{self.num_val_files} val files ({self.val.size / 1e6:.2f} MB) from {self.root}")

  def digest(self) -> int:
    """CRC32 of the train and validation bytes: processes of one run must read the same."""
    return zlib.crc32(self.val, zlib.crc32(self.train))


def load_corpus(max_bytes: int, val_fraction: float = 0.05,
                root: Optional[str] = None) -> Corpus:
  """Read stdlib files in sorted order until `max_bytes`, then split off the last files.

  Args:
    max_bytes: cap on the total corpus size (train + validation).
    val_fraction: fraction of the files (the last ones read) held out for validation.
    root: directory to read instead of the standard library.
  """
  if not 0.0 < val_fraction < 1.0:
    raise ValueError(f"val_fraction={val_fraction!r}; expected a fraction in (0, 1)")
  chunks, total = [], 0
  for path in stdlib_files(root):
    if total >= max_bytes:
      break
    raw = path.read_bytes()[:max_bytes - total] + b"\n"
    chunks.append(raw)
    total += len(raw)
  num_val = max(1, int(round(len(chunks) * val_fraction)))
  if len(chunks) - num_val < 1:
    raise ValueError(f"max_bytes={max_bytes} reads only {len(chunks)} file(s); need at least 2 "
                     "to hold out a validation split")
  as_array = lambda parts: np.frombuffer(b"".join(parts), dtype=np.uint8)
  root_name = str(root or sysconfig.get_paths()["stdlib"])
  return Corpus(as_array(chunks[:-num_val]), as_array(chunks[-num_val:]),
                len(chunks) - num_val, num_val, root_name)


def random_batches(stream: np.ndarray, batch: int, seq: int, seed: int, skip: int = 0,
                   rows: Optional[np.ndarray] = None) -> Iterator[np.ndarray]:
  """Endless `[batch, seq + 1]` int32 windows at random offsets (inputs and shifted targets).

  `skip`: start after that many batches of the same stream (a resumed run's data position);
  the offsets are drawn and dropped, so batch `skip + i` is the one an unbroken stream yields.
  `rows`: yield only these rows of every batch (`[len(rows), seq + 1]`): one process's share
  of a batch sharded over several processes; every process draws the same offsets.
  """
  if stream.size < seq + 2:
    raise ValueError(f"stream of {stream.size} bytes is too short for seq={seq}")
  if skip < 0:
    raise ValueError(f"skip={skip}: expected a number of batches >= 0")
  rng = np.random.default_rng(seed)
  for _ in range(skip):
    rng.integers(0, stream.size - seq - 1, size=batch)
  while True:
    starts = rng.integers(0, stream.size - seq - 1, size=batch)
    if rows is not None:
      starts = starts[rows]
    yield np.stack([stream[s:s + seq + 1] for s in starts]).astype(np.int32)


def fixed_batches(stream: np.ndarray, batch: int, seq: int, num_batches: int,
                  rows: Optional[np.ndarray] = None) -> np.ndarray:
  """`[num_batches, batch, seq + 1]` windows evenly spread over `stream` (a fixed eval set);
  with `rows`, only those rows of each batch (`[num_batches, len(rows), seq + 1]`)."""
  count = num_batches * batch
  if stream.size < seq + 2:
    raise ValueError(f"stream of {stream.size} bytes is too short for seq={seq}")
  starts = np.linspace(0, stream.size - seq - 1, num=count).astype(np.int64)
  starts = starts.reshape(num_batches, batch)
  if rows is not None:
    starts = starts[:, rows]
  windows = np.stack([stream[s:s + seq + 1] for s in starts.reshape(-1)]).astype(np.int32)
  return windows.reshape(num_batches, starts.shape[1], seq + 1)
