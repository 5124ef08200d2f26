"""Benchmark: the prompt data path at scale (grpo_mega.data.dataset). Writes JSON (default bench_results/data.json).

    python -m bench.data [--rows 10000 1000000] [--batch 512] [--batches 5] [--formats jsonl parquet]
                         [--tokenizer smollm2|toy] [--dir DIR] [--out bench_results/data.json]

For each row count and format a file of short rows in verl's schema (a one-message arithmetic prompt, ~150 bytes
a row in jsonl) is written to `--dir` (a temporary directory by default), then a fresh process (bench.common's
measuring environment) does what one rank does at start-up, timed and with its resident memory (VmRSS) read
before and after:
- start-up: PromptFile (the jsonl line index; a parquet's Arrow copy written into an empty cache, then, in a
  second process, found in it), check_head (HEAD_ROWS rows checked and tokenised) and the validation sample
  (`--val` prompts, as eval.max_prompts without data.val_files), and the PromptStream with epoch 0's permutation;
- draws: `--batches` batches of `--batch` prompts from a PromptStream (the first one makes the epoch's
  permutation), each timed; the index's bytes and the permutation's.
Resident memory is VmRSS, and apart its own part (RssAnon) and the mapped files' (RssFile: a parquet's Arrow
copy, pages shared by the node's ranks).
The tokenizer is SmolLM2-135M-Instruct's (its chat template; `make smollm2` prepares it) or, with
--tokenizer toy or when SmolLM2 is not prepared, the toy tokenizer with a one-line template.
Timings are wall-clock on whatever else runs on the machine (its load averages go into the JSON).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from bench import common

PROMPT = "What is {a} + {b}? Answer with the number only, then stop."
# resident memory, apart: the process's own (RssAnon) and mapped files' (RssFile: a parquet's Arrow copy, shared
# with every rank of the node and dropped by the kernel under pressure)
RSS_PARTS = ("RssAnon", "RssFile")


def write_jsonl(path: Path, rows: int) -> None:
    """`rows` rows in verl's schema (formatted from one template: the bytes json.dumps writes, written fast)."""
    line = ('{{"prompt": [{{"role": "user", "content": "{q}"}}], "reward_model": {{"ground_truth": "{t}"}}, '
            '"data_source": "toy_arith", "extra_info": {{"index": {i}}}}}\n')
    with open(path, "w", buffering=1 << 22) as f:
        for i in range(rows):
            x, y = i % 997, i // 997
            f.write(line.format(q=PROMPT.format(a=x, b=y), t=x + y, i=i))


