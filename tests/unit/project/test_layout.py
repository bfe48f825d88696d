"""The unit tests are laid out like the package: the tests of ``nemo_rlhf/<pkg>/<mod>.py`` are
in ``tests/unit/<pkg>/``, those of a top-level module ``nemo_rlhf/<mod>.py`` are
``tests/unit/test_<mod>*.py`` (``test_entry_point*.py``: all the entry points), and
``tests/unit/project/`` holds the checks of the repository as a whole (layers, README
commands, configs, launchers). Each test file of a package folder imports that package."""

from __future__ import annotations

import ast
from pathlib import Path

import nemo_rlhf

PACKAGE = Path(nemo_rlhf.__file__).parent
UNIT = Path(__file__).resolve().parents[1]
TOP_LEVEL = sorted(p.stem for p in PACKAGE.glob("*.py") if p.stem != "__init__")


def _imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
    return names


def layout_problems(unit: Path, package: Path) -> list[str]:
    """Files and folders of ``unit`` that break the layout (empty: none)."""
    top_level = sorted(p.stem for p in package.glob("*.py") if p.stem != "__init__")
    problems = []
    for path in sorted(unit.rglob("test_*.py")):
        rel = path.relative_to(unit)
        if rel.parts[0] == "project":
            continue
        if len(rel.parts) == 1:
            stem = path.stem[len("test_"):]
            if not (stem.startswith("entry_point") or any(stem.startswith(m) for m in top_level)):
                problems.append(f"{rel}: a top-level test file names a top-level module "
                                f"(test_<one of {top_level}>*.py) or is test_entry_point*.py")
            continue
        pkg = ".".join(rel.parts[:-1])
        if not (package / Path(*rel.parts[:-1])).is_dir():
            problems.append(f"{rel}: no package nemo_rlhf.{pkg} for its folder")
            continue
        prefix = f"{package.name}.{pkg}"
        if not any(m == prefix or m.startswith(prefix + ".") for m in _imported_modules(path)):
            problems.append(f"{rel}: imports nothing from {prefix}, the package its folder names")
    for folder in sorted(p for p in unit.rglob("*") if p.is_dir() and p.name != "__pycache__"):
        if not (folder / "__init__.py").is_file():
            problems.append(f"{folder.relative_to(unit)}/: no __init__.py (test modules of two "
                            f"folders may share a name)")
    return problems


def test_unit_tests_are_laid_out_like_the_package():
    assert layout_problems(UNIT, PACKAGE) == []


def test_the_layout_check_names_a_misplaced_file(tmp_path):
    unit, package = tmp_path / "unit", tmp_path / "pkg"
    (package / "models").mkdir(parents=True)
    (package / "models" / "__init__.py").touch()
    (package / "evaluate.py").touch()
    for folder in ("models", "nope"):
        (unit / folder).mkdir(parents=True)
        (unit / folder / "__init__.py").touch()
    (unit / "models" / "test_good.py").write_text("from pkg.models.config import X\n")
    (unit / "models" / "test_stray.py").write_text("from pkg.data import Y\n")
    (unit / "nope" / "test_x.py").write_text("")
    (unit / "test_evaluate_table.py").write_text("")
    (unit / "test_misc.py").write_text("")
    (unit / "bare").mkdir()
    problems = layout_problems(unit, package)
    assert [p.split(":")[0] for p in problems] == [
        "models/test_stray.py", "nope/test_x.py", "test_misc.py", "bare/"], problems
