"""The extension built on the developer's machine for the GPU machine, and the check that it
still matches the sources.

A fresh GPU machine spends ~3 minutes of device time building the extension with nvcc; the same
build runs on the developer's machine (nvcc 13.0 there too, no GPU needed) for the GPU machine's
Python and JAX, and travels with the call (`carry`). `bench/run.py --prebuilt DIR` takes it only
when its sources' digest equals the tree's and it loads with CUDA served; otherwise it says why
and builds as before.

    # here, once per change of ffi/ or the build files (~30 min on two cores):
    python3 bench/prebuilt.py make --python /tmp/v312/bin/python --out .prebuilt
    # on the device, in the call that carries .prebuilt:
    python3 bench/run.py --prebuilt .prebuilt --jobs bench/jobs/X.txt
    # after a kernel change, the old build beside the new one (run.py builds the tree's):
    LIB=$(python3 bench/prebuilt.py baseline --into /tmp/before)
    PYTHONPATH=/tmp/before:examples LD_LIBRARY_PATH=$LIB python bench/X.py

The venv for `make` needs the GPU machine's Python minor version (3.12) with its jax and jaxlib
versions (0.11.2; the FFI headers), nanobind, scikit-build-core and nvidia-cublas (cuBLASLt,
soname libcublasLt.so.13), and `JAXQUANT_CUTLASS_DIR` set for the CUTLASS grouped kernels.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import zipfile
from typing import Optional, Sequence

# What the extension is built from: a change to any of these makes a prebuilt one stale. The
# notes beside the sources (ffi/**/*.md) are not build inputs: editing them keeps a prebuilt
# extension (session 24 rebuilt one on the GPU machine, 192 s, after a NOTES edit).
SOURCE_PATTERNS = ("CMakeLists.txt", "pyproject.toml", "ffi/**/*")
NOT_SOURCES = (".md",)
MANIFEST = "manifest.json"
EXTENSION = re.compile(r"_jaxquant_ffi[^/]*\.(so|pyd)")


def sources_digest(root: pathlib.Path) -> str:
  """sha256 over the extension's source files (relative paths and bytes, in sorted order)."""
  digest = hashlib.sha256()
  files = sorted({p for pattern in SOURCE_PATTERNS for p in root.glob(pattern)
                  if p.is_file() and p.suffix not in NOT_SOURCES})
  for path in files:
    digest.update(path.relative_to(root).as_posix().encode() + b"\0")
    digest.update(path.read_bytes() + b"\0")
  return digest.hexdigest()


def accept(root: pathlib.Path, prebuilt: pathlib.Path,
           ext_suffix: Optional[str] = None) -> tuple[bool, str]:
  """Copies `prebuilt`'s extension into `root`/jaxquant when it was built from the tree's
  sources for this interpreter; returns (taken, why)."""
  ext_suffix = ext_suffix or sysconfig.get_config_var("EXT_SUFFIX")
  name = "_jaxquant_ffi" + ext_suffix
  library = prebuilt / name
  if not library.is_file():
    found = sorted(p.name for p in prebuilt.glob("_jaxquant_ffi*")) if prebuilt.is_dir() else []
    return False, f"no {name} in {prebuilt} (found {found or 'none'})"
  try:
    manifest = json.loads((prebuilt / MANIFEST).read_text())
  except (OSError, ValueError) as err:
    return False, f"{prebuilt / MANIFEST} unreadable: {err}"
  tree = sources_digest(root)
  if manifest.get("sources") != tree:
    return False, (f"built from other sources (digest {str(manifest.get('sources'))[:12]}, "
                   f"the tree's {tree[:12]}): ffi/ or the build files changed since")
  target = root / "jaxquant" / name
  target.unlink(missing_ok=True)
  target.write_bytes(library.read_bytes())
  return True, f"{name} from {prebuilt} (sources {tree[:12]}, built at {manifest.get('commit')})"


