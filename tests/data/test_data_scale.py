"""The data path at scale (issue 40 point 4): a training file is indexed at start-up, not read or tokenised
whole; one permutation per epoch; a malformed row far into the file stops the run when it is drawn, naming its
line; a parquet file's Arrow copy is written once per content, by one process of several; resume mid-epoch
draws the same next batch."""

import json
import re
import subprocess
import sys
import textwrap
import time
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from grpo_mega.data import dataset
from grpo_mega.data.dataset import HEAD_ROWS, DataError, PromptFile, PromptStream, load_prompts
from grpo_mega.data.toy import make_tokenizer

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tok():
    t = make_tokenizer()
    t.chat_template = "<bos>{% for m in messages %}{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}>{% endif %}"
    return t


def _line(i: int) -> str:
    """Row i: a prompt of the digits of i (the toy vocabulary), its ground truth i + 1, a note making it ~100 bytes."""
    return json.dumps({"prompt": [{"role": "user", "content": str(i)}], "reward_model": {"ground_truth": str(i + 1)},
                       "data_source": "toy", "extra_info": {"row": i, "note": "x" * 24}}) + "\n"


def _jsonl(path: Path, n: int, bad: dict[int, str] | None = None) -> Path:
    """n rows (line i + 1 is row i); `bad` {line number: its text instead}."""
    bad = bad or {}
    with open(path, "w") as f:
        f.writelines(bad.get(i + 1, _line(i)) for i in range(n))
    return path


def _counting(tok, monkeypatch) -> list:
    """Every prompt the chat template renders (tokenize: True or False), one entry per conversation."""
    calls = []
    real = tok.apply_chat_template

    def counted(m, **kw):
        calls.extend([kw["tokenize"]] * (len(m) if isinstance(m[0], list) else 1))
        return real(m, **kw)

    monkeypatch.setattr(tok, "apply_chat_template", counted)
    return calls


def test_a_100k_row_jsonl_starts_from_an_index_and_tokenises_only_what_it_checks_or_draws(tmp_path, tok, monkeypatch):
    n = 100_000
    path = _jsonl(tmp_path / "big.jsonl", n)
    size = path.stat().st_size
    monkeypatch.setattr(dataset, "_SCAN_BYTES", 1 << 20)
    calls = _counting(tok, monkeypatch)
    tracemalloc.start()
    t0 = time.perf_counter()
    f = PromptFile(str(path), tok, 16)
    index_s = time.perf_counter() - t0
    current, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert len(f) == n and f.index_bytes == 8 * (n + 1)
    assert calls == []  # nothing tokenised to index it
    # What indexing holds is the index (8 bytes a row), its peak the index twice plus one 1 MiB read, not the file
    # (10.8 MB): the bounds fail for a loader that reads the file whole.
    assert size > 10_000_000
    assert current < f.index_bytes + 64_000, (current, f.index_bytes)
    assert peak < 3 * f.index_bytes + 3 * (1 << 20), (peak, f.index_bytes)
    assert index_s < 5.0, index_s  # ~0.05 s alone; generous on a shared, loaded machine
    checked, fit, dropped = f.check_head()
    assert (checked, fit, dropped) == (HEAD_ROWS, HEAD_ROWS, 0) and len(calls) == HEAD_ROWS
    stream = PromptStream(f, seed=0)
    batch = stream.next_batch(512)
    assert len(calls) == HEAD_ROWS + 512  # a batch tokenises its own prompts, no others
    for e in batch:  # each example is its row, tokenised as load_prompts tokenises it
        assert e.ground_truth == str(e.index + 1) and e.extra_info["row"] == e.index
        assert e.prompt_ids == [1, *[int(d) + 3 for d in str(e.index)], 13]


