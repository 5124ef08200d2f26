"""Benchmark: the embedded engine's generation against transformers' own `generate` on the same batch. Writes JSON.

    python -m bench.decode [--hf-dir DIR | --model NAME] [--prompts 8] [--n 4] [--prompt-len 32] [--new-tokens 64]
                           [--modes dynamic,static] [--hf-caches dynamic] [--rounds 3] [--out bench_results/decode.json]
    python -m bench.decode --gpu     # qwen2.5-0.5b (random weights), bf16, 16 x 4 rows x 512 new tokens, on CUDA:
                                     # the engine's dynamic, static and compiled decode beside generate's dynamic
                                     # and static caches (bench_results/decode_gpu_<device>.json)

The same HF model object (SmolLM2-135M-Instruct from `make smollm2` by default, or a model_configs name with random
weights), the same prompts, each answered n times, sampled at temperature 1 without top-k or top-p, every row run
to `--new-tokens` (no stop token for the embedded engine; `min_new_tokens` for transformers). Each side is one of
the engine's decode modes (rollout.embedded_decode: `embedded_dynamic`, `embedded_static`, `embedded_compiled`)
or `generate` with one cache implementation (`transformers_dynamic`, `transformers_static`). The sides are
alternated round by round after one warm-up call of each, so load on a shared machine falls on all alike; the
median round is reported for each, with every round's wall seconds and the process's CPU seconds (all threads:
on a loaded machine the steadier measure of the work done). `--dry-run` prints the parsed arguments and exits.
"""

from __future__ import annotations

import os
import statistics
import sys

from bench import common


def parse(argv=None):
    ap = common.parser(__doc__, None)
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--hf-dir", default=None, help="an HF model directory (default: SmolLM2-135M-Instruct, make smollm2)")
    src.add_argument("--model", default=None, help="a model_configs name, random weights (seed 0)")
    ap.add_argument("--gpu", action="store_true", help="CUDA, bf16, qwen2.5-0.5b, 16 x 4 rows x 512 new tokens, "
                    "every decode mode and both generate caches (each unless given)")
    ap.add_argument("--device", default=None, help="cpu or cuda (default: cuda with --gpu, else cpu)")
    ap.add_argument("--dtype", default=None, choices=("fp32", "bf16"), help="default: bf16 with --gpu, else fp32")
    ap.add_argument("--prompts", type=int, default=None, help="default 8 (16 with --gpu)")
    ap.add_argument("--n", type=int, default=4, help="samples per prompt")
    ap.add_argument("--prompt-len", type=int, default=None, help="default 32 (64 with --gpu)")
    ap.add_argument("--new-tokens", type=int, default=None, help="default 64 (512 with --gpu)")
    ap.add_argument("--modes", default=None, help="the engine's decode modes, comma-separated (default: dynamic,static; "
                    "with --gpu dynamic,static,compiled)")
    ap.add_argument("--hf-caches", default=None, help="generate's cache implementations, comma-separated "
                    "(default: dynamic; with --gpu dynamic,static); 'none' for no transformers side")
    ap.add_argument("--rounds", type=int, default=None, help="timed rounds of each, alternated, after one warm-up each "
                    "(default 3; 2 with --gpu)")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--dry-run", action="store_true", help="print the parsed arguments and exit")
    args = ap.parse_args(argv)
    gpu = args.gpu
    defaults = dict(device="cuda" if gpu else "cpu", dtype="bf16" if gpu else "fp32", prompts=16 if gpu else 8,
                    prompt_len=64 if gpu else 32, new_tokens=512 if gpu else 64,
                    modes="dynamic,static,compiled" if gpu else "dynamic,static",
                    hf_caches="dynamic,static" if gpu else "dynamic", rounds=2 if gpu else 3)
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if gpu and args.hf_dir is None and args.model is None:
        args.model = "qwen2.5-0.5b"
    if min(args.prompts, args.n, args.prompt_len, args.new_tokens, args.rounds) < 1:
        ap.error("--prompts, --n, --prompt-len, --new-tokens and --rounds must be >= 1")
    args.modes = common.names(args.modes, ("dynamic", "static", "compiled"), "--modes")
    caches = args.hf_caches
    args.hf_caches = [] if caches == "none" else common.names(caches, ("dynamic", "static"), "--hf-caches (or 'none')")
    if not args.modes:
        ap.error("--modes needs at least one of dynamic, static, compiled")
    return args


