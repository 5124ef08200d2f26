import json

import pytest

from grpo_mega.data.dataset import DataError, PromptStream, load_prompts
from grpo_mega.data.toy import make_tokenizer


@pytest.fixture(scope="module")
def tok():
    t = make_tokenizer()
    # a minimal chat template over the toy vocabulary: the last user message, then ">"
    t.chat_template = "<bos>{% for m in messages %}{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}>{% endif %}"
    return t


def _row(content, truth="4", **extra):
    return {"prompt": [{"role": "user", "content": content}], "reward_model": {"ground_truth": truth}, **extra}


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_jsonl_and_parquet_in_verls_schema(tmp_path, tok):
    rows = [_row("3", data_source="toy", extra_info={"split": "train"}), _row("12345678", truth="x"), _row("7", "8")]
    ex, dropped = load_prompts(str(_jsonl(tmp_path / "d.jsonl", rows)), tok, max_prompt_length=5)
    assert dropped == 1 and len(ex) == 2
    assert ex[0].prompt_ids == [1, 6, 13] and ex[0].ground_truth == "4" and ex[0].data_source == "toy"
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    ex2, dropped2 = load_prompts(str(tmp_path / "d.parquet"), tok, max_prompt_length=5)
    assert [e.prompt_ids for e in ex2] == [e.prompt_ids for e in ex] and dropped2 == 1


@pytest.mark.parametrize(
    "content,match",
    [
        ('{"prompt": "3", "reward_model": {"ground_truth": 4}}\n', r"d.jsonl:1: 'prompt' must be a non-empty list"),
        ('{"reward_model": {"ground_truth": 4}}\n', r"d.jsonl:1: missing column 'prompt'"),
        ('{"prompt": [{"role": "user", "content": "3"}]}\n', r"d.jsonl:1: missing column 'reward_model.ground_truth'"),
        ('{"prompt": [{"role": "user", "content": "3"}], "reward_model": {"ground_truth": 4}}\n{oops\n',
         r"d.jsonl:2: not valid JSON"),
        ("\n\n", r"d.jsonl: no rows"),
        ('[1, 2]\n', r"d.jsonl:1: expected an object"),
    ],
)
def test_malformed_files_name_the_line_and_the_rule(tmp_path, tok, content, match):
    (tmp_path / "d.jsonl").write_text(content)
    with pytest.raises(DataError, match=match):
        load_prompts(str(tmp_path / "d.jsonl"), tok, 10)


def test_every_prompt_too_long_and_bad_paths(tmp_path, tok):
    with pytest.raises(DataError, match=r"all 1 prompts are longer than batch.max_prompt_length=2"):
        load_prompts(str(_jsonl(tmp_path / "d.jsonl", [_row("123")])), tok, 2)
    with pytest.raises(DataError, match="no such data file"):
        load_prompts(str(tmp_path / "missing.jsonl"), tok, 2)
    with pytest.raises(DataError, match=r"unknown data format '.csv'"):
        (tmp_path / "d.csv").write_text("a,b\n")
        load_prompts(str(tmp_path / "d.csv"), tok, 2)
    (tmp_path / "bad.parquet").write_bytes(b"not parquet")
    with pytest.raises(DataError, match="not a readable parquet file"):
        load_prompts(str(tmp_path / "bad.parquet"), tok, 2)


def test_stream_is_a_reproducible_shuffle_covering_each_epoch(tmp_path, tok):
    ex, _ = load_prompts(str(_jsonl(tmp_path / "d.jsonl", [_row(str(d)) for d in range(10)])), tok, 10)
    a, b = PromptStream(ex, seed=3), PromptStream(ex, seed=3)
    first = a.next_batch(10)
    assert sorted(e.index for e in first) == list(range(10))  # one epoch = every prompt once
    assert [e.index for e in first] == [e.index for e in b.next_batch(10)]
    assert [e.index for e in a.next_batch(10)] != [e.index for e in first]  # a new order next epoch


@pytest.mark.parametrize(
    "content,match",
    [
        (b'{"prompt": [{"role": "user", "content": "3"}], "reward_model": {"ground_truth": 4}}\n'
         b'{"prompt": [{"role": "user", "content": "caf\xe9"}], "reward_model": {"ground_truth": 4}}\n',
         r"d.jsonl:2: not UTF-8 \(byte 0xe9 at byte 45 of the line\); save the file as UTF-8"),
        (b'{"prompt": [{"role": "user", "content": "3"}], "reward_model": {"ground_truth": 4}, "extra_info": "x"}\n',
         r"d.jsonl:1: 'extra_info' must be an object .* or absent, got str 'x'"),
        (b'{"prompt": [{"role": "user", "content": "3"}], "reward_model": {"ground_truth": 4}, '
         b'"extra_info": [[1, 2]]}\n',
         r"d.jsonl:1: 'extra_info' must be an object .*got list"),
        (b'{"prompt": [{"role": "user", "content": "3"}], "reward_model": {"ground_truth": null}}\n',
         r"d.jsonl:1: 'reward_model.ground_truth' is null; give the answer"),
    ],
)
def test_bytes_and_types_name_the_line(tmp_path, tok, content, match):
    (tmp_path / "d.jsonl").write_bytes(content)
    with pytest.raises(DataError, match=match):
        load_prompts(str(tmp_path / "d.jsonl"), tok, 10)


def test_a_utf8_bom_and_a_null_extra_info_are_fine(tmp_path, tok):
    (tmp_path / "d.jsonl").write_bytes(b"\xef\xbb\xbf" + json.dumps(_row("3", extra_info=None)).encode() + b"\n")
    ex, _ = load_prompts(str(tmp_path / "d.jsonl"), tok, 10)
    assert ex[0].prompt_ids == [1, 6, 13] and ex[0].extra_info == {}


def test_parquet_string_that_is_not_utf8_names_the_row(tmp_path, tok):
    import pyarrow as pa
    import pyarrow.parquet as pq

    good = pa.Table.from_pylist([_row("3"), _row("4")])
    source = pa.array(["ok", "caf\xe9".encode("latin1")], type=pa.binary()).cast(pa.string(), safe=False)
    pq.write_table(good.append_column("data_source", source), tmp_path / "d.parquet")
    with pytest.raises(DataError, match=r"d.parquet:2: a string column is not UTF-8 \(unexpected end of data\)"):
        load_prompts(str(tmp_path / "d.parquet"), tok, 10)


def test_a_prompt_too_long_to_fit_is_dropped_without_tokenising(tmp_path, tok, monkeypatch):
    calls = []
    real = tok.apply_chat_template
    monkeypatch.setattr(tok, "apply_chat_template", lambda m, **kw: calls.append(kw["tokenize"]) or real(m, **kw))
    ex, dropped = load_prompts(str(_jsonl(tmp_path / "d.jsonl", [_row("3"), _row("1" * 10_000)])), tok, 10)
    assert len(ex) == 1 and dropped == 1
    assert calls == [True, False]  # the long one was rendered (its length checked), never tokenised
