"""README.md runs as written: its Python blocks execute, and `import jaxquant` stays light.

Every ```python block of the README is executed, in order and in one namespace (later blocks may
use names from earlier ones), in a fresh interpreter: the blocks see `jaxquant` exactly as a new
user does, without the submodules that other tests have already imported into this process.
"""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

import pytest

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"
_BLOCK = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.DOTALL | re.MULTILINE)

# Runs the blocks passed as (first line, source) pairs; a failing block's traceback names
# README.md and the line.
_RUNNER = """
import sys
blocks = {blocks!r}
namespace = {{"__name__": "__main__"}}
for line, source in blocks:
  exec(compile("\\n" * (line - 1) + source, {path!r}, "exec"), namespace)
print("ran", len(blocks), "README blocks")
"""


def python_blocks(text: str) -> list[tuple[int, str]]:
  """`(line of the block's first source line, source)` for each ```python block of `text`."""
  return [(text.count("\n", 0, m.start(1)) + 1, m.group(1)) for m in _BLOCK.finditer(text)]


def _run(code: str, tmp_path: pathlib.Path) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                        text=True, timeout=600)


def test_readme_python_blocks_are_found():
  blocks = python_blocks(README.read_text())
  assert blocks, "README.md has no ```python blocks"
  first_line, source = blocks[0]
  assert README.read_text().splitlines()[first_line - 1] == source.splitlines()[0]


def test_quick_start_is_two_commands_in_at_most_15_lines():
  """The Quick start is the two commands a newcomer runs (the example on its built-in data, then
  the tests) and what they do; installs for GPUs, meshes and MoE have sections of their own."""
  text = README.read_text()
  match = re.search(r"^## Quick start\n.*?(?=^## )", text, re.DOTALL | re.MULTILINE)
  assert match, "README.md has no '## Quick start' section followed by another section"
  section = match.group(0).rstrip("\n")
  assert len(section.splitlines()) <= 15, f"Quick start has {len(section.splitlines())} lines"
  blocks = re.findall(r"^```bash\n(.*?)^```", section, re.DOTALL | re.MULTILINE)
  commands = [line.strip() for block in blocks for line in block.splitlines() if line.strip()]
  assert len(commands) == 2, f"Quick start commands: {commands}"
  assert commands[0].endswith("python examples/train_lm.py"), commands[0]  # built-in data
  assert commands[1].startswith("python -m pytest"), commands[1]


def test_readme_python_blocks_run_as_written(tmp_path):
  blocks = python_blocks(README.read_text())
  result = _run(_RUNNER.format(blocks=blocks, path=str(README)), tmp_path)
  assert result.returncode == 0, f"a README block failed:\n{result.stderr[-4000:]}"
  assert f"ran {len(blocks)} README blocks" in result.stdout


@pytest.mark.parametrize("name", ["flax", "nnx"])
def test_flax_submodules_are_imported_on_first_use_only(tmp_path, name):
  """`import jaxquant` imports neither `jaxquant.flax` nor `jaxquant.nnx` (nor Flax NNX);
  `jaxquant.<name>` imports it; only `jaxquant.nnx` brings in Flax NNX."""
  code = f"""
import sys, jaxquant
for module in ("jaxquant.flax", "jaxquant.nnx", "flax.nnx"):
  assert module not in sys.modules, f"import jaxquant imported {{module}}"
assert {name!r} in dir(jaxquant)
sub = jaxquant.{name}
assert sub is sys.modules["jaxquant.{name}"] and jaxquant.{name} is sub
assert ("flax.nnx" in sys.modules) == ({name!r} == "nnx"), "Flax NNX imported by jaxquant.{name}"
try:
  jaxquant.no_such_module
except AttributeError as err:
  assert "no_such_module" in str(err)
else:
  raise AssertionError("jaxquant.no_such_module did not raise AttributeError")
"""
  result = _run(code, tmp_path)
  assert result.returncode == 0, result.stderr[-4000:]
