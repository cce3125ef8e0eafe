"""The room import rules of ../shared/DESIGN.md ("Layout: one package, six rooms"), read from the source.

Every module under omnigraph/ is parsed with `ast` (nothing is imported) and mapped to its room:

    bundles      the ground: the manifest and its verification (stdlib + onnx)
    workers      the graph worker (stdlib + numpy + onnxruntime + onnx + bundles)
    pipelines    the declarations: the modules directly in omnigraph/pipelines/
    stages       the engine
    model        a model folder omnigraph/pipelines/<model>/ (laya, cua_s1, open_jev), or shared
                 model code (SHARED_MODEL_CODE: pipelines/system_one/)
    conformance  fixtures and the runner
    plugin       every face the outside touches

Lower rooms never import higher ones, in this order: bundles < workers < pipelines < stages <
model folders < conformance < plugin (conformance uses the rooms below plugin; the plugin's CLI
runs conformance). Besides:

- a model folder never imports another model's folder, and shared model code imports no model
  folder (model code is named by dotted strings in its PipelineConfig, so the engine, below the
  model folders, never imports a model either);
- conformance uses the public surfaces of the other rooms: no underscore name or module;
- bundles imports only the standard library and onnx (and numpy, which onnx itself requires);
  workers only the standard library, numpy, onnxruntime, onnx and omnigraph.bundles, because the
  worker runs in an interpreter that has nothing else (an import in a `try:` that catches
  ImportError is optional: the module runs without it, as the mailbox does without posix_ipc);
- the package itself (omnigraph/__init__.py), which every import of a room runs, imports only the
  standard library at module level (its `Omni` / `AsyncOmni` door imports the plugin on first use),
  and any room may read it (`__version__`).

Which imports count: for the room rules, every `import` / `from ... import` anywhere in a module,
at module level, inside functions and inside `if TYPE_CHECKING:` blocks. A lazy or type-only import
still makes a lower room depend on a higher one (the engine naming a model's type is the coupling
the rules forbid; the fix is a protocol in the lower room), and a lazy import runs the moment its
function does. Dotted strings handed to importlib (a PipelineConfig's processor) are the designed
way up and are not imports.

For the cycle test, module-level imports count (including `if TYPE_CHECKING:` blocks, class bodies,
`try` / `if` at module level; not function bodies): a cycle of them is two modules whose definitions
need each other, even when only the type checker runs one direction. `import a.b.c` and
`from a.b import c` (c a module) are an edge to a.b.c only, not to the packages a and a.b that
Python also runs first: counting those would make every package whose __init__ re-exports its
modules (omnigraph.bundles) a cycle with each of them.

Known violations that another change of issue 20 removes are listed, each with the issue, in
KNOWN_VIOLATIONS / KNOWN_CYCLES; the tests fail on any other violation and on an entry that no
longer occurs, so the lists can only shrink.
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "omnigraph"

ROOM_ORDER = ("bundles", "workers", "pipelines", "stages", "model", "conformance", "plugin")
RANK = {room: rank for rank, room in enumerate(ROOM_ORDER)}

# Sub-folders of omnigraph/pipelines/ that hold code shared by the model folders, not a model.
SHARED_MODEL_CODE = frozenset({"system_one"})

# Third-party top-level packages a room may import besides the standard library and omnigraph.
THIRD_PARTY_ALLOWED = {
    "bundles": frozenset({"onnx", "numpy"}),  # numpy: onnx cannot be installed without it
    "workers": frozenset({"numpy", "onnxruntime", "onnx"}),
}

# (importing module, imported module) -> which change removes it. Empty: Cua-S1 and Open-Jev took
# the decision-request parser from Laya's folder until issue 20 moved it to pipelines/system_one/.
KNOWN_VIOLATIONS: dict[tuple[str, str], str] = {}

# (module, third-party package) imports outside the worker interpreter's set, with why they may stay.
WORKER_INTERPRETER_EXCEPTIONS: dict[tuple[str, str], str] = {
    ("omnigraph.workers.ops.selftest", "torch"):
        "the GPU self-test of the op library, run by hand (python -m omnigraph.workers.ops.selftest) "
        "and never loaded by the worker process: torch owns the CUDA buffers its graph replays bind",
}

# The modules of an import cycle (a strongly connected component) -> which change removes it. Empty:
# the stages runtime, graph and native stages imported each other until they met in stages/protocols.py.
KNOWN_CYCLES: dict[frozenset[str], str] = {}


@dataclass(frozen=True)
class Import:
    module: str          # the importing module
    path: Path
    line: int
    target: str          # the imported module (for `from m import n`: m.n when that is a module, else m)
    names: tuple[str, ...]  # the names taken (empty for `import m`)
    module_level: bool   # not inside a function body
    optional: bool = False  # inside `try:` with an `except ImportError` (the module runs without it)


def _modules() -> dict[str, Path]:
    modules = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(REPO).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


MODULES = _modules()


def _catches_import_error(node: ast.Try) -> bool:
    for handler in node.handlers:
        caught = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
        if any(isinstance(c, ast.Name) and c.id in ("ImportError", "ModuleNotFoundError") for c in caught):
            return True
    return False


def _imports(module: str, path: Path) -> list[Import]:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    found: list[Import] = []

    def visit(node: ast.AST, module_level: bool, optional: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import):
                for alias in child.names:
                    found.append(Import(module, path, child.lineno, alias.name, (), module_level, optional))
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    base = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
                    base = base[: len(base) - (child.level - 1)]
                    prefix = ".".join(base + ([child.module] if child.module else []))
                else:
                    prefix = child.module or ""
                names = tuple(alias.name for alias in child.names)
                submodules = [f"{prefix}.{name}" for name in names if f"{prefix}.{name}" in MODULES]
                for target in submodules:
                    found.append(Import(module, path, child.lineno, target, (), module_level, optional))
                if len(submodules) < len(names):
                    rest = tuple(n for n in names if f"{prefix}.{n}" not in MODULES)
                    found.append(Import(module, path, child.lineno, prefix, rest, module_level, optional))
            elif isinstance(child, ast.Try) and _catches_import_error(child):
                for statement in child.body:
                    visit(ast.Module(body=[statement], type_ignores=[]), module_level, True)
                for part in (*child.handlers, *child.orelse, *child.finalbody):
                    visit(ast.Module(body=[part], type_ignores=[]), module_level, optional)
            else:
                inner = module_level and not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
                visit(child, inner, optional)

    visit(tree, True, False)
    return found


IMPORTS = [imp for module, path in MODULES.items() for imp in _imports(module, path)]


def _room(module: str) -> tuple[str, str | None]:
    """(room, model folder or None) of an omnigraph module; ("package", None) for omnigraph itself."""
    parts = module.split(".")
    if parts == ["omnigraph"]:
        return "package", None
    top = parts[1]
    if top == "pipelines" and len(parts) >= 3 and (PACKAGE / "pipelines" / parts[2]).is_dir():
        return "model", parts[2]
    if top in RANK and top != "model":
        return top, None
    raise AssertionError(f"{module} is in no room of DESIGN.md's layout (omnigraph/{top})")


def _where(imp: Import) -> str:
    return f"{imp.path.relative_to(REPO)}:{imp.line}: imports {imp.target}"


def _describe(room: str, folder: str | None) -> str:
    if room != "model":
        return room
    return f"shared model code pipelines/{folder}/" if folder in SHARED_MODEL_CODE else f"model folder pipelines/{folder}/"


def _room_violation(imp: Import) -> str | None:
    """Why `imp` breaks a rule between omnigraph's rooms, or None."""
    room, folder = _room(imp.module)
    target_room, target_folder = _room(imp.target)
    if target_room == "package":
        return None  # omnigraph/__init__.py runs for every import anyway; its own rule is below
    if room == "package":
        if imp.module_level:
            return "the package imports an omnigraph room at module level, so every room would load it"
        return None
    if RANK[room] < RANK[target_room]:
        what = "the engine never imports a model" if target_room == "model" and room != "model" else \
            "lower rooms never import higher ones"
        return (f"{_describe(room, folder)} imports {_describe(target_room, target_folder)}: {what} "
                f"({' < '.join(ROOM_ORDER)})")
    if room == target_room == "model" and folder != target_folder:
        if target_folder in SHARED_MODEL_CODE:
            return None
        if folder in SHARED_MODEL_CODE:
            return f"shared model code pipelines/{folder}/ imports model folder pipelines/{target_folder}/"
        return f"model folder pipelines/{folder}/ imports another model's folder pipelines/{target_folder}/"
    if room == "conformance" and target_room != "conformance":
        private = [n for n in (*imp.target.split("."), *imp.names) if n.startswith("_") and not n.startswith("__")]
        if private:
            return f"conformance uses the public surfaces of the other rooms, not {', '.join(private)}"
    return None


