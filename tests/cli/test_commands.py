"""The user commands: every console script in pyproject.toml names a grpo_mega.cli module whose `main` answers
--help, every `grpo-mega-*` command the docs, the Makefile and the launch scripts name is one of them, and no
reference to the old scripts folder is left there."""

import importlib
import re
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
USER_FACING = ["README.md", "Makefile", "docs/slurm.md", "docs/benchmarks.md", "docs/design.md",
               *(str(p.relative_to(REPO)) for p in sorted((REPO / "launch_scripts").glob("*.sh"))), "slurm/train.sbatch"]


def test_the_five_commands_are_installed():
    assert sorted(SCRIPTS) == ["grpo-mega-convert-to-hf", "grpo-mega-convert-to-mcore", "grpo-mega-plan",
                               "grpo-mega-prepare-model", "grpo-mega-torchrun"]


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_each_command_answers_help(name, monkeypatch, capsys):
    module, func = SCRIPTS[name].split(":")
    assert module.startswith("grpo_mega.cli.")
    main = getattr(importlib.import_module(module), func)
    monkeypatch.setattr(sys, "argv", [name, "--help"])
    with pytest.raises(SystemExit) as exit_:
        sys.exit(main())  # as the console script's wrapper calls it (a main may return its status)
    assert exit_.value.code in (0, None)
    assert "usage:" in capsys.readouterr().out


@pytest.mark.parametrize("path", USER_FACING)
def test_docs_name_only_installed_commands(path):
    text = (REPO / path).read_text()
    named = set(re.findall(r"\bgrpo-mega-[a-z-]*[a-z]", text))
    assert named <= set(SCRIPTS), f"{path} names {sorted(named - set(SCRIPTS))}, not in pyproject.toml"
    assert not re.search(r"(?<![\w/.])tools/[a-z_]+\.(py|sh)", text), f"{path} still names a script under tools/"
