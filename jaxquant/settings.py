"""Settings read from environment variables when a program is traced (A/B switches for
benchmarks and tests): one reader, so every variable accepts the same spellings and names its
valid values in the same error."""

from __future__ import annotations

import os
from typing import Sequence


def env_choice(name: str, choices: Sequence[str], default: str) -> str:
  """The value of environment variable `name`, stripped and lower-cased (`default` when unset
  or empty); a value outside `choices` is a ValueError naming the variable and what is valid."""
  value = os.environ.get(name, "").strip().lower() or default
  if value not in choices:
    raise ValueError(f"{name}={value!r}; expected one of {tuple(choices)}")
  return value