def _third_party_violation(imp: Import) -> str | None:
    room, _ = _room(imp.module)
    top = imp.target.split(".")[0]
    if top == "omnigraph" or top in sys.stdlib_module_names or imp.optional:
        return None
    if room == "package":
        return "the package imports only the standard library" if imp.module_level else None
    allowed = THIRD_PARTY_ALLOWED.get(room)
    if allowed is None or top in allowed:
        return None
    return f"{room} imports {top}; it may import only the standard library, {', '.join(sorted(allowed))}"


def _report(found: dict[tuple[str, str], list[str]], known: dict[tuple[str, str], str], kind: str) -> list[str]:
    problems = [line for key, lines in sorted(found.items()) if key not in known for line in lines]
    problems += [f"{kind} entry {key} no longer occurs ({why}): delete it" for key, why in known.items()
                 if key not in found]
    return problems


def test_every_module_is_in_a_room() -> None:
    assert "omnigraph.bundles.manifest" in MODULES and len(MODULES) > 50
    for module in MODULES:
        _room(module)


def test_room_import_rules() -> None:
    found: dict[tuple[str, str], list[str]] = {}
    for imp in IMPORTS:
        if not imp.target.startswith("omnigraph"):
            continue
        why = _room_violation(imp)
        if why:
            found.setdefault((imp.module, imp.target), []).append(f"{_where(imp)}: {why}")
    problems = _report(found, KNOWN_VIOLATIONS, "KNOWN_VIOLATIONS")
    assert not problems, "room import rules of DESIGN.md broken:\n" + "\n".join(problems)


