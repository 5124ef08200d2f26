"""Continuous batching for the stand-in server: one decode loop over every response in flight, whatever request it
came in, as SGLang's scheduler runs it.

A request's rows join the batch at the loop's next step (their input less its last token taken from the prefix cache,
else prefilled together; the batch's key/value cache left-padded to the widest row), feed their last input token in
the same forward as the active rows' last sampled tokens, and leave as soon as they end (a stop token, their budget,
or an abort): a row never idles while another request's longest row runs on, and a new request never waits for the
one before it. Sampling is EmbeddedEngine.generate's, row by row: the row's own seeded uniforms drawn up front,
inverse-CDF sampling of softmax(logits / temperature) after the row's top-p filter, the logprob at the sampled
token; a row's tokens do not depend on the others in the batch (up to float rounding of a wider padded batch).

`hold(reason)` keeps new rows out (the active ones run on) until every reason is released; `idle()` waits until no
row is active, so that weights are loaded between two steps and never under a row. A pending request held longer than
`timeout_s` fails with the reason. A row that ends by its budget or an abort leaves its keys and values in the prefix
cache for the request that continues it (rollout.mode=async's next segment).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Optional

import torch

from grpo_mega.engines.embedded import EmbeddedEngine, sample_rows


@dataclass
class Row:
    ids: list[int]
    """The input: prompt and response so far (token ids, at least one)."""
    budget: int
    seed: int
    temperature: float = 1.0
    top_p: float = 1.0
    stop: frozenset = frozenset()
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish: Optional[str] = None
    weight_version: int = 0
    job: Optional["Job"] = None
    uniforms: Optional[list[float]] = None
    fed: int = 0
    """Tokens in the cache for this row (its next position)."""


@dataclass
class Job:
    rows: list[Row]
    submitted: float
    left: int = 0
    error: Optional[str] = None
    event: threading.Event = field(default_factory=threading.Event)


class ContinuousBatcher:
    """Runs `engine`'s decode on a thread of its own; `run(rows)` blocks until all of a request's rows have ended."""

    def __init__(self, engine: EmbeddedEngine, timeout_s: float = 120.0):
        if engine.decode_mode() != "dynamic":
            raise ValueError(f"continuous batching needs the dynamic decode; the engine runs {engine.decode_mode()}")
        self.engine, self.timeout_s = engine, timeout_s
        self.cond = threading.Condition()
        self.pending: list[Job] = []
        self.active: list[Row] = []
        self.holds: set[str] = set()
        self.stepping = False
        self.closing = False
        self.cache = None  # DynamicCache of the active rows, right-aligned: row r's last `fed` columns are its
        self.mask: Optional[torch.Tensor] = None  # [rows, width] 1 where a row has a token
        self.steps = 0
        self.thread = threading.Thread(target=self._loop, name="continuous-batcher", daemon=True)
        self.thread.start()

    # ---- the request side ---------------------------------------------------------------------

    def run(self, rows: list[Row]) -> list[Row]:
        for r in rows:
            if not r.ids or r.budget < 1 or r.temperature < 0 or not 0 < r.top_p <= 1:
                raise ValueError(f"a row needs >= 1 input token, max_new_tokens >= 1, temperature >= 0 and top_p in "
                                 f"(0, 1]; got {len(r.ids)} tokens, {r.budget}, {r.temperature}, {r.top_p}")
        job = Job(rows, time.monotonic(), len(rows))
        for r in rows:
            r.job = job
            r.uniforms = torch.rand(r.budget, generator=torch.Generator().manual_seed(r.seed),
                                    dtype=torch.float64).tolist()
        with self.cond:
            if self.closing:
                raise RuntimeError("the server is shutting down")
            self.pending.append(job)
            self.cond.notify_all()
        job.event.wait()
        if job.error is not None:
            raise RuntimeError(job.error)
        return rows

    def hold(self, reason: str) -> None:
        with self.cond:
            self.holds.add(reason)

    def release(self, reason: str) -> None:
        with self.cond:
            self.holds.discard(reason)
            self.cond.notify_all()

    def idle(self, timeout: float) -> bool:
        """Wait until no row is active and no step runs (hold first, or new rows may join meanwhile)."""
        with self.cond:
            return self.cond.wait_for(lambda: not self.active and not self.stepping, timeout=timeout)

    def close(self) -> None:
        with self.cond:
            self.closing = True
            self.cond.notify_all()
        self.thread.join(timeout=30)

    # ---- the loop -----------------------------------------------------------------------------

    def _fail(self, jobs, message: str) -> None:
        for job in jobs:
            if not job.event.is_set():
                job.error = message
                job.event.set()

    def _loop(self) -> None:
        while True:
            with self.cond:
                while not self.closing and not self.active and (self.holds or not self.pending):
                    now = time.monotonic()
                    late = [j for j in self.pending if now - j.submitted > self.timeout_s]
                    if late:
                        self.pending = [j for j in self.pending if j not in late]
                        self._fail(late, f"held by {', '.join(sorted(self.holds))} for over {self.timeout_s:.0f} s "
                                         "(a weight update or a pause began and did not end)")
                    self.cond.wait(timeout=0.5)
                if self.closing:
                    self._fail(self.pending + [r.job for r in self.active], "the server is shutting down")
                    return
                joining = [] if self.holds else [r for j in self.pending for r in j.rows]
                if not self.holds:
                    self.pending = []
                self.stepping = True
            try:
                self._step(joining)
            except Exception as e:  # noqa: BLE001 - every request in the step gets the error
                self._fail({id(r.job): r.job for r in self.active + joining}.values(),
                           f"generation failed: {type(e).__name__}: {e}")
                self.active, self.cache, self.mask = [], None, None
            finally:
                with self.cond:
                    self.stepping = False
                    self.cond.notify_all()

    @torch.no_grad()
    def _prefix(self, rows: list[Row]) -> list[Optional[list]]:
        """Each joining row's keys and values of its input less the last token ([heads, tokens, dim] per layer; None
        for a one-token input): from the prefix cache, the others prefilled together."""
        engine, dev = self.engine, self.engine.device
        cache = engine.prefix_cache
        kvs = [cache.take(r.ids[:-1]) if cache is not None and len(r.ids) > 1 else None for r in rows]
        fresh = [i for i, r in enumerate(rows) if kvs[i] is None and len(r.ids) > 1]
        if fresh:
            from transformers import DynamicCache

            width = max(len(rows[i].ids) - 1 for i in fresh)
            ids = torch.zeros(len(fresh), width, dtype=torch.long)
            mask = torch.zeros(len(fresh), width, dtype=torch.long)
            for k, i in enumerate(fresh):
                n = len(rows[i].ids) - 1
                ids[k, width - n:], mask[k, width - n:] = torch.tensor(rows[i].ids[:-1]), 1
            pre = DynamicCache()
            engine.model(input_ids=ids.to(dev), attention_mask=mask.to(dev), past_key_values=pre, use_cache=True,
                         position_ids=(mask.cumsum(-1) - 1).clamp(min=0).to(dev))
            for k, i in enumerate(fresh):
                n = len(rows[i].ids) - 1
                kvs[i] = [(layer.keys[k, :, width - n:], layer.values[k, :, width - n:]) for layer in pre.layers]
        return kvs

    def _join(self, rows: list[Row]) -> None:
        """The joining rows into the batch's cache (all left-padded to the widest); their last input token is fed
        next."""
        from transformers import DynamicCache

        kvs = self._prefix(rows)
        for r in rows:
            r.fed = len(r.ids) - 1
        old = len(self.active)
        width = max([r.fed for r in self.active + rows] + [0])
        if width == 0:  # nothing held yet (one-token inputs): the first forward fills the cache
            self.cache, self.mask = DynamicCache(), torch.zeros(old + len(rows), 0, dtype=torch.long)
            return
        held = [kv for kv in kvs if kv is not None]
        proto = held[0] if held else [(layer.keys[0], layer.values[0]) for layer in self.cache.layers]
        dev = self.engine.device
        cache = DynamicCache()
        for li, (k0, v0) in enumerate(proto):
            keys = torch.zeros(old + len(rows), k0.shape[0], width, k0.shape[-1], dtype=k0.dtype, device=dev)
            values = torch.zeros_like(keys)
            if old:
                w = self.cache.layers[li].keys.shape[2]
                keys[:old, :, width - w:] = self.cache.layers[li].keys
                values[:old, :, width - w:] = self.cache.layers[li].values
            for i, r in enumerate(rows):
                if r.fed:
                    keys[old + i, :, width - r.fed:], values[old + i, :, width - r.fed:] = kvs[i][li]
            cache.update(keys, values, li)
        mask = torch.zeros(old + len(rows), width, dtype=torch.long)
        for i, r in enumerate(self.active + rows):
            mask[i, width - r.fed:] = 1
        self.cache, self.mask = cache, mask

    @torch.no_grad()
    def _step(self, joining: list[Row]) -> None:
        engine = self.engine
        if joining:
            self._join(joining)
        rows = self.active + joining
        if not rows:
            return
        last = [r.tokens[-1] if r.tokens else r.ids[-1] for r in rows]
        self.mask = torch.cat([self.mask, torch.ones(len(rows), 1, dtype=torch.long)], dim=1)
        dev = engine.device
        logits = engine._decode_step("dynamic")(torch.tensor(last, device=dev)[:, None], self.mask.to(dev),
                                                torch.tensor([[r.fed] for r in rows], device=dev), self.cache)
        self.steps += 1
        temps = torch.tensor([r.temperature if r.temperature > 0 else 1.0 for r in rows], dtype=logits.dtype,
                             device=dev)
        logp_all = torch.log_softmax(logits / temps[:, None], dim=-1)
        tok = logits.argmax(-1)
        sampled = [i for i, r in enumerate(rows) if r.temperature > 0]
        if sampled:
            every = len(sampled) == len(rows)
            u = torch.tensor([rows[i].uniforms[len(rows[i].tokens)] for i in sampled], dtype=torch.float64, device=dev)
            pick = sample_rows(logp_all if every else logp_all[sampled], [rows[i].top_p for i in sampled], u)
            if every:
                tok = pick
            else:
                tok[sampled] = pick
        lp = logp_all.gather(1, tok[:, None])[:, 0]
        aborting = engine.aborting.is_set()
        keep = []
        for i, (r, t, l) in enumerate(zip(rows, tok.tolist(), lp.tolist())):
            r.fed += 1
            r.tokens.append(t)
            r.logprobs.append(l)
            if t in r.stop:
                r.finish = "stop"
            elif len(r.tokens) >= r.budget:
                r.finish = "length"
            elif aborting:
                r.finish = "abort"
            else:
                keep.append(i)
        ended = [i for i in range(len(rows)) if rows[i].finish is not None]
        for i in ended:
            self._leave(rows[i], i)
        self.active = [rows[i] for i in keep]
        if not keep:
            self.cache = self.mask = None
            return
        width = max(r.fed for r in self.active)
        index = torch.tensor(keep, device=dev)
        for layer in self.cache.layers:  # the rows that ended leave; columns no row uses any more go too
            layer.keys = layer.keys.index_select(0, index)[:, :, -width:]
            layer.values = layer.values.index_select(0, index)[:, :, -width:]
        self.mask = self.mask[keep][:, -width:]

    def _leave(self, r: Row, i: int) -> None:
        """Row `r` (batch index i) ended: a row cut by its budget or an abort leaves its keys and values (of its
        input and tokens but the last, never fed) for the request that continues it; its request is told when its
        last row ends."""
        cache = self.engine.prefix_cache
        if cache is not None and r.finish in ("length", "abort"):
            cache.put(r.ids + r.tokens[:-1], [(layer.keys[i, :, -r.fed:].clone(), layer.values[i, :, -r.fed:].clone())
                                              for layer in self.cache.layers])
        r.weight_version = self.engine.weight_version
        r.uniforms = None
        job = r.job
        job.left -= 1
        if job.left == 0:
            job.event.set()
