"""The README and the pages it links (``docs/*.md``, ``benchmarks/README.md``) are checked.

Every command in their ```bash blocks: its program exists and its arguments parse; Hydra
overrides compose into the job's typed schema (no run). A new kind of command fails here
until a check for it is added. Commands run for real elsewhere are named in ``COVERED``
(the walkthrough, the multi-node dry-run and test-only).

Every repository path (``nemo_rlhf/...``, ``conf/...``, ``tests/...::test_name``, ...) and
every ``nemo_rlhf.*`` / ``launchers.*`` module they name exists, every relative link
resolves inside the repository (to a heading, when it names one), and the README stays a
front door of at most ``README_MAX_LINES`` lines."""

from __future__ import annotations

import argparse
import importlib
import re
import runpy
import shlex
import sys
from pathlib import Path
from unittest import mock

import pytest

from tests.conf_helpers import JOBS, schema

REPO = Path(__file__).resolve().parents[3]
README_MAX_LINES = 200


def doc_files() -> list[Path]:
    """The README first (its first two commands are the set-up ones), then the pages."""
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), REPO / "benchmarks" / "README.md"]


ENV_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
"""A leading ``NAME=value`` word: an environment assignment for the command after it."""


def _commands(text: str) -> list[list[str]]:
    out = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        joined = re.sub(r"\\\n\s*", " ", block)
        for line in joined.splitlines():
            line = re.sub(r"(^|\s)#.*$", "", line).strip()
            if not line:
                continue
            line = re.sub(r"\s\[[^\]]*\]", "", line)
            line = re.sub(r"<([a-z_]+)>", r"\1", line)
            line = re.sub(r"\s&$", "", line)  # started in the background
            argv = shlex.split(line)
            while argv and ENV_ASSIGNMENT.match(argv[0]):  # `OMP_NUM_THREADS=1 python ...`: the shell's
                argv = argv[1:]
            out.append(argv)
    return out


def readme_commands(files=None) -> list[list[str]]:
    """The bash commands of the README and its pages (``files``; default :func:`doc_files`):
    continuation lines joined, comments dropped, ``<placeholders>`` replaced by a word,
    ``[optional parts]``, a trailing ``&`` and leading ``NAME=value`` environment
    assignments removed."""
    return [c for path in (files or doc_files()) for c in _commands(path.read_text())]


COMMANDS = readme_commands()


def _compose(config_name: str, overrides: list[str]):
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from nemo_rlhf.config import to_typed
    from nemo_rlhf.models.config import CONF_DIR

    schema(config_name)  # registers the schema
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        dcfg = compose(config_name, overrides=list(overrides))
    return to_typed(dcfg, schema(config_name))


def _split_config_name(args: list[str], default: str) -> tuple[str, list[str]]:
    if "--config-name" in args:
        i = args.index("--config-name")
        return args[i + 1], args[:i] + args[i + 2:]
    return default, args


class _Parsed(Exception):
    """Raised by the patched ``parse_args``: the program parsed its arguments; stop it."""


def _parsed_args(run, argv: list[str]) -> argparse.Namespace:
    """The namespace the program ``run()`` parses from ``argv`` (also in ``sys.argv``),
    stopping it right there; an argument argparse refuses fails naming the command."""
    parse = argparse.ArgumentParser.parse_args

    def parse_and_stop(self, args=None, namespace=None):
        raise _Parsed(parse(self, args, namespace))

    with mock.patch.object(argparse.ArgumentParser, "parse_args", parse_and_stop), \
            mock.patch.object(sys, "argv", ["prog", *argv]):
        try:
            run()
        except _Parsed as parsed:
            return parsed.args[0]
        except SystemExit as exc:
            raise AssertionError(f"arguments {argv} refused (exit {exc.code})") from None
    raise AssertionError(f"{run} returned without parsing its arguments {argv}")


def _check_demo(args: list[str]):
    from launchers import demo

    ns = _parsed_args(lambda: demo.main(args), args)
    _compose(demo.ppo_config_name(ns), ns.ppo_overrides)


def _check_make(argv):
    targets = re.findall(r"^([a-z][a-z-]*):", (REPO / "Makefile").read_text(), flags=re.M)
    assert argv[1] in targets, f"make {argv[1]}: no such Makefile target ({targets})"
    for word in argv[2:]:
        if argv[1] == "demo" and word.startswith("ARGS="):  # `make demo` runs launchers.demo $(ARGS)
            _check_demo(shlex.split(word[len("ARGS="):]))


def _check_ckpt_cli(argv):
    from nemo_rlhf.tools.ckpt.cli import build_parser

    build_parser().parse_args(argv[1:])