def test_every_epoch_is_one_permutation_drawn_once(tmp_path, tok):
    n = 997
    f = PromptFile(str(_jsonl(tmp_path / "d.jsonl", n)), tok, 16)
    stream = PromptStream(f, seed=5)
    assert stream.permutations == 1  # epoch 0's, at start-up: the first draw makes none
    stream.next_batch(61)
    assert stream.permutations == 1
    stream = PromptStream(f, seed=5)
    drawn = []
    while len(drawn) < 3 * n:  # batches that do not divide an epoch: some straddle two
        drawn += [e.index for e in stream.next_batch(61)]
    epochs = [drawn[k * n:(k + 1) * n] for k in range(3)]
    for order in epochs:
        assert sorted(order) == list(range(n))  # every row once an epoch
    assert epochs[0] != epochs[1] != epochs[2] != epochs[0]
    assert stream.permutations == 4  # one per epoch drawn from (the fourth holds the tail of the last batch)
    assert epochs[0] == [int(i) for i in np.random.default_rng([5, 0]).permutation(n)]  # numpy's, seeded (seed, epoch)
    again = PromptStream(PromptFile(str(tmp_path / "d.jsonl"), tok, 16), seed=5)
    assert [e.index for e in again.next_batch(3 * n)] == drawn[:3 * n]
    resumed = PromptStream(PromptFile(str(tmp_path / "d.jsonl"), tok, 16), seed=5)
    resumed.set_state({"cursor": 2 * n + 7, "rows": n})  # resumed in epoch 2: its permutation made at start-up too
    assert resumed.permutations == 2 and resumed._epoch == 2
    assert [e.index for e in resumed.next_batch(61)] == drawn[2 * n + 7:2 * n + 68] and resumed.permutations == 2


def test_a_skipped_row_keeps_its_place_and_a_file_without_a_fitting_prompt_is_an_error(tmp_path, tok):
    # line 3 blank, line 5 too long for max_prompt_length=4 ("<bos>" 4 digits ">" is 6 tokens)
    path = _jsonl(tmp_path / "d.jsonl", 8, bad={3: "\n", 5: _line(12345)})
    f = PromptFile(str(path), tok, 4)
    assert f.check_head() == (8, 6, 1)
    stream = PromptStream(f, seed=1)
    first = [e.index for e in stream.next_batch(6)]
    assert sorted(first) == [0, 1, 3, 5, 6, 7] and stream.cursor == 8  # the epoch's 6 prompts; 8 rows drawn
    second = [e.index for e in stream.next_batch(6)]
    assert sorted(second) == sorted(first) and second != first
    none_fit = PromptFile(str(_jsonl(tmp_path / "long.jsonl", 3)), tok, 2)
    with pytest.raises(DataError, match=r"long\.jsonl: all 3 prompts are longer than batch\.max_prompt_length=2"):
        none_fit.check_head()
    with pytest.raises(DataError, match=r"long\.jsonl: none of its 3 rows is a prompt of at most"):
        PromptStream(none_fit, seed=0).next_batch(1)


@pytest.mark.parametrize("line,text,match", [
    (4321, "{oops\n", r"not valid JSON \(Expecting property name enclosed in double quotes\); expected one JSON"),
    (3000, json.dumps({"prompt": [{"role": "user", "content": "1"}], "reward_model": {"ground_truth": None}}) + "\n",
     r"'reward_model\.ground_truth' is null; give the answer"),
    (4999, b'{"prompt": [{"role": "user", "content": "caf\xe9"}], "reward_model": {"ground_truth": 4}}\n',
     r"not UTF-8 \(byte 0xe9 at byte 45 of the line\); save the file as UTF-8"),
], ids=["json", "null_truth", "utf8"])
def test_a_bad_row_far_into_the_file_stops_the_draw_that_reaches_it(tmp_path, tok, line, text, match):
    n = 5000
    path = tmp_path / "d.jsonl"
    with open(path, "wb") as f:
        f.writelines((text if isinstance(text, bytes) else text.encode()) if i + 1 == line else _line(i).encode()
                     for i in range(n))
    f = PromptFile(str(path), tok, 16)
    f.check_head()  # the first HEAD_ROWS rows are fine: start-up passes
    assert line > HEAD_ROWS
    stream = PromptStream(f, seed=2)
    position = int(np.flatnonzero(stream._order(0) == line - 1)[0])  # where epoch 0 draws it
    before = position // 64  # whole batches of 64 drawn before the one holding it
    for _ in range(before):
        stream.next_batch(64)
    with pytest.raises(DataError, match=rf"^{re.escape(str(path))}:{line}: {match}") as err:
        stream.next_batch(64)
    assert "\n" not in str(err.value)
    # the same one-line error as when the file is read whole (a small file's load)
    with pytest.raises(DataError) as whole:
        load_prompts(str(path), tok, 16)
    assert str(whole.value) == str(err.value)


