"""The step's responses as padded tensors, and how they are cut into DP shares and micro-batches: padded
(`micro_batches`: fixed numbers of rows, each trimmed to the longest) or packed (`plan_packing`: sequences
balanced over DP ranks by tokens, then packed back to back into rows of at most a token budget).

Everything is in position space: row i holds prompt_i + response_i right-padded to L, and per-token
quantities (logprobs, masks) sit at the position of the logits that predict the token. Response token t of
row i is predicted by the logits at position prompt_len_i + t - 1 (docs/design.md, "Tokens, masks and
logprobs"), so the response mask is 1
exactly on positions [P_i - 1, P_i - 1 + R_i): built from lengths, never from a pad id.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional, Sequence

import torch


@dataclass
class RolloutBatch:
    """All of a step's responses, group-contiguous (rows [g*n, (g+1)*n) answer prompt g), on every rank."""

    tokens: torch.Tensor  # [N, L] int64, prompt + response, right-padded with 0
    prompt_lens: torch.Tensor  # [N] int64
    response_lens: torch.Tensor  # [N] int64
    advantages: Optional[torch.Tensor] = None  # [N] float32, one per response
    old_logp: Optional[torch.Tensor] = None  # [N, L] float32, position-aligned
    ref_logp: Optional[torch.Tensor] = None  # [N, L] float32, position-aligned
    engine_logp: Optional[torch.Tensor] = None  # [N, L] float32, position-aligned: the rollout engine's logprobs
    in_loss: Optional[torch.Tensor] = None  # [N] bool: rows that count in the loss (overlong=mask, dynamic sampling)
    is_batch_mean: Optional[float] = None
    """algo.rollout_is_batch_norm: the rollout correction's mean weight over the whole batch (all ranks' rows),
    which the update divides every weight by (grpo_mega.algo.correction.batch_mean)."""
    model_mask: Optional[torch.Tensor] = None
    """[N, L] bool, position-aligned: False where the predicted response token is not the model's (a tool result
    or chat-template glue of a multi-turn rollout, grpo_mega.rollout.multi_turn); None: every response token is."""
    routed: Optional[list] = None
    """Rollout routing replay: per row, the engine's top-k experts int16 [n_i, M, k] for the row's first n_i
    input tokens (Generation.routed_experts: prompt and response but the last token), or None (not held on this
    rank); None: not recorded. The micro-batches carry them as `routes` (grpo_mega.models.routing_replay)."""

    @classmethod
    def from_samples(cls, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]],
                     model_masks: Optional[Sequence[Sequence[int]]] = None,
                     routed: Optional[list] = None) -> "RolloutBatch":
        """`model_masks`: per response token, 1 where the model sampled it (Generation.model_mask), or None;
        `routed`: Generation.routed_experts."""
        if len(prompts) != len(responses):
            raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses")
        for i, (p, r) in enumerate(zip(prompts, responses)):
            if len(p) < 1:
                raise ValueError(f"sample {i}: empty prompt (at least one token is needed to predict from)")
        lengths = [len(p) + len(r) for p, r in zip(prompts, responses)]
        tokens = torch.zeros(len(prompts), max(lengths), dtype=torch.long)
        for i, (p, r) in enumerate(zip(prompts, responses)):
            tokens[i, : lengths[i]] = torch.tensor(list(p) + list(r), dtype=torch.long)
        model_mask = None
        if model_masks is not None:
            model_mask = torch.ones(tokens.shape, dtype=torch.bool)
            for i, (p, r, m) in enumerate(zip(prompts, responses, model_masks)):
                if len(m) != len(r):
                    raise ValueError(f"sample {i}: a model mask of {len(m)} for a response of {len(r)} tokens")
                start = len(p) - 1  # the logits at position P-1+t predict response token t
                model_mask[i, start:start + len(r)] = torch.tensor(list(m), dtype=torch.bool)
        return cls(
            tokens=tokens,
            prompt_lens=torch.tensor([len(p) for p in prompts], dtype=torch.long),
            response_lens=torch.tensor([len(r) for r in responses], dtype=torch.long),
            model_mask=model_mask, routed=None if routed is None else list(routed),
        )

    @property
    def size(self) -> int:
        return self.tokens.shape[0]

    def check_vocab(self, vocab_size: int) -> None:
        """A ValueError naming the row, the position and the id of a token outside [0, vocab_size), prompt or
        response: refused, never masked. At TP > 1 megatron's VocabParallelEmbedding turns an input id that no shard
        holds into a zero embedding instead of failing, and the loss's target check (parallel/vocab_parallel.py)
        sees only the labels of the positions it scores (never a prompt's first token; with
        batch.response_only_logits, no prompt token at all)."""
        bad = (self.tokens < 0) | (self.tokens >= vocab_size)
        if bool(bad.any()):
            row, pos = (int(x) for x in bad.nonzero()[0])
            where = "prompt" if pos < int(self.prompt_lens[row]) else "response"
            raise ValueError(f"sample {row}: token id {int(self.tokens[row, pos])} at position {pos} (its {where}) is "
                             f"outside the model's vocabulary [0, {vocab_size})")

    def labels(self) -> torch.Tensor:
        """[N, L]: the token each position's logits predict (the last position predicts nothing: 0)."""
        out = torch.zeros_like(self.tokens)
        out[:, :-1] = self.tokens[:, 1:]
        return out

    def response_mask(self) -> torch.Tensor:
        """[N, L] bool: positions whose logits predict a response token the model sampled (EOS/stop included;
        a multi-turn rollout's tool results and template glue excluded, `model_mask`)."""
        pos = torch.arange(self.tokens.shape[1]).unsqueeze(0)
        start = (self.prompt_lens - 1).unsqueeze(1)
        m = (pos >= start) & (pos < start + self.response_lens.unsqueeze(1))
        return m if self.model_mask is None else m & self.model_mask

    def loss_mask(self) -> torch.Tensor:
        """[N, L] bool: the response mask, less the rows excluded from the loss (`in_loss`)."""
        m = self.response_mask()
        return m if self.in_loss is None else m & self.in_loss.bool().unsqueeze(1)

    def rows(self, lo: int, hi: int) -> "RolloutBatch":
        """Rows [lo, hi), every tensor sliced alike."""
        f = lambda t: None if t is None else t[lo:hi]  # noqa: E731
        return replace(
            self, tokens=self.tokens[lo:hi], prompt_lens=self.prompt_lens[lo:hi], response_lens=self.response_lens[lo:hi],
            advantages=f(self.advantages), old_logp=f(self.old_logp), ref_logp=f(self.ref_logp), in_loss=f(self.in_loss),
            engine_logp=f(self.engine_logp), model_mask=f(self.model_mask),
            routed=None if self.routed is None else self.routed[lo:hi],
        )

    def rows_at(self, index: torch.Tensor) -> "RolloutBatch":
        """The rows `index` ([n] int64, any order), every tensor indexed alike."""
        f = lambda t: None if t is None else t[index]  # noqa: E731
        return replace(
            self, tokens=self.tokens[index], prompt_lens=self.prompt_lens[index],
            response_lens=self.response_lens[index], advantages=f(self.advantages), old_logp=f(self.old_logp),
            ref_logp=f(self.ref_logp), in_loss=f(self.in_loss), engine_logp=f(self.engine_logp),
            model_mask=f(self.model_mask),
            routed=None if self.routed is None else [self.routed[i] for i in index.tolist()],
        )


