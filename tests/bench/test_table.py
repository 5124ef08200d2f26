"""bench/table.py: README.md's results table is the one the JSONs in bench_results/ give (regenerate with
`python -m bench.table --write`), every JSON there is shown or named as a supplement, and the block's markers are
required."""

import json
from pathlib import Path

import pytest

from bench import table

REPO = Path(__file__).resolve().parents[2]


def test_the_readme_table_is_current():
    readme = (REPO / "README.md").read_text()
    assert table.with_table(readme, table.render()) == readme, "README.md's results table is stale: " \
                                                               "python -m bench.table --write"
    assert table.main(["--check"]) == 0


def test_every_result_is_a_row_or_a_named_supplement():
    files = {p.name for p in (REPO / "bench_results").glob("*.json")}
    rows = {r.result for r in table.ROWS}
    assert rows <= files, sorted(rows - files)
    assert not rows & set(table.SUPPLEMENTS)
    assert files - rows == set(table.SUPPLEMENTS), sorted(files - rows ^ set(table.SUPPLEMENTS))


def test_a_headline_is_computed_from_its_json(tmp_path):
    """A changed number in a JSON changes the rendered row (nothing is typed by hand)."""
    for f in (REPO / "bench_results").glob("*.json"):
        (tmp_path / f.name).write_text(f.read_text())
    d = json.loads((tmp_path / "packing.json").read_text())
    d["speedup"], d["packed"]["seconds"]["total"] = 3.0, 100.0
    (tmp_path / "packing.json").write_text(json.dumps(d))
    row = next(line for line in table.render(tmp_path).splitlines() if line.startswith("| packed vs padded"))
    assert "3.00x faster (303.5 s -> 100.0 s)" in row and "[packing.json](bench_results/packing.json)" in row


def test_the_block_markers_are_required_once():
    with pytest.raises(SystemExit, match="must hold the line"):
        table.with_table("# no table here\n", "| x |")
    text = f"a\n{table.BEGIN}\nold\n{table.END}\nb\n"
    assert table.with_table(text, "| new |") == f"a\n{table.BEGIN}\n| new |\n{table.END}\nb\n"