def main(argv=None) -> int:
    args = parse(argv)
    if args.dry_run:
        print(vars(args))
        return 0

    import warnings

    warnings.simplefilter("ignore")
    import torch

    from grpo_mega.engines.embedded import EmbeddedEngine

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("error: --device cuda (or --gpu) needs CUDA (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    if args.model is not None:
        from grpo_mega.conf import load_model_config

        engine = EmbeddedEngine.from_model_config(load_model_config(args.model), dtype=dtype, device=args.device)
        source = args.model
    else:
        if args.hf_dir is None:
            from grpo_mega.cli.prepare_model import prepared_dir

            args.hf_dir = str(prepared_dir())
        engine = EmbeddedEngine.from_hf_dir(args.hf_dir, dtype=dtype, device=args.device)
        source = args.hf_dir
    model = engine.model
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, vocab, (args.prompt_len,), generator=g).tolist() for _ in range(args.prompts)]
    ids = torch.tensor(prompts).repeat_interleave(args.n, 0).to(args.device)
    rows = ids.shape[0]
    cuda = args.device.startswith("cuda")

    def embedded(mode):
        def run(seed: int) -> int:
            engine.decode = mode
            out = engine.generate(prompts, args.n, 1.0, 1.0, args.new_tokens, [], seed=seed)
            return sum(len(t) for t in out.token_ids)
        return run

    def hf(cache):
        def run(seed: int) -> int:
            torch.manual_seed(seed)
            with torch.no_grad():
                out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0,
                                     top_k=0, top_p=1.0, max_new_tokens=args.new_tokens,
                                     min_new_tokens=args.new_tokens, pad_token_id=0, cache_implementation=cache)
            return int((out.shape[1] - ids.shape[1]) * rows)
        return run

    sides = {f"embedded_{m}": embedded(m) for m in args.modes}
    sides.update({f"transformers_{c}": hf(c) for c in args.hf_caches})

    warmup = {k: common.timed(lambda: fn(0), cuda)[0] for k, fn in sides.items()}  # compilation, graph capture
    seconds = {k: [] for k in sides}
    cpu_seconds = {k: [] for k in sides}
    tokens = {}
    load_start = os.getloadavg()
    for r in range(args.rounds):
        for name, fn in sides.items():
            wall, cpu, tokens[name] = common.timed(lambda: fn(r + 1), cuda)
            seconds[name].append(wall)
            cpu_seconds[name].append(cpu)
        print(f"round {r + 1}: " + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in seconds.items()), flush=True)
    if len(set(tokens.values())) != 1:
        raise SystemExit(f"not the same work: {tokens} generated tokens")
    generated = next(iter(tokens.values()))
    med = {k: statistics.median(v) for k, v in seconds.items()}
    med_cpu = {k: statistics.median(v) for k, v in cpu_seconds.items()}
    first = f"embedded_{args.modes[0]}"
    result = dict(
        what="the embedded engine's generate (each decode mode) vs transformers' generate (each cache): same model, "
             "prompts and length, sampled, alternated round by round; median of the rounds, wall and process CPU "
             "seconds",
        model=source, device=args.device, dtype=args.dtype, rows=rows, prompt_len=args.prompt_len,
        new_tokens=args.new_tokens, generated_tokens=generated, threads=args.threads, rounds=args.rounds,
        warmup_seconds=warmup, seconds=seconds, cpu_seconds=cpu_seconds, median_seconds=med,
        median_cpu_seconds=med_cpu, tokens_per_s={k: generated / v for k, v in med.items()},
        decode_step_ms={k: 1e3 * v / args.new_tokens for k, v in med.items()},
        over_first_mode={k: v / med[first] for k, v in med.items()},
        cpu_over_first_mode={k: v / med_cpu[first] for k, v in med_cpu.items()},
        engine_compile_error=engine.compile_error, loadavg_start=list(load_start), loadavg_end=list(os.getloadavg()),
        machine=common.machine(),
    )
    if args.out is None:
        from bench.step import device_slug

        args.out = common.out_path(f"decode_gpu_{device_slug(result['machine'].get('device', 'cuda'))}"
                                   if cuda else "decode")
    common.write_json(args.out, result)
    print(f"{generated} tokens; median wall s: " + ", ".join(f"{k} {v:.2f}" for k, v in med.items())
          + "; tok/s: " + ", ".join(f"{k} {v:.0f}" for k, v in result["tokens_per_s"].items()) + f"; wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
