"""docs/design.md, "Import direction" and "Where things live", held against the code: every import under
grpo_mega/ (module level and inside functions, read with ast, nothing imported) follows the stated direction; the
scripts under bench/ and experiments/ touch no sys.path and import nothing from tests/; every path the layout
table names exists; a module over 450 lines says why it is one file."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "grpo_mega"



def _module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, top_level_only: bool = False) -> set[str]:
    """Dotted names imported by `path` (absolute imports; `from a.b import c` gives a.b and a.b.c)."""
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else ast.walk(tree)
    out = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}: relative import (the project imports absolutely)"
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
    return out


FILES = {str(p.relative_to(REPO)): p for p in sorted(PACKAGE.rglob("*.py"))}
MODULES = {_module_name(p): rel for rel, p in FILES.items()}


def _project(names: set[str]) -> set[str]:
    """The project modules among `names`, each resolved to the longest module that exists."""
    out = set()
    for name in names:
        while name and name not in MODULES:
            name = name.rpartition(".")[0]
        if name:
            out.add(name)
    return out


def _part(module: str) -> str:
    """grpo_mega.algo.kl -> 'algo', grpo_mega.train -> 'train.py', grpo_mega -> '__init__.py'."""
    parts = module.split(".")
    if len(parts) == 1:
        return "__init__.py"
    return parts[1] if f"grpo_mega/{parts[1]}/__init__.py" in FILES else parts[1] + ".py"


USES = {rel: _imports(p) for rel, p in FILES.items()}
PARTS = {rel: {_part(m) for m in _project(names)} for rel, names in USES.items()}

# what each part may import of the project (besides itself), from docs/design.md, "Import direction"
GROUND = {"parallel", "registry.py", "processes.py", "workers.py"}
ALLOWED = {
    "algo": {"registry.py"},
    "parallel": GROUND, "registry.py": GROUND, "processes.py": GROUND, "workers.py": GROUND,
    "models": {"conf", "parallel", "registry.py"},
    "planning.py": {"conf", "models", "parallel"},
    "engines": {"models", "conf", "parallel", "registry.py", "processes.py"},
    "rollout": {"engines", "parallel", "toolcalls", "registry.py"},
}
NEVER = {  # part -> parts it must not import
    "conf": {"trainer", "train.py", "cli"},
    "data": {"trainer", "engines", "rollout", "train.py", "cli"},
    "rewards": {"trainer", "engines", "rollout", "train.py", "cli"},
    "toolcalls": {"trainer", "engines", "rollout", "train.py", "cli"},
    "trainer": {"train.py", "cli"},
}


def test_imports_follow_the_stated_direction():
    errors = []
    for rel in sorted(FILES):
        part = _part(_module_name(FILES[rel]))
        got = PARTS[rel] - {part, "__init__.py"}
        if part in ALLOWED and not got <= ALLOWED[part]:
            errors.append(f"{rel} imports {sorted(got - ALLOWED[part])}: {part} may import only "
                          f"{sorted(ALLOWED[part])}")
        if got & NEVER.get(part, set()):
            errors.append(f"{rel} imports {sorted(got & NEVER[part])}, which {part} must not")
        if part != "cli" and "cli" in got:
            errors.append(f"{rel} imports grpo_mega.cli: no library module may (it is on top)")
        outside = {n.split(".")[0] for n in USES[rel]} & {"bench", "experiments", "tests"}
        if outside:
            errors.append(f"{rel} imports {sorted(outside)}: nothing under grpo_mega/ reaches the scripts or tests")
    assert not errors, "docs/design.md, 'Import direction':\n" + "\n".join(errors)


def test_algo_and_conf_import_no_distributed_or_megatron():
    for rel, names in USES.items():
        part = _part(_module_name(FILES[rel]))
        if part in ("algo", "conf"):
            bad = sorted(n for n in names if n.startswith(("torch.distributed", "megatron")))
            assert not bad, f"{rel} imports {bad} (docs/design.md: {part}/ is free of both)"


def test_nothing_imports_the_entry_point():
    importers = {rel for rel, names in USES.items() if "grpo_mega.train" in _project(names) and
                 rel != "grpo_mega/train.py"}
    assert not importers, f"{sorted(importers)} import grpo_mega.train (Hydra's schema: conf.schema.register_schema)"


def test_no_import_cycle_at_module_level():
    graph = {m: _project(_imports(REPO / rel, top_level_only=True)) - {m} for m, rel in MODULES.items()}
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(m, path):
        state[m] = 1
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                raise AssertionError("import cycle at module level: " + " -> ".join(path[path.index(n):] + [n]))
            if n not in state:
                visit(n, path + [n])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])


@pytest.mark.parametrize("folder", ["grpo_mega", "bench", "experiments"])
def test_no_script_or_module_patches_sys_path_or_imports_tests(folder):
    for path in sorted((REPO / folder).rglob("*.py")):
        text = path.read_text()
        assert "sys.path" not in text, f"{path.relative_to(REPO)} touches sys.path"
        tests = sorted(n for n in _imports(path) if n.split(".")[0] == "tests")
        assert not tests, f"{path.relative_to(REPO)} imports {tests}: move what it needs next to its owner"


def test_the_layout_table_names_paths_that_exist():
    text = (REPO / "docs" / "design.md").read_text()
    section = text.split("## Where things live", 1)[1].split("\n## ", 1)[0]
    paths = [p for row in re.findall(r"^\| ([^|]+) \|", section, re.M) for p in re.findall(r"`([^`]+)`", row)]
    assert len(paths) >= 15
    missing = [p for p in paths if not (REPO / p).exists()]
    assert not missing, f"docs/design.md's 'Where things live' names paths that do not exist: {missing}"


LONG = 450
"""Lines above which a module under grpo_mega/ says why it is one file (issue 36): its docstring has a paragraph
that begins "Long on purpose:"."""


def test_a_long_module_says_why_it_is_one_file():
    unexplained = []
    for rel, path in FILES.items():
        text = path.read_text()
        if text.count("\n") > LONG and "Long on purpose:" not in (ast.get_docstring(ast.parse(text)) or ""):
            unexplained.append(f"{rel} ({text.count(chr(10))} lines)")
    assert not unexplained, f"over {LONG} lines without a 'Long on purpose:' paragraph in the docstring: {unexplained}"
