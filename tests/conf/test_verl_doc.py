"""docs/verl.md names only grpo-mega settings that exist: every `section.key` it writes in backticks (with the
`x_low/high` shorthand expanded) is a row of the generated docs/config.md, and every registered policy loss and
advantage estimator appears in it."""

import re
from pathlib import Path

from grpo_mega.algo.advantages import ADV_ESTIMATORS
from grpo_mega.algo.policy_loss import POLICY_LOSSES

DOCS = Path(__file__).resolve().parents[2] / "docs"
SECTIONS = ("algo", "batch", "reward", "rollout", "optim", "run", "parallel")


def _keys(text):
    out = set()
    for code in re.findall(r"`([^`]+)`", text):
        for m in re.finditer(rf"\b(?:{'|'.join(SECTIONS)})\.[a-z_.]+(?:/[a-z]+)*", code):
            first, *rest = m.group(0).split("/")
            out.add(first)
            stem = first.rsplit("_", 1)[0]
            out.update(f"{stem}_{r}" for r in rest)
    return out


def test_every_grpo_mega_key_in_the_verl_page_exists():
    page = (DOCS / "verl.md").read_text()
    config = (DOCS / "config.md").read_text()
    keys = _keys(page)
    assert len(keys) > 40
    missing = sorted(k for k in keys if f"| `{k}` |" not in config)
    assert not missing, missing
    for name in POLICY_LOSSES.names() + ADV_ESTIMATORS.names():
        assert f"`{name}`" in page, name
