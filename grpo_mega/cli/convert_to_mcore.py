"""Convert an HF model directory (safetensors) to a Megatron distributed checkpoint.

    grpo-mega-convert-to-mcore --hf-dir DIR --out CKPT [--tp 2 --pp 2] [--ep 2]
    python -m grpo_mega.cli.convert_to_mcore ...   (the same)

Forks tp * pp * ep gloo ranks on this machine (ep: MoE experts split over that many ranks); each reads only its
own slices of the safetensors. The layout is checked before anything is written, the checkpoint appears at CKPT
only when complete, and it loads at any layout afterwards (dist_checkpointing reshards).
"""

import argparse
import sys
import warnings


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hf-dir", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--ep", type=int, default=1, help="expert-parallel size (MoE models): ranks = tp * pp * ep")
    args = ap.parse_args()
    warnings.simplefilter("ignore", FutureWarning)
    from grpo_mega.models.convert import hf_to_mcore, plan_hf_to_mcore

    try:
        plan_hf_to_mcore(args.hf_dir, args.out, args.tp, args.pp, args.ep)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    res = hf_to_mcore(args.hf_dir, args.out, args.tp, args.pp, ep=args.ep)
    print(f"wrote {res['out']} (TP{args.tp}xPP{args.pp}" + (f"xEP{args.ep}" if args.ep > 1 else "") + "); "
          f"{res['param_bytes'] / 2**20:.1f} MiB of parameters, "
          f"peak memory above start {res['peak_rss_above_start'] / 2**20:.1f} MiB per rank")
    return 0


if __name__ == "__main__":
    sys.exit(main())
