"""`bench/prebuilt.py`: an extension built elsewhere is taken only when it was built from the
tree's sources for this interpreter, and `bench/run.py --prebuilt` builds (saying why) when it is
not taken."""

from __future__ import annotations

import importlib.util
import json
import pathlib
import subprocess
import sys
import sysconfig

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
SUFFIX = sysconfig.get_config_var("EXT_SUFFIX")


@pytest.fixture(scope="module")
def prebuilt():
  spec = importlib.util.spec_from_file_location("bench_prebuilt", ROOT / "bench" / "prebuilt.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _tree(tmp_path, rng) -> pathlib.Path:
  """A checkout's build inputs: CMakeLists, pyproject, two ffi sources, jaxquant/."""
  root = tmp_path / "tree"
  (root / "ffi" / "quantize").mkdir(parents=True)
  (root / "jaxquant").mkdir()
  for name in ("CMakeLists.txt", "pyproject.toml", "ffi/module.cc", "ffi/quantize/q.cu"):
    (root / name).write_bytes(rng.bytes(64))
  return root


def _prebuilt_folder(prebuilt, root, tmp_path, rng, suffix=SUFFIX) -> tuple[pathlib.Path, bytes]:
  folder = tmp_path / "prebuilt"
  folder.mkdir(exist_ok=True)
  library = rng.bytes(256)
  (folder / ("_jaxquant_ffi" + suffix)).write_bytes(library)
  (folder / prebuilt.MANIFEST).write_text(json.dumps(
      {"sources": prebuilt.sources_digest(root), "commit": "abc"}))
  return folder, library


def test_the_digest_follows_every_build_input_and_nothing_else(prebuilt, tmp_path, rng):
  root = _tree(tmp_path, rng)
  before = prebuilt.sources_digest(root)
  (root / "README.md").write_text("not a build input")
  (root / "jaxquant" / "x.py").write_text("neither")
  (root / "ffi" / "NOTES.md").write_text("notes beside the sources, not built")
  assert prebuilt.sources_digest(root) == before
  for name in ("ffi/quantize/q.cu", "CMakeLists.txt", "pyproject.toml"):
    (root / name).write_bytes((root / name).read_bytes() + b" ")
    after = prebuilt.sources_digest(root)
    assert after != before, name
    before = after
  (root / "ffi" / "new.h").write_bytes(b"")  # a new, empty source counts too
  assert prebuilt.sources_digest(root) != before


def test_a_matching_extension_is_copied_into_the_package(prebuilt, tmp_path, rng):
  root = _tree(tmp_path, rng)
  folder, library = _prebuilt_folder(prebuilt, root, tmp_path, rng)
  taken, why = prebuilt.accept(root, folder)
  assert taken, why
  assert (root / "jaxquant" / ("_jaxquant_ffi" + SUFFIX)).read_bytes() == library


def test_stale_sources_are_refused_with_the_reason(prebuilt, tmp_path, rng):
  root = _tree(tmp_path, rng)
  folder, _ = _prebuilt_folder(prebuilt, root, tmp_path, rng)
  (root / "ffi" / "module.cc").write_bytes(rng.bytes(64))
  taken, why = prebuilt.accept(root, folder)
  assert not taken and "other sources" in why and "ffi/" in why
  assert not list((root / "jaxquant").glob("_jaxquant_ffi*"))


def test_another_interpreters_build_is_refused_naming_what_was_found(prebuilt, tmp_path, rng):
  root = _tree(tmp_path, rng)
  folder, _ = _prebuilt_folder(prebuilt, root, tmp_path, rng, suffix=".cpython-399-x.so")
  taken, why = prebuilt.accept(root, folder)
  assert not taken and f"no _jaxquant_ffi{SUFFIX}" in why and "cpython-399" in why


def test_the_runner_builds_when_the_prebuilt_one_is_refused(tmp_path):
  """`run.py --prebuilt` on an empty folder: the refusal is logged and the build starts (here
  it is made to fail at once by a cmake define that no build takes)."""
  (tmp_path / "jobs.txt").write_text("ok: echo hi\n")
  out = tmp_path / "out"
  (tmp_path / "empty").mkdir()
  result = subprocess.run(
      [sys.executable, str(ROOT / "bench" / "run.py"), "--jobs", str(tmp_path / "jobs.txt"),
       "--prebuilt", str(tmp_path / "empty"), "--no-check", "--out", str(out), "--deadline", "60",
       "--cmake-define", "CMAKE_MAKE_PROGRAM=/nonexistent/ninja"],
      capture_output=True, text=True, timeout=120)
  summary = json.loads((out / "summary.json").read_text())
  assert "no _jaxquant_ffi" in summary["prebuilt_refused"]
  assert "prebuilt extension not taken" in result.stdout + (out / "log.txt").read_text()
  assert summary["build"]["status"] != "prebuilt"


def test_baseline_stages_the_package_with_the_prebuilt_library_whatever_its_sources(
    prebuilt, tmp_path, rng):
  """`baseline`: the tree's Python files beside the prebuilt (older) library, never the tree's
  own library, even when the sources changed since that build (it is the *before*)."""
  root = _tree(tmp_path, rng)
  (root / "jaxquant" / "__init__.py").write_bytes(rng.bytes(32))
  (root / "jaxquant" / "ops").mkdir()
  (root / "jaxquant" / "ops" / "gemm.py").write_bytes(rng.bytes(32))
  (root / "jaxquant" / ("_jaxquant_ffi" + SUFFIX)).write_bytes(b"new build")
  folder, library = _prebuilt_folder(prebuilt, root, tmp_path, rng)
  (root / "ffi" / "module.cc").write_bytes(rng.bytes(64))  # the sources moved on
  into = tmp_path / "before"
  prebuilt.stage_baseline(root, folder, into)
  staged = into / "jaxquant"
  assert (staged / ("_jaxquant_ffi" + SUFFIX)).read_bytes() == library
  for name in ("__init__.py", "ops/gemm.py"):
    assert (staged / name).read_bytes() == (root / "jaxquant" / name).read_bytes()
  with pytest.raises(FileNotFoundError, match="no _jaxquant_ffi library"):
    prebuilt.stage_baseline(root, tmp_path / "empty", tmp_path / "again")