def micro_batches(batch: RolloutBatch, micro_batch_size: int, pad_multiple: int = 1,
                  longest: Optional[int] = None) -> tuple[list[dict], int]:
    """Cut `batch` into micro-batch dicts for Megatron's schedule, all trimmed to one length L' (the longest
    row, or `longest` when given, rounded up to `pad_multiple`: sequence parallelism needs L' divisible by
    tp). Returns (dicts, L')."""
    if batch.size % micro_batch_size:
        raise ValueError(f"{batch.size} responses do not split into micro-batches of {micro_batch_size}")
    used = longest or int((batch.prompt_lens + batch.response_lens).max())
    length = -(-used // pad_multiple) * pad_multiple
    length = max(length, pad_multiple)

    def fit(t: torch.Tensor, fill=0) -> torch.Tensor:
        if t.shape[1] >= length:
            return t[:, :length]
        pad = torch.full((t.shape[0], length - t.shape[1]), fill, dtype=t.dtype)
        return torch.cat([t, pad], dim=1)

    tokens, labels, mask = fit(batch.tokens), fit(batch.labels()), fit(batch.loss_mask())
    out = []
    for lo in range(0, batch.size, micro_batch_size):
        sl = slice(lo, lo + micro_batch_size)
        b = micro_batch_size
        mb = dict(
            rows=torch.arange(lo, lo + b),
            tokens=tokens[sl].contiguous(),
            position_ids=torch.arange(length).expand(b, length).contiguous(),
            labels=labels[sl].contiguous(),
            mask=mask[sl].contiguous(),
        )
        if batch.advantages is not None:
            mb["advantages"] = batch.advantages[sl].float()
        if batch.old_logp is not None:
            mb["old_logp"] = fit(batch.old_logp[sl].float())
        if batch.ref_logp is not None:
            mb["ref_logp"] = fit(batch.ref_logp[sl].float())
        if batch.engine_logp is not None:
            mb["engine_logp"] = fit(batch.engine_logp[sl].float())
        if batch.routed is not None:
            mb["routes"] = batch_routes(batch, list(range(lo, lo + b)), length, packed=False)
        out.append(mb)
    return out, length


# ---- packing: sequences balanced over DP ranks, packed into rows of at most a token budget -------------


@dataclass
class PackPlan:
    """Which sequences each DP rank runs, in which packed row (micro-batch), and the rows' lengths.

    `rows[r][m]` lists the batch indices of the sequences in micro-batch m of DP rank r (empty lists pad every
    rank to the same number of micro-batches, as Megatron's schedule needs); `lengths[r][m]` is that row's
    length in tokens (its sequences, plus padding to `pad_multiple` or, with `same_length`, to the longest row
    of the rank)."""

    rows: list[list[list[int]]]
    lengths: list[list[int]]
    useful: int  # prompt + response tokens of every sequence
    computed: int  # tokens every rank's rows run through the model, padding included

    @property
    def micro_batches(self) -> int:
        return len(self.rows[0])

    @property
    def pad_fraction(self) -> float:
        return 1.0 - self.useful / self.computed if self.computed else 0.0

    def dp_token_imbalance(self, seq_lens: list[int]) -> float:
        """max over mean of the ranks' useful tokens (1.0: perfectly balanced)."""
        per_rank = [sum(seq_lens[i] for row in rank for i in row) for rank in self.rows]
        mean = sum(per_rank) / len(per_rank)
        return max(per_rank) / mean if mean else 1.0


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def balance_over_dp(seq_lens: Sequence[int], dp: int) -> list[list[int]]:
    """Sequence indices per DP rank, token counts balanced: longest first, each to the least loaded rank
    (the LPT greedy; ties by rank). Deterministic, so every rank computes the same assignment."""
    loads, out = [0] * dp, [[] for _ in range(dp)]
    for i in sorted(range(len(seq_lens)), key=lambda i: (-seq_lens[i], i)):
        r = min(range(dp), key=lambda r: (loads[r], r))
        out[r].append(i)
        loads[r] += seq_lens[i]
    return out


def first_fit_decreasing(indices: Sequence[int], seq_lens: Sequence[int], budget: int, pad_multiple: int = 1) -> list[list[int]]:
    """`indices` packed into bins of at most `budget` tokens (a bin's total rounded up to `pad_multiple`),
    longest first, each into the first bin it fits."""
    bins: list[list[int]] = []
    used: list[int] = []
    for i in sorted(indices, key=lambda i: (-seq_lens[i], i)):
        n = seq_lens[i]
        if _round_up(n, pad_multiple) > budget:
            raise ValueError(f"a sequence of {n} tokens does not fit batch.max_tokens_per_micro_batch={budget}")
        for b, u in enumerate(used):
            if _round_up(u + n, pad_multiple) <= budget:
                bins[b].append(i)
                used[b] += n
                break
        else:
            bins.append([i])
            used.append(n)
    for b in bins:
        b.sort()  # batch order inside a row: deterministic, and independent of the packing heuristic
    return bins


def balance_chunks(seq_lens: Sequence[int], dp: int, chunk: int) -> list[list[int]]:
    """balance_over_dp applied to each run of `chunk` consecutive sequences (the update's mini-batches), the
    shares joined per rank: a pass over the whole batch that gives each DP rank exactly the rows it will
    train."""
    out: list[list[int]] = [[] for _ in range(dp)]
    for start in range(0, len(seq_lens), chunk):
        for r, share in enumerate(balance_over_dp(seq_lens[start:start + chunk], dp)):
            out[r].extend(start + i for i in share)
    return out


def plan_packing(seq_lens: Sequence[int], dp: int, budget: int, pad_multiple: int = 1,
                 same_length: bool = False, chunk: Optional[int] = None, same_over_ranks: bool = False) -> PackPlan:
    """Balance `seq_lens` over `dp` ranks and pack each rank's share into rows of at most `budget` tokens.
    With `same_length` (pipeline parallelism: one tensor shape for every micro-batch of the schedule) every
    row of a rank is padded to that rank's longest row. With `chunk`, the shares are balanced within each
    run of `chunk` sequences (balance_chunks). With `same_over_ranks` the i-th row has one length on every
    rank (expert parallelism without CUDA: megatron's allgather token dispatcher needs equal token counts)."""
    seq_lens = [int(n) for n in seq_lens]
    shares = balance_chunks(seq_lens, dp, chunk) if chunk else balance_over_dp(seq_lens, dp)
    rows = [first_fit_decreasing(share, seq_lens, budget, pad_multiple) for share in shares]
    count = max(1, max(len(r) for r in rows))
    lengths = []
    for r in rows:
        r.extend([] for _ in range(count - len(r)))
        ls = [max(_round_up(sum(seq_lens[i] for i in row), pad_multiple), pad_multiple) for row in r]
        if same_length:
            ls = [max(ls)] * len(ls)
        lengths.append(ls)
    if same_over_ranks:
        lengths = [[max(col) for col in zip(*lengths)]] * len(lengths)
    return PackPlan(rows=rows, lengths=lengths, useful=sum(seq_lens), computed=sum(sum(ls) for ls in lengths))


def packed_micro_batch(batch: RolloutBatch, indices: Sequence[int], length: int) -> dict:
    """One packed row: the sequences `indices` of `batch` back to back, then padding to `length`.

    Model inputs, [1, S]: tokens, position_ids (restarting at 0 per sequence), labels (the next token of the
    same sequence; 0 at each sequence's last position), cu_seqlens [k + 2] int32 (the padding is a segment
    of its own; Transformer Engine's THD and the local spec's SDPACoreAttention cut the row there) and
    max_seqlen.
    Loss inputs stay in the padded [n, L'] layout of `micro_batches` (L' the longest of the n sequences), so
    the loss code is the same for both: mask, advantages, old/ref/engine logprobs; `unpack_index` [n, L']
    (flat packed position of each padded position, 0 where `unpack_valid` is False) maps per-token
    quantities of the row to that layout. `rows` [n]: the sequences' indices in `batch`."""
    idx = torch.tensor(list(indices), dtype=torch.long)
    lens = (batch.prompt_lens + batch.response_lens)[idx] if len(idx) else torch.zeros(0, dtype=torch.long)
    used = int(lens.sum())
    if used > length:
        raise ValueError(f"{used} tokens do not fit a packed row of {length}")
    width = int(lens.max()) if len(idx) else 1
    tokens = torch.zeros(1, length, dtype=torch.long)
    labels = torch.zeros(1, length, dtype=torch.long)
    position_ids = torch.zeros(1, length, dtype=torch.long)
    unpack_index = torch.zeros(len(idx), width, dtype=torch.long)
    unpack_valid = torch.zeros(len(idx), width, dtype=torch.bool)
    starts = []
    pos = 0
    for j, (i, n) in enumerate(zip(idx.tolist(), lens.tolist())):
        seq = batch.tokens[i, :n]
        tokens[0, pos:pos + n] = seq
        labels[0, pos:pos + n - 1] = seq[1:]
        position_ids[0, pos:pos + n] = torch.arange(n)
        unpack_index[j, :n] = torch.arange(pos, pos + n)
        unpack_valid[j, :n] = True
        starts.append(pos)
        pos += n
    if pos < length:
        position_ids[0, pos:] = torch.arange(length - pos)
    sub = batch.rows_at(idx)

    def fit(t: torch.Tensor) -> torch.Tensor:
        return t[:, :width] if t.shape[1] >= width else torch.cat([t, t.new_zeros(t.shape[0], width - t.shape[1])], 1)

    cu = starts + [pos] + ([length] if pos < length else [])
    mb = dict(
        tokens=tokens, position_ids=position_ids, labels=labels,
        cu_seqlens=torch.tensor(cu, dtype=torch.int32),
        max_seqlen=int(max([n for n in lens.tolist()] + [length - pos])),
        unpack_index=unpack_index, unpack_valid=unpack_valid, rows=idx,
        mask=fit(sub.loss_mask()) & unpack_valid,
    )
    if batch.advantages is not None:
        mb["advantages"] = sub.advantages.float()
    for key in ("old_logp", "ref_logp", "engine_logp"):
        t = getattr(sub, key)
        if t is not None:
            mb[key] = fit(t.float())
    if batch.routed is not None:
        mb["routes"] = batch_routes(batch, idx.tolist(), length, packed=True)
    return mb


def batch_routes(batch: RolloutBatch, indices: list[int], width: int, packed: bool) -> torch.Tensor:
    """The micro-batch's `routes` [s, b, M, k] (grpo_mega.models.routing_replay.routes_layout) from batch.routed."""
    from grpo_mega.models.routing_replay import routes_layout

    some = next((r for r in batch.routed if r is not None), None)
    if some is None:
        raise ValueError("routing replay: no row of the batch holds the engine's routed experts on this rank")
    seq_lens = (batch.prompt_lens + batch.response_lens).tolist()
    return routes_layout(batch.routed, indices, seq_lens, width, packed, some.shape[1], some.shape[2])


def packed_micro_batches(batch: RolloutBatch, plan: PackPlan, dp_rank: int) -> list[dict]:
    """This DP rank's micro-batches of `plan`, one packed row each."""
    return [packed_micro_batch(batch, rows, length)
            for rows, length in zip(plan.rows[dp_rank], plan.lengths[dp_rank])]


def unpack(mb: dict, t: torch.Tensor) -> torch.Tensor:
    """A per-token quantity of a micro-batch in the padded [n, L'] layout: [1, S] of a packed row gathered
    through `unpack_index` (differentiable; 0 off the sequences); a padded micro-batch's [b, L'] as it is."""
    if "unpack_index" not in mb:
        return t
    return t.reshape(-1)[mb["unpack_index"]] * mb["unpack_valid"]
