"""Prompt datasets in verl's schema, from jsonl or parquet, at any size.

A row: `prompt` (chat messages: a non-empty list of {"role", "content"}), `reward_model.ground_truth`,
optionally `data_source` and `extra_info`. Prompts are rendered with the tokenizer's chat template (with the
generation prompt) and tokenised; prompts longer than `max_prompt_length` tokens are dropped and counted (one
whose rendered text has more characters than that many tokens could hold is dropped before it is tokenised). A
malformed row (bytes that are not UTF-8, a wrong-typed column, a null ground truth) is a one-line error naming the
file, the line and what to do.

Nothing is read whole and nothing is tokenised ahead (`PromptFile`): at start-up a .jsonl is indexed by the byte
offset of each line (one scan for newlines, 8 bytes a row; a file edited after that is named as such when a row
no longer parses), and a .parquet is copied once, row group by row group in batches of at most _ARROW_BATCH_ROWS,
into Arrow's IPC format in a cache directory (keyed by the file's content hash; several ranks of a node wait on
one lock and the first one writes it) and memory-mapped (its index is its batches' row counts). A row is read,
checked, rendered and tokenised when it is drawn (a draw's rows through the chat template in one call);
`PromptStream` draws from one seeded permutation per epoch (the first made when the stream is made or resumed,
at start-up). So start-up is a scan, memory is the index and one
epoch's permutation whatever the row count, and a 512-prompt batch costs 512 rows (bench/data.py). The first
HEAD_ROWS rows are checked at start-up (a wrong schema, or every prompt of a small file too long, stops the run
before any model is built); a malformed row further on stops the run when it is drawn, with the same error.

Multi-turn rows (rollout.multi_turn, verl's fields): `extra_info.tools_kwargs` ({tool name: {"create_kwargs":
{...}, "execute_kwargs": {...}}}) names the tools the row offers (their schemas go to the chat template's
`tools=`; a name not among the run's tools is refused) and the keyword arguments their calls get;
`extra_info.need_tools_kwargs: true` requires them. A row without tools_kwargs is offered every tool of the run.
The row travels with its prompt to the multi-turn engine, so rows with the same prompt may differ in kwargs.

Long on purpose: the two formats' readers share the row checks, the rendering and the per-epoch permutation;
split, one row's rules would live in three files.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np

log = logging.getLogger(__name__)

HEAD_ROWS = 1024
"""Rows checked (and tokenised) at start-up; the rest when drawn."""
_SCAN_BYTES = 4 << 20
"""The read size of the scans (newlines, the content hash): what start-up holds beyond the index."""
_ARROW_BATCH_ROWS = 1 << 16
"""Rows per record batch of a parquet file's Arrow copy (a row group is read in batches of at most this many)."""


class DataError(ValueError):
    """A data file that cannot be used as it is."""


@dataclass
class PromptExample:
    prompt_ids: list[int]
    ground_truth: Any
    data_source: str = ""
    extra_info: dict = field(default_factory=dict)
    index: int = 0
    """The row's number in its file, from 0 (a .jsonl's row i is its line i + 1)."""