def write_parquet(path: Path, rows: int, chunk: int = 1 << 18) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    writer = None
    for start in range(0, rows, chunk):
        idx = range(start, min(rows, start + chunk))
        table = pa.table({
            "prompt": [[{"role": "user", "content": PROMPT.format(a=i % 997, b=i // 997)}] for i in idx],
            "reward_model": [{"ground_truth": str(i % 997 + i // 997)} for i in idx],
            "data_source": ["toy_arith"] * len(idx),
            "extra_info": [{"index": i} for i in idx],
        })
        if writer is None:
            writer = pq.ParquetWriter(path, table.schema)
        writer.write_table(table)
    writer.close()


def tokenizer(name: str):
    if name == "smollm2":
        try:
            from transformers import AutoTokenizer

            from grpo_mega.cli.prepare_model import prepared_dir

            return AutoTokenizer.from_pretrained(prepared_dir()), "SmolLM2-135M-Instruct"
        except RuntimeError:
            pass
    from grpo_mega.data.toy import make_tokenizer

    tok = make_tokenizer()
    tok.chat_template = "<bos>{% for m in messages %}{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}>{% endif %}"
    return tok, "toy"


def worker(args) -> dict:
    """One rank's start-up and draws, in this (fresh) process."""
    tok, tok_name = tokenizer(args.tokenizer)
    from grpo_mega.data.dataset import PromptFile, PromptStream

    if args.path.endswith(".parquet"):  # its import (tens of MiB, whatever the rows) before the memory is read
        import pyarrow.ipc  # noqa: F401
        import pyarrow.parquet  # noqa: F401
    common.reset_peak_rss()
    before, parts_before = common.rss_mib(), common.rss_mib(*RSS_PARTS)
    t0 = time.perf_counter()
    f = PromptFile(args.path, tok, args.max_prompt_length, cache_dir=args.cache)
    index_s = time.perf_counter() - t0
    checked, fit, dropped = f.check_head()
    val = f.sample(args.val, args.seed)
    stream = PromptStream(f, args.seed)  # epoch 0's permutation
    startup_s = time.perf_counter() - t0
    after_start, parts_start = common.rss_mib(), common.rss_mib(*RSS_PARTS)
    draws, _, batches = zip(*(common.timed(lambda: stream.next_batch(args.batch)) for _ in range(args.batches)))
    after, parts_after = common.rss_mib(), common.rss_mib(*RSS_PARTS)
    assert len(batches[-1]) == args.batch and len(val) == min(args.val, len(f)) and fit == checked - dropped
    return dict(rows=len(f), tokenizer=tok_name, wrote_cache=bool(getattr(f.rows, "wrote", False)),
                index_s=index_s, startup_s=startup_s, index_bytes=f.index_bytes,
                permutation_bytes=int(stream._perm.nbytes), head_rows_checked=checked,
                rss_before_mib=before["VmRSS"], rss_after_startup_mib=after_start["VmRSS"],
                rss_after_draws_mib=after["VmRSS"], peak_rss_mib=after["VmHWM"],
                startup_rss_growth_mib=after_start["VmRSS"] - before["VmRSS"],
                draws_rss_growth_mib=after["VmRSS"] - before["VmRSS"],
                startup_anon_growth_mib=parts_start["RssAnon"] - parts_before["RssAnon"],
                startup_file_growth_mib=parts_start["RssFile"] - parts_before["RssFile"],
                draws_anon_growth_mib=parts_after["RssAnon"] - parts_before["RssAnon"],
                first_batch_s=draws[0], batch_s=sorted(draws[1:])[len(draws[1:]) // 2] if len(draws) > 1 else None,
                batch_s_all=list(draws))


def main() -> None:
    ap = common.parser(__doc__, "data")
    ap.add_argument("--rows", type=int, nargs="+", default=[10_000, 1_000_000])
    ap.add_argument("--formats", nargs="+", choices=["jsonl", "parquet"], default=["jsonl", "parquet"])
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--batches", type=int, default=5)
    ap.add_argument("--val", type=int, default=256, help="validation prompts sampled at start-up (eval.max_prompts)")
    ap.add_argument("--max-prompt-length", type=int, default=512)
    ap.add_argument("--tokenizer", choices=["smollm2", "toy"], default="smollm2")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dir", default=None, help="where the data files go (default: a temporary directory)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--path", help=argparse.SUPPRESS)
    ap.add_argument("--cache", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args)))
        return

    load_before = os.getloadavg()
    results = []
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        for rows in args.rows:
            for fmt in args.formats:
                path = Path(d) / f"rows{rows}.{fmt}"
                made_s = common.timed(lambda: (write_jsonl if fmt == "jsonl" else write_parquet)(path, rows))[0]
                cache = Path(d) / f"cache{rows}"
                runs = ["first"] if fmt == "jsonl" else ["first", "cached"]  # a parquet's copy: written, then found
                for run in runs:
                    cmd = common.worker_cmd("bench.data", "--worker", "--path", str(path), "--cache", str(cache),
                                            *common.flags(args, "batch", "batches", "val", "max_prompt_length",
                                                          "tokenizer", "seed"))
                    r = common.run_worker(cmd, f"{fmt} with {rows} rows ({run})")
                    r.update(format=fmt, run=run, file_bytes=path.stat().st_size, file_write_s=made_s)
                    results.append(r)
                    print(f"{fmt:7s} {rows:>9d} rows {run:6s}: start-up {r['startup_s']:.2f} s "
                          f"(index {r['index_s']:.2f} s), RSS +{r['startup_rss_growth_mib']:.0f} MiB "
                          f"(own +{r['startup_anon_growth_mib']:.0f}, index {r['index_bytes'] / 2**20:.1f} MiB), {args.batch}-prompt batch "
                          f"{r['batch_s']:.3f} s (first {r['first_batch_s']:.3f} s)", flush=True)
                path.unlink()
    out = dict(machine=common.machine(load_before=load_before, load_after=os.getloadavg()),
               settings=dict(batch=args.batch, batches=args.batches, val=args.val,
                             max_prompt_length=args.max_prompt_length, tokenizer=args.tokenizer, seed=args.seed),
               results=results)
    print(f"wrote {common.write_json(args.out, out)}")


if __name__ == "__main__":
    sys.exit(main())
