"""The package's layers (``nemo_rlhf.LAYERS``): imports point down only, no cycles, at the top.

The check reads the source (``ast``), every import of a ``nemo_rlhf`` module included
(inside functions too), so it cannot be fooled by an import hidden in a function; it is
shown to fail on a planted upward import, a planted cycle and a planted function-level
import, each named by file and line.
"""

from __future__ import annotations

import ast
import shutil
from pathlib import Path

import pytest

import nemo_rlhf

PACKAGE = Path(nemo_rlhf.__file__).parent


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


LAZY = "# lazy:"
"""A function-level import whose first line says ``# lazy: <reason>`` is allowed (e.g. a
command-line tool that imports megatron only for the commands that build a model); it is
still checked for direction and cycles."""


def _imports(path: Path, root: Path, modules: set[str]):
    """``(line, imported module, at top level or marked lazy)`` for every ``nemo_rlhf``
    import of a file; ``from a import b`` counts as importing ``a.b`` when that is a module."""
    text = path.read_text()
    lines = text.splitlines()
    tree = ast.parse(text, str(path))
    top = {id(n) for n in tree.body}
    me = _module_name(path, root)
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                pkg = me.split(".") if path.name == "__init__.py" else me.split(".")[:-1]
                base = ".".join(pkg[:len(pkg) - node.level + 1] + ([base] if base else []))
            if base.split(".")[0] != root.name:
                continue
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                       for a in node.names]
        elif isinstance(node, ast.Import):
            targets = [a.name for a in node.names if a.name.split(".")[0] == root.name]
        if not targets:
            continue
        first = lines[node.lineno - 1]
        lazy = LAZY in first and bool(first.split(LAZY, 1)[1].strip())
        for t in targets:
            yield node.lineno, t, id(node) in top or lazy


def check_layers(root: Path, layers) -> list[str]:
    """Problems of the package at ``root`` against ``layers`` (empty: none).

    Each is ``file:line: what`` -- an upward import, an import between two packages of one
    layer, an import of a name no layer lists, an import of ``launchers`` / ``benchmarks``
    / ``tests``, a ``nemo_rlhf`` import inside a function, or a cycle of modules.
    """
    rank = {name: i for i, (_, names) in enumerate(layers) for name in names}
    files = sorted(root.rglob("*.py"))
    modules = {_module_name(p, root) for p in files}
    problems, graph = [], {}

    def unit(module: str) -> str:
        parts = module.split(".")
        return parts[1] if len(parts) > 1 else ""

    for path in files:
        me = _module_name(path, root)
        rel = path.relative_to(root.parent)
        graph.setdefault(me, set())
        for line, target, at_top in _imports(path, root, modules):
            where = f"{rel}:{line}"
            if target.split(".")[0] in ("launchers", "benchmarks", "tests"):
                problems.append(f"{where}: imports {target} (outside the package)")
                continue
            graph[me].add(target)
            if not at_top:
                problems.append(f"{where}: imports {target} inside a function (imports of "
                                f"nemo_rlhf modules go at the top of the file, or say "
                                f"'{LAZY} <reason>')")
            a, b = unit(me), unit(target)
            if not b or a == b or not a:
                continue
            if a not in rank or b not in rank:
                problems.append(f"{where}: {me} -> {target}: "
                                f"{a if a not in rank else b!r} is in no layer of nemo_rlhf.LAYERS")
            elif rank[b] < rank[a]:
                problems.append(f"{where}: {me} -> {target} imports upwards "
                                f"({layers[rank[a]][0]} -> {layers[rank[b]][0]})")
            elif rank[b] == rank[a]:
                problems.append(f"{where}: {me} -> {target}: packages of one layer "
                                f"({layers[rank[a]][0]}) do not import each other")
    problems += [f"import cycle: {' -> '.join(c)}" for c in _cycles(graph)]
    return problems


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in graph:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp) + [sorted(comp)[0]])

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_package_keeps_its_layers():
    assert check_layers(PACKAGE, nemo_rlhf.LAYERS) == []


def test_every_top_level_module_and_package_is_in_a_layer():
    listed = {n for _, names in nemo_rlhf.LAYERS for n in names}
    present = {p.stem if p.is_file() else p.name for p in PACKAGE.iterdir()
               if (p.is_dir() and (p / "__init__.py").exists())
               or (p.suffix == ".py" and p.name != "__init__.py")}
    assert present == listed


@pytest.fixture
def copy(tmp_path):
    dst = tmp_path / "nemo_rlhf"
    shutil.copytree(PACKAGE, dst, ignore=shutil.ignore_patterns("__pycache__"))
    return dst


def _plant(path: Path, line: str, inside_function: bool = False) -> int:
    text = path.read_text()
    if inside_function:
        text += f"\n\ndef _planted():\n    {line}\n"
        n = text.count("\n")
    else:
        head, sep, rest = text.partition("\nfrom __future__ import annotations\n")
        text = head + sep + line + "\n" + rest
        n = head.count("\n") + 3
    path.write_text(text)
    return n


def test_a_planted_upward_import_fails_naming_the_file_and_line(copy):
    line = _plant(copy / "models" / "engine.py", "from nemo_rlhf.trainers.mixed_precision import lr_lambda")
    problems = check_layers(copy, nemo_rlhf.LAYERS)
    assert any(p.startswith(f"nemo_rlhf/models/engine.py:{line}: ") and "imports upwards" in p
               and "models -> trainers" in p for p in problems), problems


def test_a_planted_cycle_and_a_function_level_import_fail(copy):
    # two modules of one package importing each other: no layer rule breaks, the cycle does
    _plant(copy / "algorithms" / "ppo" / "gae.py", "from nemo_rlhf.algorithms.ppo import advantages")
    line = _plant(copy / "rollout" / "sampling.py", "from nemo_rlhf.models import engine",
                  inside_function=True)
    _plant(copy / "rollout" / "config.py", "from nemo_rlhf.models import engine  # lazy: a reason",
           inside_function=True)
    problems = check_layers(copy, nemo_rlhf.LAYERS)
    assert not any("rollout/config.py" in p for p in problems), problems  # marked lazy: allowed
    assert any(p.startswith("import cycle:") and "nemo_rlhf.algorithms.ppo.gae" in p
               and "nemo_rlhf.algorithms.ppo.advantages" in p for p in problems), problems
    assert any(p.startswith(f"nemo_rlhf/rollout/sampling.py:{line}: ") and "inside a function" in p
               for p in problems), problems


LAUNCHERS = PACKAGE.parent / "launchers"


def launcher_cycles(root: Path) -> list[list[str]]:
    """Import cycles among the modules of ``launchers/`` (imports inside functions included)."""
    files = sorted(root.rglob("*.py"))
    modules = {_module_name(p, root) for p in files}
    graph = {_module_name(p, root): {t for _, t, _ in _imports(p, root, modules)} for p in files}
    return _cycles(graph)


def test_the_launchers_import_each_other_in_no_cycle():
    """Issue 50: recipe imported demo at the top and demo imported recipe inside functions;
    what both use lives in launchers/stages.py."""
    assert launcher_cycles(LAUNCHERS) == []


def test_a_planted_launcher_cycle_is_found(tmp_path):
    dst = tmp_path / "launchers"
    shutil.copytree(LAUNCHERS, dst, ignore=shutil.ignore_patterns("__pycache__"))
    _plant(dst / "stages.py", "from launchers import demo", inside_function=True)
    assert any("launchers.stages" in c and "launchers.demo" in c for c in launcher_cycles(dst))