def _check_python(argv):
    module, args = argv[2], argv[3:]
    if module in ("nemo_rlhf.train_ppo", "nemo_rlhf.train_sft", "nemo_rlhf.train_rm"):
        if args == ["--cfg", "job"]:
            return
        name, overrides = _split_config_name(args, module.split("_")[-1])
        _compose(name, overrides)
    elif module == "nemo_rlhf.evaluate":
        _compose("eval", args)
    elif module == "nemo_rlhf.serve_rm":
        _compose("rm_server", args)
    elif module == "launchers.local":
        from launchers.local import _parser

        ns = _parser().parse_args(args)
        _compose(getattr(ns, "config_name", "ppo"), getattr(ns, "overrides", []))
    elif module == "launchers.demo":
        _check_demo(args)
    elif module in ("nemo_rlhf.tools.plot_metrics", "nemo_rlhf.tools.real_model", "nemo_rlhf.tools.rm_edit_probe"):
        main = importlib.import_module(module).main
        _parsed_args(lambda: main(args), args)
    else:
        raise AssertionError(f"README command with module {module}: add a check to {__file__}")


def _check_script(argv):
    """``python benchmarks/<script>.py ...``: the script exists and its parser takes the arguments."""
    path = REPO / argv[1]
    assert path.is_file() and path.parent.name == "benchmarks", argv
    _parsed_args(lambda: runpy.run_path(str(path), run_name="__main__"), argv[2:])


def _check_bash(argv):
    import subprocess

    assert (REPO / argv[1]).is_file(), argv
    subprocess.run(["bash", "-n", str(REPO / argv[1])], check=True)


COVERED = {
    ("python", "-m", "launchers.slurm"): "tests/e2e/test_walkthrough.py (dry-run, then run tiny), "
    "tests/slurm/test_launcher.py::test_the_readme_multi_node_example_renders (docs/slurm.md), "
    "tests/slurm/test_jobs.py::test_the_readmes_multi_node_commands_pass_sbatch_test_only",
}


def _kind(argv) -> str:
    if tuple(argv[:3]) in COVERED:
        return "covered"
    if argv[0] == "make":
        return "make"
    if argv[0] == "nemo-rlhf-ckpt":
        return "ckpt"
    if argv[0].endswith("python") and argv[1] == "-m":
        return "python"
    if argv[0].endswith("python") and argv[1].endswith(".py"):
        return "script"
    if argv[0] == "bash":
        return "bash"
    return "unknown"


CHECKS = {"make": _check_make, "ckpt": _check_ckpt_cli, "python": _check_python, "bash": _check_bash,
          "script": _check_script, "covered": lambda argv: None}


def test_the_readme_has_its_commands_and_each_kind_is_known():
    kinds = [_kind(c) for c in COMMANDS]
    assert "unknown" not in kinds, [c for c, k in zip(COMMANDS, kinds) if k == "unknown"]
    assert COMMANDS[:2] == [["make", "demo"], ["make", "test"]]  # the two set-up commands come first
    assert len(COMMANDS) >= 20
    for path in doc_files():
        assert path.is_file(), path


@pytest.mark.parametrize("argv", COMMANDS, ids=[" ".join(c)[:60] for c in COMMANDS])
def test_each_readme_command_parses_and_composes(argv):
    CHECKS[_kind(argv)](argv)


def test_a_misspelt_override_in_a_readme_like_command_is_caught():
    with pytest.raises(Exception, match="kl.targte"):
        _check_python([".venv/bin/python", "-m", "nemo_rlhf.train_ppo", "--config-name", "ppo_tiny", "kl.targte=2"])
    assert "ppo_tiny" in JOBS


def test_leading_environment_assignments_are_the_shells_not_the_command():
    text = "```bash\nPYTHONPATH=$PWD OMP_NUM_THREADS=1 python benchmarks/bench_packing.py --batchh 16\n```\n"
    (argv,) = _commands(text)
    assert argv == ["python", "benchmarks/bench_packing.py", "--batchh", "16"]
    with pytest.raises(AssertionError, match="--batchh"):
        CHECKS[_kind(argv)](argv)


def test_a_bad_option_of_a_demo_or_benchmark_command_is_caught():
    with pytest.raises(Exception, match="kl.targte"):
        _check_make(["make", "demo", "ARGS=--task tiny kl.targte=2"])
    with pytest.raises(AssertionError, match="--no-such-flag"):
        _check_python(["python", "-m", "launchers.demo", "--no-such-flag"])
    with pytest.raises(AssertionError, match="--batchh"):
        _check_script(["python", "benchmarks/bench_packing.py", "--batchh", "16"])
    with pytest.raises(AssertionError):
        _check_script(["python", "benchmarks/bench_no_such_thing.py"])


# --------------------------------------------------------------------------- names and links