def test_resume_mid_epoch_draws_the_same_next_batches(tmp_path, tok):
    path = _jsonl(tmp_path / "d.jsonl", 300, bad={17: "\n", 40: _line(10 ** 15)})  # a skipped row or two
    a = PromptStream(PromptFile(str(path), tok, 12), seed=11)
    for _ in range(3):
        a.next_batch(64)
    saved = json.loads(json.dumps(a.get_state()))  # as a checkpoint keeps it
    assert saved == {"cursor": a.cursor, "rows": 300} and 0 < a.cursor % 300
    want = [[e.index for e in a.next_batch(64)] for _ in range(4)]  # into the next epoch and beyond
    b = PromptStream(PromptFile(str(path), tok, 12), seed=11)  # a new process
    b.set_state(saved)
    got = [[e.index for e in b.next_batch(64)] for _ in range(4)]
    assert got == want
    assert b.next_batch(64)[0].prompt_ids == a.next_batch(64)[0].prompt_ids


def test_resume_with_a_changed_file_or_an_old_cursor_warns(tmp_path, tok, caplog):
    stream = PromptStream(PromptFile(str(_jsonl(tmp_path / "d.jsonl", 50)), tok, 16), seed=0)
    with caplog.at_level("WARNING"):
        stream.set_state({"cursor": 70, "rows": 60})
        assert stream.cursor == 70 and "has 50 rows, the checkpoint's had 60" in caplog.text
        caplog.clear()
        stream.set_state(12)  # a checkpoint written before the per-epoch permutation
        assert stream.cursor == 12 and "from before the per-epoch permutation" in caplog.text
        caplog.clear()
        stream.set_state({"cursor": 3, "rows": 50})
    assert caplog.text == ""


def _parquet(path: Path, n: int, offset: int = 0, row_group_size: int | None = None) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [json.loads(_line(i + offset)) for i in range(n)]
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=row_group_size)
    return path


def test_a_parquet_copy_is_written_once_per_content_and_reused(tmp_path, tok, monkeypatch):
    cache = tmp_path / "cache"
    path = _parquet(tmp_path / "d.parquet", 1000, row_group_size=300)
    monkeypatch.setattr(dataset, "_ARROW_BATCH_ROWS", 128)
    first = PromptFile(str(path), tok, 16, cache_dir=str(cache))
    copy = first.rows.arrow
    assert first.rows.wrote and copy.parent == cache and dataset.file_hash(path) in copy.name
    assert len(first) == 1000 and first.index_bytes == 8 * (len(first.rows.starts))
    assert max(np.diff(first.rows.starts)) <= 128  # row groups of 300 read in batches of at most 128 rows
    stat = copy.stat()
    second = PromptFile(str(path), tok, 16, cache_dir=str(cache))
    assert not second.rows.wrote and second.rows.arrow == copy
    assert (copy.stat().st_mtime_ns, copy.stat().st_ino) == (stat.st_mtime_ns, stat.st_ino)  # reused, not rewritten
    want = load_prompts(str(_jsonl(tmp_path / "d.jsonl", 1000)), tok, 16)[0]
    for i in (0, 127, 128, 299, 300, 999):  # across batch and row group boundaries: the rows, as the jsonl's
        e = second.example(i)
        assert (e.prompt_ids, e.ground_truth, e.extra_info, e.index) == (
            want[i].prompt_ids, want[i].ground_truth, want[i].extra_info, i)
    _parquet(path, 1000, offset=5000)  # the same name, other content: a new copy
    third = PromptFile(str(path), tok, 16, cache_dir=str(cache))
    assert third.rows.wrote and third.rows.arrow != copy and third.example(0).ground_truth == "5001"
    assert sorted(p.name for p in cache.iterdir() if p.suffix == ".arrow") == sorted([copy.name, third.rows.arrow.name])
    assert not [p for p in cache.iterdir() if p.name.startswith(".")]  # no temporary left


