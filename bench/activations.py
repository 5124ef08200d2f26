"""Benchmark: the activations one transformer layer keeps for its backward, measured, against grpo-mega-plan's
formula. Writes JSON.

    python -m bench.activations [--model qwen2.5-0.5b] [--layers 2] [--seq 256] [--micro-batch 1]
                                [--out bench_results/activations.json]

Measured with torch's saved-tensor hooks (what autograd really keeps, the distinct storages, parameters
excluded) through megatron's own GPTModel at TP1, bf16: the layer spec this machine builds (Transformer
Engine's fused layers on a GPU, megatron-core's local spec elsewhere). Per layer = (model with 2L layers -
model with L layers) / L, so the embedding and the output layer cancel. Reported for recompute none,
selective and full, next to the planner's figure for the same spec (flash attention with TE; without it the local spec's own
accounting, planning.local_layer_activation_bytes).
"""

from __future__ import annotations

import dataclasses
import platform
import sys

from bench import common


def _saved_bytes(model, seq: int, micro_batch: int, recompute: str) -> int:
    import torch

    from grpo_mega.conf.parallel import ParallelConfig
    from grpo_mega.conf.optim import PrecisionConfig
    from grpo_mega.models.builder import build_gpt
    from grpo_mega.parallel import cpu_compat
    from grpo_mega.parallel.state import destroy_distributed, init_distributed

    with cpu_compat.cpu_device_mode():
        init_distributed(tp=1, pp=1, seed=0)
        gpt, _ = build_gpt(model, ParallelConfig(recompute=recompute), PrecisionConfig(params_dtype="bf16"))
        params = {p.untyped_storage().data_ptr() for p in gpt.parameters()}
        seen: dict[int, int] = {}

        def pack(t):
            s = t.untyped_storage()
            if s.data_ptr() not in params and s.nbytes() > 0:
                seen[s.data_ptr()] = s.nbytes()
            return t

        device = next(gpt.parameters()).device
        tokens = torch.randint(0, model.vocab_size, (micro_batch, seq), device=device)
        pos = torch.arange(seq, device=device).expand(micro_batch, seq).contiguous()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            gpt(tokens, pos, None)
        destroy_distributed()
    return sum(seen.values())


def main() -> int:
    ap = common.parser(__doc__, "activations")
    ap.add_argument("--model", default="qwen2.5-0.5b", help="a model_configs name: its layer shape is measured")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--vocab", type=int, default=1024, help="a small vocabulary: the layers are what is measured")
    args = ap.parse_args()

    import torch

    from grpo_mega import planning
    from grpo_mega.conf.model import load_model_config
    from grpo_mega.models.builder import have_transformer_engine
    from grpo_mega.parallel.forked import run_ranks

    base = dataclasses.replace(load_model_config(args.model), vocab_size=args.vocab, tie_word_embeddings=False)
    te = have_transformer_engine()  # the layer spec build_gpt picks
    rows = []
    for recompute in ("none", "selective", "full"):
        got = [run_ranks(_saved_bytes, 1, dataclasses.replace(base, num_layers=n), args.seq, args.micro_batch, recompute,
                         timeout=600)[0] for n in (args.layers, 2 * args.layers)]
        measured = (got[1] - got[0]) / args.layers
        planned = planning.layer_activation_bytes(base, args.seq, args.micro_batch, 1, False, recompute, flash_attention=True,
                                                  layer_spec="transformer_engine" if te else "local")
        rows.append(dict(recompute=recompute, measured_bytes_per_layer=measured, planned_bytes_per_layer=planned,
                         measured_over_planned=measured / planned))
        print(f"recompute={recompute:9s} measured {measured / 2**20:8.2f} MiB/layer, planned {planned / 2**20:8.2f} "
              f"MiB/layer ({measured / planned:.2f}x)")
    result = dict(model=args.model, seq=args.seq, micro_batch=args.micro_batch, dtype="bf16", tp=1,
                  layer_spec="transformer_engine" if te else "local", machine=platform.machine(),
                  device=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                  torch=torch.__version__, host=common.machine(), rows=rows)
    common.write_json(args.out, result)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
