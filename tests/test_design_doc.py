"""docs/design.md stays true to the code: every citation of it names a section it has, nothing
cites the old out-of-repository design file, and every file (and `file::name`) it names exists."""

from __future__ import annotations

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
DESIGN = ROOT / "docs" / "design.md"
OLD_NAME = "DESIGN" + ".md"  # the contract that lived outside the repository
SOURCES = ("README.md", "jaxquant/**/*.py", "tests/**/*.py", "examples/**/*.py", "bench/**/*",
           "ffi/**/*", "docs/*.md")
TEXT_SUFFIXES = {".py", ".md", ".h", ".cc", ".cu", ".cuh", ".cmake", ".txt"}
_HEADING = re.compile(r"^#{2,3} (\d+(?:\.\d+)?)\.? (.+?)\s*$", re.MULTILINE)
_SECTION = re.compile(r'§(\d+(?:\.\d+)?)(?:\s*"([^"]+)")?')
_PATH = re.compile(r"`([\w./-]+\.(?:py|cu|cuh|h|cc|md|txt|toml|cmake)|[\w./-]+/)(?:::([\w.]+))?`")


def _sections() -> dict[str, str]:
  return {number: title for number, title in _HEADING.findall(DESIGN.read_text())}


def _files() -> list[pathlib.Path]:
  found = set()
  for pattern in SOURCES:
    found.update(p for p in ROOT.glob(pattern) if p.is_file() and p.suffix in TEXT_SUFFIXES)
  return sorted(found)


def _joined(text: str) -> str:
  """Line breaks (and the comment markers after them) as single spaces, so a citation wrapped
  over two lines of a docstring or comment reads as one."""
  return re.sub(r"\s*\n\s*(?:#|//|\*)?\s*", " ", text)


def test_the_design_has_numbered_sections():
  sections = _sections()
  assert {"3", "5", "6.3", "7", "9"} <= set(sections), sorted(sections)
  assert sections["4"] == "Formats"


@pytest.mark.parametrize("path", _files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_citations_name_sections_that_exist(path):
  text = path.read_text(errors="replace")
  name = path.relative_to(ROOT)
  assert OLD_NAME not in text, f"{name} cites {OLD_NAME}; cite docs/design.md §N \"Title\""
  if path == DESIGN or "docs/design.md" not in text:
    return
  sections = _sections()
  joined = _joined(text)
  for start in (m.end() for m in re.finditer(r"docs/design\.md", joined)):
    cited = list(_SECTION.finditer(joined[start:start + 200]))
    # the citation and any "§N "Title"" that continue it (", §6.3 "GEMM paths"")
    for match in cited[:1] + [m for m in cited[1:] if m.group(2)]:
      number, title = match.groups()
      assert number in sections, f"{name}: docs/design.md has no §{number}"
      assert title is not None, f"{name}: cite §{number} with its title \"{sections[number]}\""
      assert title == sections[number], (
          f"{name}: §{number} is \"{sections[number]}\", not \"{title}\"")


def test_the_design_refers_to_its_own_sections():
  sections = _sections()
  for number, _ in _SECTION.findall(DESIGN.read_text()):
    assert number in sections, f"docs/design.md refers to §{number}, which it does not have"


def _repository_paths() -> list[str]:
  paths = []
  for p in ROOT.rglob("*"):
    relative = p.relative_to(ROOT)
    if relative.parts[0] in (".git", "build") or "__pycache__" in relative.parts:
      continue
    paths.append(str(relative) + ("/" if p.is_dir() else ""))
  return paths


def test_every_file_and_name_the_design_mentions_exists():
  paths = _repository_paths()
  for name, symbol in _PATH.findall(DESIGN.read_text()):
    matches = [p for p in paths if p == name or p.endswith("/" + name)]
    assert matches, f"docs/design.md names `{name}`, which no file or folder of the repository is"
    if symbol:
      last = symbol.split(".")[-1]
      defined = re.compile(rf"^\s*(?:def|class) {re.escape(last)}\b|^{re.escape(last)}\s*[:=]",
                           re.MULTILINE)
      assert any(defined.search((ROOT / m).read_text()) for m in matches if not m.endswith("/")), (
          f"docs/design.md names `{name}::{symbol}`, which {matches} do not define")
