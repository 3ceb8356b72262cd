"""The house's shape, checked from the source: jspec's imports form no circle, modules stay
small, every model family builds on the family-neutral decoder, no package imports from a
floor above its own, and every option of `jspec.LLM` has its default in one place.

The import graph is read with `ast` (no jspec code runs): every `import` and `from ... import`
anywhere in a file, function bodies and `if TYPE_CHECKING:` blocks included. Rule for edges:
a module is a node; `jspec/pkg/__init__.py` is the node `jspec.pkg`. `import jspec.a.b` and
`from jspec.a.b import name` make the importer depend on `jspec.a.b` only, not on its parent
packages (whose `__init__` Python runs first, but which a refactor cannot avoid); `from
jspec.a import b`, where `jspec/a/b.py` exists, depends on the module `jspec.a.b`, otherwise on
`jspec.a`. Relative imports are resolved against the importer's package. A module importing
itself (a package `__init__` naming its own submodules) is a parent-child edge, not a circle.
"""

from __future__ import annotations

import ast
import os

import pytest

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "jspec")
MAX_MODULE_LINES = 350
FAMILY_MODULES = ("llama", "glm4_moe", "qwen3", "qwen3_5", "deepseek_v3")


def module_files() -> dict[str, str]:
  """{dotted module name: path} for every .py file under jspec/."""
  modules = {}
  for folder, _, files in os.walk(ROOT):
    for name in files:
      if not name.endswith(".py"):
        continue
      path = os.path.join(folder, name)
      rel = os.path.relpath(path, os.path.dirname(ROOT))[:-3].split(os.sep)
      if rel[-1] == "__init__":
        rel = rel[:-1]
      modules[".".join(rel)] = path
  return modules


def imported_modules(module: str, path: str, modules: dict[str, str]) -> set[str]:
  """The jspec modules that `module` (at `path`) imports, by the rule in this file's docstring."""
  with open(path) as f:
    tree = ast.parse(f.read(), path)
  is_package = path.endswith("__init__.py")
  package = module if is_package else module.rpartition(".")[0]
  found = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      found.update(alias.name for alias in node.names)
    elif isinstance(node, ast.ImportFrom):
      if node.level:
        base = package.split(".")
        base = base[:len(base) - (node.level - 1)]
        source = ".".join(base + ([node.module] if node.module else []))
      else:
        source = node.module
      for alias in node.names:
        candidate = f"{source}.{alias.name}"
        found.add(candidate if candidate in modules else source)
  # Keep jspec modules only; an import of a name below a module (jspec.a.b.c where c is a
  # class) falls back to the longest known prefix.
  deps = set()
  for name in found:
    while name and name not in modules:
      name = name.rpartition(".")[0]
    if name and name != module:
      deps.add(name)
  return deps


def import_graph() -> dict[str, set[str]]:
  modules = module_files()
  return {m: imported_modules(m, p, modules) for m, p in modules.items()}


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
  """Strongly connected components of more than one module (Tarjan), each as one cycle
  through its members, found by a walk inside the component."""
  index, low, on_stack, stack, components = {}, {}, set(), [], []
  counter = [0]

  def visit(v):  # recursion depth is bounded by the number of modules (~100)
    index[v] = low[v] = counter[0]
    counter[0] += 1
    stack.append(v)
    on_stack.add(v)
    for w in sorted(graph[v]):
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on_stack:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      component = []
      while True:
        w = stack.pop()
        on_stack.discard(w)
        component.append(w)
        if w == v:
          break
      if len(component) > 1:
        components.append(sorted(component))

  for v in sorted(graph):
    if v not in index:
      visit(v)
  return [cycle_within(graph, set(c)) for c in components]


def cycle_within(graph, component: set[str]) -> list[str]:
  """One cycle through the component's first module: a breadth-first path back to it."""
  start = min(component)
  parents, frontier = {start: None}, [start]
  while frontier:
    nxt = []
    for v in frontier:
      for w in sorted(graph[v] & component):
        if w == start:
          path = [v]  # v back to start through the parents, then reversed and closed
          while parents[path[-1]] is not None:
            path.append(parents[path[-1]])
          return path[::-1] + [start]
        if w not in parents:
          parents[w] = v
          nxt.append(w)
    frontier = nxt
  return sorted(component)


def test_cycle_search_finds_a_known_circle():
  graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
  assert import_cycles(graph) == [["a", "b", "c", "a"]]
  assert import_cycles({"a": {"b"}, "b": set()}) == []


def test_jspec_imports_form_no_circle():
  cycles = import_cycles(import_graph())
  assert not cycles, "import circles in jspec/:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_every_module_is_at_most_350_lines():
  long = {}
  for module, path in module_files().items():
    with open(path) as f:
      lines = sum(1 for _ in f)
    if lines > MAX_MODULE_LINES:
      long[module] = lines
  assert not long, f"modules over {MAX_MODULE_LINES} lines: {long}"


