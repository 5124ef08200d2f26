"""Benchmark: the embedded engine's generation against transformers' own `generate` on the same batch. Writes JSON.

    python -m bench.decode [--hf-dir DIR] [--prompts 8] [--n 4] [--prompt-len 32] [--new-tokens 64]
                           [--rounds 3] [--out bench_results/decode.json]

The same HF model object (SmolLM2-135M-Instruct from `make smollm2` by default), the same prompts, each answered
n times, sampled at temperature 1 without top-k or top-p, every row run to `--new-tokens` (no stop token for the
embedded engine; `min_new_tokens` for transformers). The two are alternated round by round after one warm-up
call of each, so load on a shared machine falls on both; the median round is reported for each, with every
round's seconds. What each does per token: the embedded engine one forward over the batch with a KV cache, then
log-softmax and one draw per row from that row's own seeded generator (a sample does not depend on its batch);
transformers' `generate` one forward, its logits processors and one batched multinomial.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

from bench import common


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hf-dir", default=None, help="an HF model directory (default: SmolLM2-135M-Instruct, make smollm2)")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--n", type=int, default=4, help="samples per prompt")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds of each, alternated, after one warm-up each")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--out", default=common.out_path("decode"))
    args = ap.parse_args()
    if min(args.prompts, args.n, args.prompt_len, args.new_tokens, args.rounds) < 1:
        ap.error("--prompts, --n, --prompt-len, --new-tokens and --rounds must be >= 1")

    import warnings

    warnings.simplefilter("ignore")
    import torch

    from grpo_mega.rollout.embedded import EmbeddedEngine

    torch.set_num_threads(args.threads)
    if args.hf_dir is None:
        from grpo_mega.cli.prepare_model import prepared_dir

        args.hf_dir = str(prepared_dir())
    engine = EmbeddedEngine.from_hf_dir(args.hf_dir)
    model = engine.model
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, vocab, (args.prompt_len,), generator=g).tolist() for _ in range(args.prompts)]
    ids = torch.tensor(prompts).repeat_interleave(args.n, 0)
    rows = ids.shape[0]

    def embedded(seed: int) -> int:
        out = engine.generate(prompts, args.n, 1.0, 1.0, args.new_tokens, [], seed=seed)
        return sum(len(t) for t in out.token_ids)

    def hf(seed: int) -> int:
        torch.manual_seed(seed)
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0, top_k=0,
                                 top_p=1.0, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                                 pad_token_id=0)
        return int((out.shape[1] - ids.shape[1]) * rows)

    sides = {"embedded": embedded, "transformers_generate": hf}
    for fn in sides.values():
        fn(0)  # warm-up
    seconds = {k: [] for k in sides}
    tokens = {}
    load_start = os.getloadavg()
    for r in range(args.rounds):
        for name, fn in sides.items():
            t0 = time.perf_counter()
            tokens[name] = fn(r + 1)
            seconds[name].append(time.perf_counter() - t0)
        print(f"round {r + 1}: embedded {seconds['embedded'][-1]:.2f} s, transformers {seconds['transformers_generate'][-1]:.2f} s",
              flush=True)
    if tokens["embedded"] != tokens["transformers_generate"]:
        raise SystemExit(f"not the same work: {tokens} generated tokens")
    med = {k: statistics.median(v) for k, v in seconds.items()}
    ratio = med["embedded"] / med["transformers_generate"]
    result = dict(
        what="the embedded engine's generate vs transformers' generate: same model, prompts and length, sampled, "
             "alternated round by round; median of the rounds",
        model=args.hf_dir, rows=rows, prompt_len=args.prompt_len, new_tokens=args.new_tokens,
        generated_tokens=tokens["embedded"], threads=args.threads, rounds=args.rounds, seconds=seconds,
        median_seconds=med, tokens_per_s={k: tokens[k] / v for k, v in med.items()},
        decode_step_ms={k: 1e3 * v / args.new_tokens for k, v in med.items()},
        embedded_over_transformers=ratio, loadavg_start=list(load_start), loadavg_end=list(os.getloadavg()),
        machine=common.machine(),
    )
    common.write_json(args.out, result)
    print(f"embedded {med['embedded']:.2f} s, transformers' generate {med['transformers_generate']:.2f} s for "
          f"{tokens['embedded']} tokens: ratio {ratio:.2f}; wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