class _JsonlRows:
    """A .jsonl file's lines by number: the byte offset of every line start (int64 [lines + 1]), found by one scan
    for newlines; a line is read (one pread) when asked for."""

    def __init__(self, path: Path):
        self.path = path
        parts, base = [np.zeros(1, dtype=np.int64)], 0
        buf = bytearray(_SCAN_BYTES)
        with open(path, "rb", buffering=0) as f:
            while got := f.readinto(buf):
                chunk = np.frombuffer(buf, dtype=np.uint8, count=got)
                parts.append(np.flatnonzero(chunk == 10).astype(np.int64) + (base + 1))
                base += got
        starts = np.concatenate(parts)
        self.starts = starts if starts[-1] == base else np.append(starts, base)  # a last line without a newline
        self.fd = os.open(path, os.O_RDONLY)
        self.indexed = self._stamp()

    def _stamp(self) -> tuple[int, int]:
        st = os.fstat(self.fd)
        return st.st_size, st.st_mtime_ns

    def _error(self, i: int, what: str) -> DataError:
        """A malformed line i + 1; or, when the file was written to since it was indexed, that (the index no
        longer finds its lines)."""
        if self._stamp() != self.indexed:
            return DataError(f"{self.path}:{i + 1}: the file was changed after it was indexed at start-up (its size "
                             f"or time differs); leave the training file alone while a run reads it, or write a new "
                             f"file and restart the run with it")
        return DataError(f"{self.path}:{i + 1}: {what}")

    def __len__(self) -> int:
        return len(self.starts) - 1

    @property
    def nbytes(self) -> int:
        return self.starts.nbytes

    def row(self, i: int) -> Any:
        """Line i + 1 parsed (None: a blank line)."""
        lo, hi = int(self.starts[i]), int(self.starts[i + 1])
        raw = os.pread(self.fd, hi - lo, lo)
        try:
            line = raw.decode("utf-8-sig" if i == 0 else "utf-8")  # a BOM only starts a file
        except UnicodeDecodeError as e:
            raise self._error(i, f"not UTF-8 (byte {raw[e.start]:#04x} at byte {e.start + 1} of the line); save the "
                                 f"file as UTF-8, e.g. iconv -f latin1 -t utf-8") from None
        if not line.strip():
            return None
        try:
            return json.loads(line)
        except (ValueError, RecursionError) as e:
            raise self._error(i, f"not valid JSON ({getattr(e, 'msg', e)}); expected one JSON object per "
                                 f"line") from None

    def __getstate__(self):  # a worker process opens its own descriptor
        return {k: v for k, v in self.__dict__.items() if k != "fd"}

    def __setstate__(self, state):
        self.__dict__.update(state, fd=os.open(state["path"], os.O_RDONLY))

    def __del__(self):
        fd = self.__dict__.pop("fd", None)
        if fd is not None:
            os.close(fd)


def default_cache_dir() -> Path:
    """$GRPO_MEGA_CACHE/data (GRPO_MEGA_CACHE defaults to ~/.cache/grpo_mega)."""
    return Path(os.environ.get("GRPO_MEGA_CACHE", Path.home() / ".cache" / "grpo_mega")) / "data"


def file_hash(path: Path) -> str:
    """blake2b of the file's bytes, 32 hex digits."""
    h = hashlib.blake2b(digest_size=16)
    buf = bytearray(_SCAN_BYTES)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while got := f.readinto(buf):
            h.update(view[:got])
    return h.hexdigest()