def test_ground_rooms_import_only_what_the_worker_interpreter_has() -> None:
    found: dict[tuple[str, str], list[str]] = {}
    for imp in IMPORTS:
        why = _third_party_violation(imp)
        if why:
            found.setdefault((imp.module, imp.target.split(".")[0]), []).append(f"{_where(imp)}: {why}")
    problems = _report(found, WORKER_INTERPRETER_EXCEPTIONS, "WORKER_INTERPRETER_EXCEPTIONS")
    assert not problems, "\n".join(problems)


def _cycles(edges: dict[str, dict[str, Import]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(sorted(component))
    return components


def _cycle_path(component: list[str], edges: dict[str, dict[str, Import]]) -> list[Import]:
    """One closed path through `component`, from its first module back to it (breadth first)."""
    members = set(component)
    start = component[0]
    previous: dict[str, Import] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for child, imp in sorted(edges[node].items()):
                if child not in members:
                    continue
                if child == start:
                    path = [imp]
                    while path[0].module != start:
                        path.insert(0, previous[path[0].module])
                    return path
                if child not in previous:
                    previous[child] = imp
                    following.append(child)
        frontier = following
    raise AssertionError(f"no cycle through {start}")


def test_no_import_cycle() -> None:
    edges: dict[str, dict[str, Import]] = {module: {} for module in MODULES}
    for imp in IMPORTS:
        target = imp.target
        while target not in MODULES and "." in target:
            target = target.rsplit(".", 1)[0]
        if imp.module_level and target in MODULES and target != imp.module:
            edges[imp.module].setdefault(target, imp)
    found = {}
    for component in _cycles(edges):
        path = _cycle_path(component, edges)
        found[frozenset(component)] = " -> ".join(f"{imp.module} ({_where(imp)})" for imp in path) + f" -> {path[0].module}"
    problems = [f"import cycle: {line}" for key, line in found.items() if key not in KNOWN_CYCLES]
    problems += [f"KNOWN_CYCLES entry {sorted(key)} no longer occurs ({why}): delete it"
                 for key, why in KNOWN_CYCLES.items() if key not in found]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("source, expected", [
    ("from omnigraph.pipelines.laya.processor import X", "the engine never imports a model"),
    ("def f():\n    from omnigraph.plugin import omni", "lower rooms never import higher ones"),
    ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from omnigraph.pipelines.cua_s1 import prompt",
     "the engine never imports a model"),
])
def test_the_rules_see_lazy_and_type_only_imports(source: str, expected: str, tmp_path: Path) -> None:
    path = tmp_path / "probe.py"
    path.write_text(source)
    (imp,) = [i for i in _imports("omnigraph.stages.probe", path) if i.target.startswith("omnigraph")]
    assert expected in (_room_violation(imp) or "")


def test_model_folders_and_shared_code() -> None:
    def check(importer: str, target: str) -> str | None:
        return _room_violation(Import(importer, PACKAGE / "x.py", 1, target, (), True))

    assert "another model's folder" in (check("omnigraph.pipelines.open_jev.x", "omnigraph.pipelines.laya.request") or "")
    assert "shared model code" in (check("omnigraph.pipelines.system_one.x", "omnigraph.pipelines.laya.x") or "")
    assert check("omnigraph.pipelines.open_jev.x", "omnigraph.pipelines.system_one.request") is None
    assert "engine never imports a model" in (check("omnigraph.pipelines.registry", "omnigraph.pipelines.laya.x") or "")
    assert check("omnigraph.pipelines.laya.batching", "omnigraph.stages.batching") is None
    assert "higher" in (check("omnigraph.workers.session", "omnigraph.stages.ledger") or "")
    assert "public surfaces" in (check("omnigraph.conformance.x", "omnigraph.stages._private") or "")


def test_the_worker_interpreter_rule(tmp_path: Path) -> None:
    path = tmp_path / "probe.py"
    path.write_text("import numpy\nimport torch\ntry:\n    import posix_ipc\nexcept ImportError:\n    posix_ipc = None\n"
                    "def f():\n    try:\n        import yaml\n    except (OSError, ModuleNotFoundError):\n        pass\n")
    imports = _imports("omnigraph.workers.probe", path)
    assert [(i.target, _third_party_violation(i) is not None) for i in imports] == [
        ("numpy", False), ("torch", True), ("posix_ipc", False), ("yaml", False)]
    assert _third_party_violation(Import("omnigraph.stages.x", path, 1, "torch", (), True)) is None
