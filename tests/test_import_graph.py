"""No import cycles among rlvr's modules, counting imports made inside functions.

The graph is read from the source with ``ast``, never by importing: one node per file (a package's
``__init__`` is a node of its own), an edge for every ``import`` or ``from ... import`` of an rlvr
module wherever it sits (module level, in a function, under ``TYPE_CHECKING``). ``from pkg import name``
points at ``pkg.name`` when that is a module, else at ``pkg``. Importing ``a.b.c`` also runs the
``__init__`` of ``a.b``, so that is an edge too, unless the importing module sits in ``a.b`` itself
(a package being imported is already in ``sys.modules`` when its submodules run).
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
ROOT = "rlvr"


def module_files(src: Path = SRC, root: str = ROOT) -> dict[str, Path]:
    files = {}
    for path in sorted((src / root).rglob("*.py")):
        parts = list(path.relative_to(src).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        files[".".join(parts)] = path
    return files


def _is_package(name: str, files: dict[str, Path]) -> bool:
    return files[name].name == "__init__.py"


def imports_of(name: str, files: dict[str, Path]) -> set[str]:
    """The rlvr modules that module ``name`` imports anywhere in its body."""
    tree = ast.parse(files[name].read_text(), filename=str(files[name]))
    package = name if _is_package(name, files) else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            for alias in node.names:
                # A submodule named in the list is the dependency; any other name lives in `base` itself.
                submodule = f"{base}.{alias.name}"
                found.add(submodule if submodule in files else base)
    own_packages = {package.rsplit(".", i)[0] for i in range(package.count(".") + 1)}
    targets = set()
    for target in found:
        # `import a.b.c` reaches the deepest module the dotted name names; outside rlvr nothing is left.
        while target and target not in files:
            target = target.rpartition(".")[0]
        if target and target != name:
            targets.add(target)
        # Importing a.b.c runs a/__init__ and a/b/__init__ first: those are dependencies too, except the
        # packages this module sits in (already being imported when it runs).
        target = target.rpartition(".")[0]
        while target and target not in own_packages:
            targets.add(target)
            target = target.rpartition(".")[0]
    return targets


def import_graph(files: dict[str, Path]) -> dict[str, set[str]]:
    return {name: imports_of(name, files) for name in files}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
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


def _describe(component: list[str], graph: dict[str, set[str]]) -> str:
    members = set(component)
    edges = [f"    {a} -> {b}" for a in component for b in sorted(graph[a] & members)]
    return f"  {len(component)} modules:\n" + "\n".join(edges)


def test_the_graph_sees_every_kind_of_import(tmp_path: Path) -> None:
    pkg = tmp_path / "toy"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from .a import f\n")
    (pkg / "a.py").write_text("def f():\n    from toy.sub import b\n    return b\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "b.py").write_text("from ..c import g\nfrom toy.sub import h\n")
    (pkg / "c.py").write_text("import toy.sub.b as bb\nfrom toy import a\n")
    files = module_files(tmp_path, "toy")
    graph = import_graph(files)
    assert graph == {
        "toy": {"toy.a"},
        "toy.a": {"toy.sub.b", "toy.sub"},
        "toy.sub": set(),
        "toy.sub.b": {"toy.c", "toy.sub"},
        "toy.c": {"toy.sub.b", "toy.sub", "toy.a"},
    }
    assert cycles(graph) == [["toy.a", "toy.c", "toy.sub.b"]]


def test_no_import_cycles() -> None:
    graph = import_graph(module_files())
    found = cycles(graph)
    assert not found, "import cycles among rlvr modules:\n" + "\n".join(_describe(c, graph) for c in found)