class _ParquetRows:
    """A .parquet file's rows by number, from its copy in Arrow's IPC format (uncompressed, memory-mapped: a row
    costs the pages it touches, shared by every rank of the node). The copy is written once per file content in
    `cache_dir` (named by the content hash, so an edited file gets a new copy), row group by row group in batches
    of at most _ARROW_BATCH_ROWS rows, under a lock that the node's other ranks wait on; they then map the copy."""

    def __init__(self, path: Path, cache_dir: Optional[Path] = None):
        try:
            import pyarrow as pa
            import pyarrow.parquet as pq
        except ImportError:
            raise DataError("reading parquet needs pyarrow: pip install pyarrow") from None
        self.path = path
        try:
            pq.ParquetFile(path).close()
        except Exception as e:  # noqa: BLE001 - pyarrow raises several types for a bad file
            raise DataError(f"{path}: not a readable parquet file ({e})") from None
        cache = Path(cache_dir) if cache_dir else default_cache_dir()
        self.arrow = cache / f"{path.stem}-{file_hash(path)}.arrow"
        self.wrote = False  # whether this process wrote the copy
        if not self.arrow.is_file():
            self._convert(cache)
        try:
            reader = pa.ipc.open_file(pa.memory_map(str(self.arrow)))
            self.batches = [reader.get_batch(b) for b in range(reader.num_record_batches)]  # views of the map
            rows = [b.num_rows for b in self.batches]
        except Exception as e:  # noqa: BLE001 - a damaged copy: say which file to delete
            raise DataError(f"{self.arrow}: the Arrow copy of {path} cannot be read ({e}); delete it and start again "
                            f"(it is written anew)") from None
        self.starts = np.concatenate([[0], np.cumsum(rows, dtype=np.int64)])

    def _convert(self, cache: Path) -> None:
        import fcntl

        try:
            cache.mkdir(parents=True, exist_ok=True)
            lock = open(self.arrow.with_suffix(".lock"), "w")
        except OSError as e:
            raise DataError(f"data.cache_dir: cannot write the Arrow copy of {self.path} in {cache} ({e}); set "
                            f"data.cache_dir to a writable directory") from None
        with lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # the node's other ranks wait here, then find the copy made
            if self.arrow.is_file():
                return
            for stale in cache.glob(f".{self.arrow.name}.*"):  # a writer that died (its lock went with it)
                stale.unlink(missing_ok=True)
            tmp = self.arrow.with_name(f".{self.arrow.name}.{os.getpid()}")
            try:
                self._write(tmp)
                os.replace(tmp, self.arrow)
            finally:
                tmp.unlink(missing_ok=True)
                import pyarrow as pa

                pa.default_memory_pool().release_unused()  # the row groups' buffers, kept by the pool otherwise
            self.wrote = True

    def _write(self, tmp: Path) -> None:
        """The Arrow copy into `tmp`: a DataError naming the parquet file for what cannot be read from it, naming
        `tmp` for what cannot be written."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            pf = pq.ParquetFile(self.path)
            schema = _plain_schema(pf.schema_arrow)
            batches = pf.iter_batches(batch_size=_ARROW_BATCH_ROWS)
        except Exception as e:  # noqa: BLE001 - pyarrow raises several types for a bad file
            raise DataError(f"{self.path}: not a readable parquet file ({e})") from None
        sink = None
        try:
            sink = pa.OSFile(str(tmp), "wb")
            writer = pa.ipc.new_file(sink, schema)
        except Exception as e:  # noqa: BLE001
            if sink is not None:
                sink.close()
            raise DataError(f"data.cache_dir: cannot write {tmp} ({e}); set data.cache_dir to a writable directory "
                            f"with room for an uncompressed copy of {self.path}") from None
        with sink, writer:
            while True:
                try:
                    batch = next(batches, None)
                    if batch is None:
                        break
                    batch = pa.Table.from_batches([batch]).cast(schema)
                except Exception as e:  # noqa: BLE001
                    raise DataError(f"{self.path}: not a readable parquet file ({e})") from None
                try:
                    writer.write_table(batch)
                except Exception as e:  # noqa: BLE001 - a full disk, most likely
                    raise DataError(f"data.cache_dir: cannot write {tmp} ({e}); free space there or set "
                                    f"data.cache_dir to a directory with room for an uncompressed copy of "
                                    f"{self.path}") from None

    def __len__(self) -> int:
        return int(self.starts[-1])

    @property
    def nbytes(self) -> int:
        return self.starts.nbytes

    def row(self, i: int) -> Any:
        b = int(np.searchsorted(self.starts, i, side="right")) - 1
        try:
            return self.batches[b].slice(i - int(self.starts[b]), 1).to_pylist()[0]
        except UnicodeDecodeError as e:
            raise DataError(f"{self.path}:{i + 1}: a string column is not UTF-8 ({e.reason}); rewrite the file with "
                            f"its strings as UTF-8") from None


def _plain_schema(schema):
    """`schema` with dictionary-encoded columns as their values (an IPC file cannot change dictionaries between
    batches; each row group brings its own)."""
    import pyarrow as pa

    return pa.schema([pa.field(f.name, f.type.value_type if pa.types.is_dictionary(f.type) else f.type, f.nullable)
                      for f in schema])


def _row_source(path: Path, cache_dir: Optional[Path]):
    if not path.is_file():
        raise DataError(f"{path}: no such data file")
    if path.suffix == ".jsonl":
        return _JsonlRows(path)
    if path.suffix == ".parquet":
        return _ParquetRows(path, cache_dir)
    raise DataError(f"{path}: unknown data format {path.suffix!r}; expected .jsonl or .parquet")


def _check(row: Any, where: str) -> tuple[list[dict], Any]:
    if not isinstance(row, dict):
        raise DataError(f"{where}: expected an object with 'prompt' and 'reward_model', got {type(row).__name__}")
    if "prompt" not in row:
        raise DataError(f"{where}: missing column 'prompt' (chat messages: [{{'role': 'user', 'content': ...}}])")
    msgs = row["prompt"]
    if isinstance(msgs, str) or not isinstance(msgs, list) or not msgs or not all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in msgs
    ):
        raise DataError(f"{where}: 'prompt' must be a non-empty list of {{'role': str, 'content': str}} messages")
    rm = row.get("reward_model")
    if not isinstance(rm, dict) or "ground_truth" not in rm:
        raise DataError(f"{where}: missing column 'reward_model.ground_truth'")
    if rm["ground_truth"] is None:
        raise DataError(f"{where}: 'reward_model.ground_truth' is null; give the answer the reward checks against, "
                        f"or drop the row")
    extra = row.get("extra_info")
    if extra is not None and not isinstance(extra, dict):
        raise DataError(f"{where}: 'extra_info' must be an object ({{\"key\": value, ...}}) or absent, got "
                        f"{type(extra).__name__} {str(extra)[:40]!r}; wrap it, e.g. {{\"note\": ...}}, or drop it")
    return msgs, rm["ground_truth"]


def _chars_per_token(tokenizer) -> int | None:
    """An upper bound on the characters one token covers: its longest vocabulary entry (a byte-level entry
    spells each byte as one character; a text character is at least one byte), times 4 for a normaliser that
    merges characters (NFKC composes at most a few into one). None where the tokenizer lists no vocabulary."""
    try:
        return 4 * max(len(t) for t in tokenizer.get_vocab())
    except Exception:  # noqa: BLE001 - a tokenizer without get_vocab: tokenise every prompt
        return None


def row_tools(row: dict, where: str, tools: dict[str, dict]) -> tuple[list[dict], dict]:
    """(the schemas the row offers, its tools_kwargs) against the run's tools {name: schema}."""
    extra = row.get("extra_info") or {}
    kwargs = extra.get("tools_kwargs") or {}
    if not isinstance(kwargs, dict) or not all(isinstance(v, dict) or v is None for v in kwargs.values()):
        raise DataError(f"{where}: 'extra_info.tools_kwargs' must map tool names to objects "
                        f"({{\"calculator\": {{\"create_kwargs\": {{...}}}}}}), got {str(kwargs)[:60]!r}")
    unknown = [n for n in kwargs if n not in tools]
    if unknown:
        raise DataError(f"{where}: extra_info.tools_kwargs names tool {unknown[0]!r}, which is not in "
                        f"rollout.multi_turn.tools ({', '.join(tools)}); add it there or drop it from the row")
    if extra.get("need_tools_kwargs") and not kwargs:
        raise DataError(f"{where}: extra_info.need_tools_kwargs is true but extra_info.tools_kwargs is empty; "
                        f"give the row's tools_kwargs or set need_tools_kwargs to false")
    for name, kw in kwargs.items():
        for k in ("create_kwargs", "execute_kwargs"):
            if kw and kw.get(k) is not None and not isinstance(kw[k], dict):
                raise DataError(f"{where}: extra_info.tools_kwargs.{name}.{k} must be an object, got "
                                f"{type(kw[k]).__name__}")
    names = list(kwargs) or list(tools)
    return [tools[n] for n in names], {n: dict(kw or {}) for n, kw in kwargs.items()}