_RANK = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from grpo_mega.data import dataset
    from grpo_mega.data.toy import make_tokenizer

    path, cache, go, log = sys.argv[1:5]
    real = dataset._ParquetRows._write

    def slow_write(self, tmp):  # a slow copy: the others must find the lock held
        with open(log, "a") as f:
            f.write("wrote\\n")
        time.sleep(1.0)
        real(self, tmp)

    dataset._ParquetRows._write = slow_write
    while not Path(go).exists():
        time.sleep(0.01)
    tok = make_tokenizer()
    f = dataset.PromptFile(path, tok, 16, cache_dir=cache)
    print(len(f), f.rows.arrow.name, f.rows.row(777)["reward_model"]["ground_truth"])
""")


def test_the_ranks_of_a_node_write_one_copy_under_a_lock(tmp_path):
    path = _parquet(tmp_path / "d.parquet", 2000)
    cache, go, log = tmp_path / "cache", tmp_path / "go", tmp_path / "writes.log"
    procs = [subprocess.Popen([sys.executable, "-c", _RANK, str(path), str(cache), str(go), str(log)], cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(4)]
    time.sleep(0.5)
    go.touch()  # all four at once, as a node's ranks start
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-2000:] for o in outs]
    assert log.read_text() == "wrote\n"  # one writer; three waited on the lock and mapped its copy
    assert len({o[0] for o in outs}) == 1 and outs[0][0].split()[0] == "2000" and outs[0][0].split()[2] == "778"


def test_an_unwritable_cache_dir_is_one_line_naming_it(tmp_path, tok):
    path = _parquet(tmp_path / "d.parquet", 10)
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(DataError, match=r"^data\.cache_dir: cannot write the Arrow copy of .*d\.parquet in .*file/sub "
                                        r"\(.*\); set data\.cache_dir to a writable directory$"):
        PromptFile(str(path), tok, 16, cache_dir=str(blocker / "sub"))


def test_a_jsonl_edited_while_the_run_reads_it_is_named_as_such(tmp_path, tok):
    path = _jsonl(tmp_path / "d.jsonl", 2000)
    f = PromptFile(str(path), tok, 16)
    f.check_head()
    text = path.read_text()
    path.write_text("\n" * 7 + text[: len(text) // 2])  # rewritten in place: the indexed offsets now cut lines
    stream = PromptStream(f, seed=0)
    with pytest.raises(DataError, match=r"d\.jsonl:\d+: the file was changed after it was indexed at start-up"):
        stream.next_batch(2000)


def test_a_batch_tokenised_together_equals_transformers_row_by_row(tmp_path):
    """The rows of a draw go through the chat template in one call; each one's ids are what transformers'
    apply_chat_template gives that row alone (SmolLM2's tokenizer and template; contents of every length, with
    special-token text and non-ASCII)."""
    from transformers import AutoTokenizer

    from tests.models.hf_fixtures import smollm2_dir

    tok = AutoTokenizer.from_pretrained(smollm2_dir())
    contents = ["What is 2+2?", "", " leading space", "<|im_end|> not an end", "naïve café 日本語 🙂",
                "x" * 300, "a\nb\n\nc", "<|im_start|>assistant\nhi"]
    rows = [{"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": c}],
             "reward_model": {"ground_truth": str(i)}} for i, c in enumerate(contents)]
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    f = PromptFile(str(path), tok, 4096)
    got = f.examples(range(len(rows)))
    for r, e in zip(rows, got):
        want = tok.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=True)
        want = want["input_ids"] if hasattr(want, "keys") else want
        assert e.prompt_ids == list(want)
    assert [e.prompt_ids for e in got] == [f.example(i).prompt_ids for i in range(len(rows))]


def test_a_template_failure_in_a_batch_names_its_row(tmp_path, tok, monkeypatch):
    monkeypatch.setattr(tok, "chat_template", "{% for m in messages %}{% if m['role'] == 'bad' %}"
                        "{{ raise_exception('no bad roles') }}{% endif %}{{ m['content'] }}{% endfor %}>")
    path = _jsonl(tmp_path / "d.jsonl", 6, bad={4: json.dumps({"prompt": [{"role": "bad", "content": "1"}],
                                                               "reward_model": {"ground_truth": "2"}}) + "\n"})
    f = PromptFile(str(path), tok, 16)
    assert [e.index for e in f.examples([0, 1])] == [0, 1]
    with pytest.raises(DataError, match=r"d\.jsonl:4: the tokenizer's chat template failed on this prompt \(no bad roles"):
        f.examples(range(6))