@pytest.mark.parametrize("family", FAMILY_MODULES)
def test_family_builds_on_the_neutral_decoder(family):
  """A family takes its CausalLM / DecoderLayer / common_fields from jspec.models.decoder and
  imports no other family (read by ast, as the import graph)."""
  module = f"jspec.models.{family}"
  path = module_files()[module]
  with open(path) as f:
    tree = ast.parse(f.read(), path)
  from_decoder = {alias.name for node in ast.walk(tree)
                  if isinstance(node, ast.ImportFrom) and node.module == "jspec.models.decoder"
                  for alias in node.names}
  assert {"CausalLM", "common_fields"} <= from_decoder, (
      f"{module} takes its base from elsewhere: from jspec.models.decoder it imports "
      f"{sorted(from_decoder)}")
  others = {f"jspec.models.{f}" for f in FAMILY_MODULES} - {module}
  imported = import_graph()[module]
  assert not imported & others, f"{module} imports another family: {imported & others}"


def test_the_kernels_import_nothing_from_the_models():
  """jspec.pallas_kernels is a floor under jspec.models: the models pick kernels, the kernels
  know nothing of the models."""
  upward = {module: sorted(d for d in deps if d.startswith("jspec.models"))
            for module, deps in import_graph().items()
            if module.startswith("jspec.pallas_kernels")}
  upward = {m: d for m, d in upward.items() if d}
  assert not upward, f"kernels importing from jspec.models: {upward}"


def test_kernels_share_only_public_names():
  """What one kernel module takes from a sibling is public (the shared pieces live in
  jspec.pallas_kernels.shared): no `from jspec.pallas_kernels.x import _private`."""
  private = []
  for module, path in module_files().items():
    if not module.startswith("jspec.pallas_kernels"):
      continue
    with open(path) as f:
      tree = ast.parse(f.read(), path)
    for node in ast.walk(tree):
      if (isinstance(node, ast.ImportFrom) and (node.module or "").startswith("jspec.")
          and any(alias.name.startswith("_") for alias in node.names)):
        private.append((module, node.module, [a.name for a in node.names]))
  assert not private, f"private names imported across modules: {private}"


# jspec's packages from the bottom floor up: a module imports nothing from a floor above its
# own (function-level imports included). The top-level modules (build, api, memory_plan, ...)
# stand above them all; jspec.config and the other leaf records are read from every floor.
FLOORS = ("pallas_kernels", "shapes", "sharding", "models", "speculative", "loop", "schedulers")


def _floor(module: str) -> int | None:
  parts = module.split(".")
  return FLOORS.index(parts[1]) if len(parts) > 1 and parts[1] in FLOORS else None


def test_no_package_imports_from_a_floor_above_it():
  upward = []
  for module, deps in import_graph().items():
    own = _floor(module)
    if own is None:
      continue
    upward += [(module, dep) for dep in sorted(deps)
               if _floor(dep) is not None and _floor(dep) > own]
  assert not upward, "imports from a higher floor (FLOORS, bottom first): " + "\n".join(
      f"{m} -> {d}" for m, d in upward)


def test_the_floor_check_sees_an_upward_import():
  assert _floor("jspec.sharding.plan") < _floor("jspec.models.caches")
  assert _floor("jspec.loop.step") > _floor("jspec.speculative.verify")
  assert _floor("jspec.build") is None and _floor("jspec.pallas_kernels") == 0


# Every LLM option's default is declared once, in jspec.options.EngineOptions. The training
# package (jspec.train) is another API whose functions take training's own seeds and dtypes.
OWN_DEFAULTS = ("jspec.options", "jspec.train")


def option_names() -> set[str]:
  """EngineOptions' field names, read from the source."""
  tree = ast.parse(open(os.path.join(ROOT, "options.py")).read())
  cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "EngineOptions")
  return {n.target.id for n in cls.body if isinstance(n, ast.AnnAssign)}


def redeclared_options(source: str, names: set[str]) -> list[str]:
  """'function(name=default)' for each parameter named as an option and given a default."""
  found = []
  for node in ast.walk(ast.parse(source)):
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
      continue
    args = node.args
    positional = args.posonlyargs + args.args
    with_default = positional[len(positional) - len(args.defaults):]
    pairs = list(zip(with_default, args.defaults)) + [
        (a, d) for a, d in zip(args.kwonlyargs, args.kw_defaults) if d is not None]
    found += [f"{node.name}({a.arg}={ast.unparse(d)})" for a, d in pairs if a.arg in names]
  return found


def test_every_option_has_its_default_in_one_place():
  names = option_names()
  assert {"mesh", "dtype", "seed", "max_num_seqs", "speculative_config"} <= names
  found = [f"{module}: {where}" for module, path in sorted(module_files().items())
           if not module.startswith(OWN_DEFAULTS)
           for where in redeclared_options(open(path).read(), names)]
  assert not found, ("option defaults declared outside jspec.options.EngineOptions:\n"
                     + "\n".join(found))


def test_the_option_check_sees_a_second_default():
  source = "def f(a, dtype='bfloat16', *, seed=0, mesh=None, other=1):\n  pass\n"
  assert redeclared_options(source, {"dtype", "seed", "mesh"}) == [
      "f(dtype='bfloat16')", "f(seed=0)", "f(mesh=None)"]