class PromptFile:
    """The prompts of one .jsonl or .parquet file by row number (blank lines included), each read, checked,
    rendered and tokenised when asked for (`example`). `tools` ({name: schema}, rollout.multi_turn on): each prompt
    is rendered with the schemas its row offers as the chat template's `tools=`, its tools_kwargs checked against
    them (kept in extra_info). `cache_dir`: where a parquet file's Arrow copy goes (default_cache_dir())."""

    def __init__(self, path: str, tokenizer, max_prompt_length: int, tools: Optional[dict[str, dict]] = None,
                 cache_dir: Optional[str] = None):
        self.path, self.tokenizer, self.max_prompt_length, self.tools = Path(path), tokenizer, max_prompt_length, tools
        self.rows = _row_source(self.path, Path(cache_dir) if cache_dir else None)
        self.per_token = _chars_per_token(tokenizer)
        self.too_long = 0  # prompts found longer than max_prompt_length in this process

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def index_bytes(self) -> int:
        return self.rows.nbytes

    def example(self, i: int) -> Optional[PromptExample]:
        """Row i as a PromptExample; None for a blank line or a prompt longer than max_prompt_length (counted in
        `too_long`). A DataError naming the file and line for a malformed row."""
        return self.examples([i])[0]

    def examples(self, rows: Sequence[int]) -> list[Optional[PromptExample]]:
        """example(i) for each of `rows`, in order (a malformed row raises when its turn comes, before any row after
        it is read); the prompts rendered and tokenised in one call of the tokenizer where the rows offer no tools."""
        todo = [self._rendered(i) for i in rows]  # (i, row, msgs, truth, kw) or None
        ids = {}
        batch = [t for t in todo if t is not None and not t[4]]
        if len(batch) > 1:
            try:
                out = self.tokenizer.apply_chat_template([t[2] for t in batch], add_generation_prompt=True, tokenize=True)
                out = out["input_ids"] if hasattr(out, "keys") else out
                ids = {t[0]: out[k] for k, t in enumerate(batch)}
            except Exception:  # noqa: BLE001 - template errors come in many types: found row by row below
                ids = {}
        return [None if t is None else self._example(t, ids.get(t[0])) for t in todo]

    def _rendered(self, i: int):
        """Row i read and checked: None (a blank line, or more text than max_prompt_length tokens can spell: not
        tokenised), else (i, row, messages, ground truth, the template's keyword arguments)."""
        row = self.rows.row(i)
        if row is None:
            return None
        where = f"{self.path}:{i + 1}"
        msgs, truth = _check(row, where)
        kw = {}
        if self.tools is not None:
            kw = {"tools": row_tools(row, where, self.tools)[0]}
        limit, per_token = self.max_prompt_length, self.per_token
        if per_token and sum(len(m["content"]) for m in msgs) > per_token * limit:
            try:
                text = self.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False, **kw)
            except Exception as e:  # noqa: BLE001 - template errors come in many types
                raise DataError(f"{where}: the tokenizer's chat template failed on this prompt ({e})") from None
            if len(text) > per_token * limit:  # (rendered: a template may leave a message out)
                return self._too_long(where, None)  # more text than max_prompt_length tokens can spell
        return i, row, msgs, truth, kw

    def _example(self, todo, ids) -> Optional[PromptExample]:
        i, row, msgs, truth, kw = todo
        where = f"{self.path}:{i + 1}"
        if ids is None:
            try:
                ids = self.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, **kw)
            except Exception as e:  # noqa: BLE001 - template errors come in many types
                raise DataError(f"{where}: the tokenizer's chat template failed on this prompt ({e})") from None
            if hasattr(ids, "keys"):
                ids = ids["input_ids"]
        if len(ids) > self.max_prompt_length:
            return self._too_long(where, len(ids))
        return PromptExample(prompt_ids=list(ids), ground_truth=truth, data_source=str(row.get("data_source", "")),
                             extra_info=dict(row.get("extra_info") or {}), index=i)

    def _too_long(self, where: str, tokens: Optional[int]) -> None:
        self.too_long += 1
        if self.too_long == 1:
            size = f"{tokens} tokens" if tokens is not None else "more text than that many tokens can spell"
            log.warning("%s: a prompt longer than batch.max_prompt_length=%d (%s) is skipped; so are the others, "
                        "counted per epoch", where, self.max_prompt_length, size)
        return None

    def check_head(self, rows: int = HEAD_ROWS) -> tuple[int, int, int]:
        """Check the first `rows` rows now: (rows checked, prompts that fit, prompts too long). A DataError for a
        malformed one; when they are the whole file, also for a file without prompts or without one that fits."""
        n = min(rows, len(self))
        before = self.too_long
        fit = sum(e is not None for start in range(0, n, 512) for e in self.examples(range(start, min(n, start + 512))))
        dropped = self.too_long - before
        if n == len(self):
            if fit + dropped == 0:
                raise DataError(f"{self.path}: no rows; expected prompts in verl's schema")
            if fit == 0:
                raise DataError(f"{self.path}: all {dropped} prompts are longer than batch.max_prompt_length="
                                f"{self.max_prompt_length} tokens")
        return n, fit, dropped

    def nothing_fits(self) -> DataError:
        return DataError(f"{self.path}: none of its {len(self)} rows is a prompt of at most batch.max_prompt_length="
                         f"{self.max_prompt_length} tokens")

    def sample(self, k: int, seed: int) -> list[PromptExample]:
        """Up to `k` prompts that fit, drawn with `seed` from the whole file (a fixed sample: validation without
        data.val_files), in file order; all of them when the file has no more."""
        n = len(self)
        candidates = random.Random(seed).sample(range(n), min(n, max(4 * k, HEAD_ROWS)))
        out, at = [], 0
        while len(out) < k and at < len(candidates):  # the first k that fit, read k - len(out) at a time
            chunk = candidates[at:at + k - len(out)]
            at += len(chunk)
            out += [e for e in self.examples(chunk) if e is not None]
        return sorted(out, key=lambda e: e.index)


