"""docs/config.md, generated from the config dataclasses: every overridable field of TrainConfig with its type,
default and the one-line help its docstring gives (and the model YAML fields, ModelConfig).

    python -m grpo_mega.conf.reference --write    # rewrite docs/config.md
    python -m grpo_mega.conf.reference --check    # exit 1 when docs/config.md is stale (tests/conf runs it)
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import sys
import typing
from pathlib import Path

from grpo_mega.conf import schema

DOC = Path(__file__).resolve().parents[2] / "docs" / "config.md"


def field_docs(cls: type) -> dict[str, str]:
    """{field: the first line of the docstring under it} from the class's source."""
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body
    docs = {}
    for node, nxt in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str)):
            docs[node.target.id] = " ".join(inspect.cleandoc(nxt.value.value).split())
    return docs


def _default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        return "(required)"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return repr(value) if isinstance(value, str) else str(value)


def _type(cls: type, name: str) -> str:
    hint = typing.get_type_hints(cls)[name]
    text = str(hint).replace("typing.", "")
    return hint.__name__ if isinstance(hint, type) else text.replace("Optional[", "optional ").rstrip("]")


def _table(prefix: str, cls: type) -> list[str]:
    docs, rows, nested = field_docs(cls), [], []
    for f in dataclasses.fields(cls):
        hint = typing.get_type_hints(cls)[f.name]
        if dataclasses.is_dataclass(hint):
            nested.append((f"{prefix}{f.name}.", hint))
            continue
        help_ = docs.get(f.name, "").replace("|", "\\|")
        rows.append(f"| `{prefix}{f.name}` | {_type(cls, f.name)} | `{_default(f)}` | {help_} |")
    lines = ["| field | type | default | what it does |", "|---|---|---|---|", *rows]
    for sub_prefix, sub in nested:
        lines += ["", f"`{sub_prefix.rstrip('.')}`: {inspect.cleandoc(sub.__doc__ or '').splitlines()[0]}", "",
                  *_table(sub_prefix, sub)]
    return lines


def render() -> str:
    root = schema.TrainConfig
    out = ["# Configuration reference", "",
           "Generated from the dataclasses under `grpo_mega/conf/` (the root `TrainConfig` in `schema.py`, one module per component) by `python -m grpo_mega.conf.reference "
           "--write`; `tests/conf/test_train_config.py` fails when this file is stale. Every field is a command-line "
           "override (`python -m grpo_mega.train rollout.n=8 algo.kl_coef=0.01`); these defaults "
           "are what `task=prompts` (an HF model on prompt files) runs with; the demo task (`task=successor`, the "
           "default, and the toy tool tasks) sets the CPU demo's values over them in "
           "`grpo_mega/conf/task/successor.yaml` (`python -m grpo_mega.train [task=...] --cfg job` prints the "
           "composed tree). Each component checks its own fields; `TrainConfig` checks the combinations, before any model "
           "is built.", "",
           "Renamed settings (the old name is refused with the new one): "
           + ", ".join(f"`{old}` -> `{new}`" for old, new in schema.RENAMED.items()) + ".", "",
           "## Top level", ""]
    docs = field_docs(root)
    out += ["| field | type | default | what it does |", "|---|---|---|---|"]
    components = []
    for f in dataclasses.fields(root):
        hint = typing.get_type_hints(root)[f.name]
        if dataclasses.is_dataclass(hint):
            components.append((f.name, hint))
        else:
            out.append(f"| `{f.name}` | {_type(root, f.name)} | `{_default(f)}` | {docs.get(f.name, '')} |")
    for name, cls in components:
        out += ["", f"## `{name}`: {cls.__name__}", "", inspect.cleandoc(cls.__doc__ or "").replace("\n", " "), "",
                *_table(f"{name}.", cls)]
    out += ["", "## Model YAML fields (`model_configs/NAME.yaml`): ModelConfig", "",
            inspect.cleandoc(schema.ModelConfig.__doc__ or "").replace("\n", " "), "",
            *_table("", schema.ModelConfig), ""]
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="docs/config.md from the config dataclasses")
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", action="store_true")
    mode.add_argument("--check", action="store_true")
    args = ap.parse_args(argv)
    text = render()
    if args.write:
        DOC.parent.mkdir(exist_ok=True)
        DOC.write_text(text)
        print(f"wrote {DOC}")
        return 0
    if not DOC.is_file() or DOC.read_text() != text:
        print(f"{DOC} is stale: run python -m grpo_mega.conf.reference --write", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