PATH_ROOTS = ("nemo_rlhf", "conf", "launchers", "docs", "tests", "benchmarks", "slurm", "tools")
PATH_RE = re.compile(r"(?<![\w./<>$-])((?:%s)/[\w./*<>{}:-]*)" % "|".join(PATH_ROOTS))
MODULE_RE = re.compile(r"(?<![\w./-])((?:nemo_rlhf|launchers)(?:\.\w+)+)")
LINK_RE = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
PARENT_RE = re.compile(r"`(\.\./[^`\s]*)`")


def _anchors(text: str) -> set[str]:
    """GitHub's anchors of the markdown headings of ``text`` (code blocks skipped)."""
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    out = set()
    for heading in re.findall(r"^#{1,6}\s+(.*?)\s*$", text, flags=re.M):
        out.add(re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-"))
    return out


def _path_problem(word: str) -> str | None:
    word = word.rstrip(".,:;)")
    path, _, test_name = word.partition("::")
    path = re.split(r"[<{]", path, maxsplit=1)[0]
    if "*" in path:
        return None if list(REPO.glob(path)) else f"{word}: no file matches"
    target = REPO / path
    if not target.exists():
        return f"{word}: no such file or folder"
    if test_name and not re.search(rf"^\s*def {re.escape(test_name)}\b", target.read_text(), flags=re.M):
        return f"{word}: no test {test_name} in {path}"
    return None


def _module_problem(name: str) -> str | None:
    parts = name.split(".")
    for i in range(len(parts), 1, -1):
        base = REPO.joinpath(*parts[:i])
        source = base.with_suffix(".py") if base.with_suffix(".py").is_file() else base / "__init__.py"
        if source.is_file():
            break
    else:
        return f"{name}: no such module"
    if i < len(parts):  # an attribute of the module: defined or exported there
        attr = re.escape(parts[i])
        text = source.read_text()
        if not re.search(rf"^\s*(def|class)\s+{attr}\b|^{attr}\s*[:=]|[\"']{attr}[\"']", text, flags=re.M):
            return f"{name}: {'.'.join(parts[:i])} has no {parts[i]}"
    return None


def _link_problem(page: Path, text: str, target: str) -> str | None:
    if re.match(r"[a-z]+:", target):  # https:, mailto:
        return None
    path, _, anchor = target.partition("#")
    if not path:  # a heading of this page
        return None if anchor in _anchors(text) else f"{target}: no such heading on this page"
    dest = (page.parent / path).resolve()
    if REPO not in (dest, *dest.parents):
        return f"{target}: outside the repository"
    if not dest.exists():
        return f"{target}: no such file"
    if anchor and dest.suffix == ".md" and anchor not in _anchors(dest.read_text()):
        return f"{target}: no heading #{anchor} in {dest.relative_to(REPO)}"
    return None


def page_problems(page: Path, text: str) -> list[str]:
    """Every repository path, module, link and ``../`` mention of ``text`` (the page at
    ``page``) that does not resolve."""
    problems = [p for w in PATH_RE.findall(text) if (p := _path_problem(w))]
    problems += [p for m in MODULE_RE.findall(text) if (p := _module_problem(m))]
    problems += [p for t in LINK_RE.findall(text) if (p := _link_problem(page, text, t))]
    problems += [p for t in PARENT_RE.findall(text) if (p := _link_problem(page, text, t))]
    return problems


@pytest.mark.parametrize("page", doc_files(), ids=lambda p: str(p.relative_to(REPO)))
def test_every_path_module_and_link_a_page_names_exists(page):
    assert page_problems(page, page.read_text()) == []


def test_names_and_links_that_do_not_exist_are_caught():
    page = REPO / "docs" / "x.md"
    text = """# Title
See `nemo_rlhf/trainers/ppo/nope.py`, `conf/*_nothing.yaml`, `tests/unit/project/test_conf.py::test_nope`,
`nemo_rlhf.trainers.nope`, `nemo_rlhf.reward.functions.no_such_fn`, [a](missing.md),
[b](demo.md#no-such-heading), [c](../../outside.md), notes in `../shared/DESIGN.md`.
Fine: `nemo_rlhf/data/<task>.py`, `conf/*_tiny.yaml`, `nemo_rlhf.reward.functions.CombinedReward`,
`tests/unit/project/test_conf.py`, [d](demo.md#the-tiny-demo---task-tiny), [e](#title), [f](https://example.com).
"""
    problems = page_problems(page, text)
    assert len(problems) == 9, problems
    for needle in ("nope.py", "_nothing", "test_nope", "trainers.nope", "no_such_fn", "missing.md",
                   "no-such-heading", "outside.md", "DESIGN.md"):
        assert sum(needle in p for p in problems) == 1, (needle, problems)


def test_the_readme_is_a_front_door():
    lines = (REPO / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; move detail to docs/"
    assert "../shared" not in "\n".join(lines)