def load_prompts(path: str, tokenizer, max_prompt_length: int, tools: Optional[dict[str, dict]] = None,
                 cache_dir: Optional[str] = None) -> tuple[list[PromptExample], int]:
    """Every prompt of a (small) file at once, e.g. the validation file: (examples, number dropped for being
    longer than max_prompt_length). Raises DataError on bad input. A training file is drawn from a PromptFile."""
    f = PromptFile(path, tokenizer, max_prompt_length, tools, cache_dir)
    out = [e for e in (f.example(i) for i in range(len(f))) if e is not None]
    if not out and not f.too_long:
        raise DataError(f"{path}: no rows; expected prompts in verl's schema")
    if not out:
        raise DataError(f"{path}: all {f.too_long} prompts are longer than batch.max_prompt_length={max_prompt_length} "
                        f"tokens")
    return out, f.too_long


class _InMemory:
    """A list of PromptExamples as a PromptStream's source."""

    def __init__(self, examples: Sequence[PromptExample]):
        self.items = examples

    def __len__(self) -> int:
        return len(self.items)

    def examples(self, rows: Sequence[int]) -> list[PromptExample]:
        return [self.items[i] for i in rows]

    def nothing_fits(self) -> DataError:
        return DataError("no prompts")


class PromptStream:
    """Shuffled batches of prompts, epoch after epoch, reproducible from a seed and a cursor: epoch e is one
    permutation of the source's rows (numpy's PCG64 seeded with (seed, e), made once per epoch: 4 bytes a row),
    the cursor counts the rows drawn, prompts skipped (too long, blank lines) included, so that a resume draws the
    same prompts. `source`: a PromptFile, or a list of PromptExamples.
    Its state (get_state, what a checkpoint keeps) is {"cursor": rows drawn, "rows": the source's row count}."""

    def __init__(self, source, seed: int):
        self.source = source if hasattr(source, "examples") else _InMemory(source)
        self.seed, self.cursor = seed, 0
        self._epoch, self._perm = -1, None
        self.skipped_this_epoch = 0
        self.permutations = 0  # made in this process (one per epoch drawn from)
        self._order(0)  # at start-up, not in the first draw (10M rows: a 40 MB permutation, about half a second)

    def _order(self, epoch: int) -> np.ndarray:
        if epoch != self._epoch:
            n = len(self.source)
            perm = np.random.default_rng([self.seed % (1 << 63), epoch]).permutation(n)
            self._perm, self._epoch = perm.astype(np.int32 if n < (1 << 31) else np.int64), epoch
            self.permutations += 1
        return self._perm

    def get_state(self) -> dict:
        return {"cursor": self.cursor, "rows": len(self.source)}

    def set_state(self, state) -> None:
        """A checkpoint's get_state(). The same file resumes exactly; a file with another row count since (or a
        checkpoint from before the per-epoch permutation: a bare count of prompts drawn) resumes at the same count
        of rows drawn, in another order, with a warning."""
        rows = len(self.source)
        if isinstance(state, dict):
            self.cursor, saved = int(state["cursor"]), int(state.get("rows", rows))
            if saved != rows:
                log.warning("the training data has %d rows, the checkpoint's had %d: the run goes on after %d rows "
                            "drawn, but not in the order it would have had", rows, saved, self.cursor)
        else:
            self.cursor = int(state)
            log.warning("the checkpoint's data cursor (%d prompts drawn) is from before the per-epoch permutation of "
                        "rows: the run goes on after as many rows, in another order than it would have had",
                        self.cursor)
        self.skipped_this_epoch = 0
        if rows:
            self._order(self.cursor // rows)  # the resumed epoch's, at start-up too

    def next_batch(self, size: int) -> list[PromptExample]:
        out, n, misses = [], len(self.source), 0
        if n == 0:
            raise self.source.nothing_fits()
        while len(out) < size:  # the rows still needed, read and tokenised together; again for those skipped
            rows = []
            for k in range(size - len(out)):
                epoch, pos = divmod(self.cursor + k, n)
                rows.append(int(self._order(epoch)[pos]))
            for example in self.source.examples(rows):
                epoch = self.cursor // n
                self.cursor += 1
                if example is None:
                    misses += 1
                    self.skipped_this_epoch += 1
                    if misses >= n:  # a whole epoch's worth of rows in a row, none usable
                        raise self.source.nothing_fits()
                else:
                    misses = 0
                    out.append(example)
                if self.cursor % n == 0 and self.skipped_this_epoch:
                    log.info("epoch %d: %d of %d rows skipped (prompts longer than batch.max_prompt_length, blank "
                             "lines; counted since this process started the epoch)", epoch, self.skipped_this_epoch, n)
                    self.skipped_this_epoch = 0
        return out
