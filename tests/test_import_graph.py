"""The package's module-level import graph is a DAG (the layers import only from below).

Edges are what executes when a module is imported: each module-level `import` / `from ... import`
of a jaxquant module, plus the packages above the imported module (importing `a.b.c` runs
`a/__init__` and `a/b/__init__` first), except the packages the importer itself lives in (they
are already being imported) and the top-level `jaxquant` facade, which imports the public API.
Imports inside functions are listed separately: only optional dependencies may use them.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

import jaxquant

PACKAGE_DIR = pathlib.Path(jaxquant.__file__).parent
ROOT = "jaxquant"
EXTENSION = "jaxquant._jaxquant_ffi"  # the compiled FFI module (may be absent)

# Function-level imports that load optional dependencies (not jaxquant modules to dodge a cycle).
OPTIONAL_LAZY = {
    "jaxquant": {"jaxquant.flax", "jaxquant.nnx"},
}


def _module_name(path: pathlib.Path) -> str:
  parts = path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_package(path: pathlib.Path) -> bool:
  return path.name == "__init__.py"


MODULES = {_module_name(p): p for p in sorted(PACKAGE_DIR.rglob("*.py"))}


def _resolve(importer: str, is_package: bool, node: ast.AST) -> list[str]:
  """The jaxquant modules an import statement loads (most specific existing module)."""
  if isinstance(node, ast.Import):
    return [a.name for a in node.names if a.name.split(".")[0] == ROOT]
  assert isinstance(node, ast.ImportFrom)
  if node.level:
    base = importer.split(".") if is_package else importer.split(".")[:-1]
    base = base[:len(base) - (node.level - 1)]
    module = ".".join(base + ([node.module] if node.module else []))
  else:
    module = node.module or ""
  if module.split(".")[0] != ROOT:
    return []
  targets = []
  for alias in node.names:
    sub = f"{module}.{alias.name}"
    targets.append(sub if sub in MODULES or sub == EXTENSION else module)
  return targets


def _imports(name: str, path: pathlib.Path) -> tuple[set[str], set[str]]:
  """(module-level, function-level) jaxquant imports of one module."""
  tree = ast.parse(path.read_text())
  top_nodes = set()
  for stmt in tree.body:  # module level, including under if / try
    for node in ast.walk(stmt):
      if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
        break
      if isinstance(node, (ast.Import, ast.ImportFrom)):
        top_nodes.add(node)
    if isinstance(stmt, (ast.Import, ast.ImportFrom)):
      top_nodes.add(stmt)
  top, inner = set(), set()
  for node in ast.walk(tree):
    if isinstance(node, (ast.Import, ast.ImportFrom)):
      (top if node in top_nodes else inner).update(_resolve(name, _is_package(path), node))
  return top, inner


def _edges(name: str, targets: set[str]) -> set[str]:
  edges = set()
  for target in targets:
    edges.add(target)
    parts = target.split(".")
    for i in range(2, len(parts)):  # the packages above `target`, below the root
      parent = ".".join(parts[:i])
      if not (name == parent or name.startswith(parent + ".")):
        edges.add(parent)
  edges.discard(name)
  edges.discard(ROOT)
  return edges


def _graph() -> dict[str, set[str]]:
  return {name: _edges(name, _imports(name, path)[0]) for name, path in MODULES.items()
          if name != ROOT}


def _find_cycle(graph: dict[str, set[str]]):
  state: dict[str, int] = {}
  stack: list[str] = []

  def visit(node: str):
    state[node] = 1
    stack.append(node)
    for nxt in sorted(graph.get(node, ())):
      if state.get(nxt) == 1:
        return stack[stack.index(nxt):] + [nxt]
      if nxt not in state:
        found = visit(nxt)
        if found:
          return found
    stack.pop()
    state[node] = 2
    return None

  for node in sorted(graph):
    if node not in state:
      found = visit(node)
      if found:
        return found
  return None


def test_the_module_import_graph_has_no_cycle():
  cycle = _find_cycle(_graph())
  assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_finder_reports_a_cycle_through_a_package_init():
  graph = {"jaxquant.a.x": _edges("jaxquant.a.x", {"jaxquant.b"}),
           "jaxquant.b": _edges("jaxquant.b", {"jaxquant.a.y"}),
           "jaxquant.a": _edges("jaxquant.a", {"jaxquant.a.x"})}
  cycle = _find_cycle(graph)
  assert cycle is not None and set(cycle) == {"jaxquant.a.x", "jaxquant.b", "jaxquant.a"}


@pytest.mark.parametrize("name", sorted(n for n in MODULES if n != ROOT))
def test_no_module_imports_the_top_level_facade(name):
  top, _ = _imports(name, MODULES[name])
  assert ROOT not in top, f"{name} imports `jaxquant` itself; import the module it needs"


def test_no_function_level_import_of_jaxquant_modules_except_optional_dependencies():
  offenders = {}
  for name, path in MODULES.items():
    _, inner = _imports(name, path)
    extra = inner - OPTIONAL_LAZY.get(name, set())
    if extra:
      offenders[name] = sorted(extra)
  assert not offenders, f"imports inside functions: {offenders}"