def cuda_library_dir() -> Optional[str]:
  """The nvidia-cublas wheel's library folder (nvidia/cu13/lib), where the prebuilt extension
  finds libcublasLt.so.13 on the GPU machine (its RUNPATH names the build machine's)."""
  try:
    import nvidia  # the namespace package of NVIDIA's CUDA wheels
  except ImportError:
    return None
  for base in getattr(nvidia, "__path__", []):
    candidate = pathlib.Path(base) / "cu13" / "lib"
    if candidate.is_dir():
      return str(candidate)
  return None


def make(root: pathlib.Path, python: str, out: pathlib.Path) -> dict:
  """Builds the extension with `python` (the target interpreter's venv) into `out`."""
  out.mkdir(parents=True, exist_ok=True)
  with tempfile.TemporaryDirectory() as wheel_dir:
    subprocess.run([python, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps",
                    "-w", wheel_dir, str(root)], check=True)
    wheels = sorted(pathlib.Path(wheel_dir).glob("jaxquant-*.whl"))
    with zipfile.ZipFile(wheels[-1]) as wheel:
      members = [m for m in wheel.namelist() if EXTENSION.fullmatch(m.rsplit("/", 1)[-1])]
      for member in members:
        (out / member.rsplit("/", 1)[-1]).write_bytes(wheel.read(member))
  commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True,
                          text=True).stdout.strip()
  manifest = {"sources": sources_digest(root), "commit": commit, "python": python,
              "libraries": [m.rsplit("/", 1)[-1] for m in members]}
  (out / MANIFEST).write_text(json.dumps(manifest, indent=1))
  return manifest


def stage_baseline(root: pathlib.Path, prebuilt: pathlib.Path, into: pathlib.Path) -> str:
  """A copy of the tree's `jaxquant` package with `prebuilt`'s extension in it, whatever sources
  it was built from: the *before* of a kernel change, run beside the tree's new build in one call
  (`PYTHONPATH=<into>`). Returns the `LD_LIBRARY_PATH` entry its library needs (or "")."""
  target = into / "jaxquant"
  shutil.rmtree(target, ignore_errors=True)
  skip = lambda folder, names: [n for n in names if EXTENSION.fullmatch(n) or n == "__pycache__"]
  shutil.copytree(root / "jaxquant", target, ignore=skip)
  libraries = [p for p in prebuilt.glob("_jaxquant_ffi*") if EXTENSION.fullmatch(p.name)]
  if not libraries:
    raise FileNotFoundError(f"no _jaxquant_ffi library in {prebuilt}")
  for library in libraries:
    shutil.copy2(library, target / library.name)
  return cuda_library_dir() or ""


def main(argv: Optional[Sequence[str]] = None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  sub = p.add_subparsers(dest="command", required=True)
  m = sub.add_parser("make", help="build the extension for another interpreter into --out")
  m.add_argument("--python", required=True, help="the target interpreter (its venv has jax)")
  m.add_argument("--out", type=pathlib.Path, default=pathlib.Path(".prebuilt"))
  sub.add_parser("digest", help="print the tree's sources digest")
  b = sub.add_parser("baseline", help="stage the tree's jaxquant with --prebuilt's (older) "
                     "extension into --into; prints the LD_LIBRARY_PATH entry it needs")
  b.add_argument("--prebuilt", type=pathlib.Path, default=pathlib.Path(".prebuilt"))
  b.add_argument("--into", type=pathlib.Path, required=True)
  args = p.parse_args(argv)
  root = pathlib.Path(__file__).resolve().parents[1]
  if args.command == "digest":
    print(sources_digest(root))
    return 0
  if args.command == "baseline":
    print(stage_baseline(root, args.prebuilt, args.into))
    return 0
  if not os.environ.get("JAXQUANT_CUTLASS_DIR"):
    print("warning: JAXQUANT_CUTLASS_DIR is unset: the CUTLASS grouped kernels are left out",
          file=sys.stderr)
  print(json.dumps(make(root, args.python, args.out), indent=1))
  return 0


if __name__ == "__main__":
  sys.exit(main())
