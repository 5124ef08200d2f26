"""Export a grpo-mega Megatron checkpoint to an HF directory: sharded safetensors with an index, config.json
and the tokenizer files, streamed one layer at a time (memory for about one layer, not the model).

    grpo-mega-convert-to-hf --ckpt CKPT --out DIR [--tokenizer-from HF_DIR] [--shard-gb 2]
    python -m grpo_mega.cli.convert_to_hf ...   (the same)

CKPT is a converted checkpoint (grpo-mega-convert-to-mcore) or a training checkpoint's step directory
(CHECKPOINT_DIR/step_XXXXXXXX, verified against its manifest first): its actor is exported.
For an MoE model the experts are merged back from whatever expert-parallel layout the checkpoint was saved at
(dist_checkpointing stores each expert under its global index), so the export takes no --ep.
"""

import argparse
import sys
import warnings


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokenizer-from", default=None, help="HF directory to copy tokenizer files from "
                    "(default: the HF source recorded in the checkpoint)")
    ap.add_argument("--shard-gb", type=float, default=2.0)
    args = ap.parse_args()
    warnings.simplefilter("ignore", FutureWarning)
    from grpo_mega.models.convert import mcore_to_hf
    from grpo_mega.trainer.checkpoint import model_dir

    try:
        res = mcore_to_hf(model_dir(args.ckpt), args.out, args.tokenizer_from, int(args.shard_gb * 2**30))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.out}: {res['bytes'] / 2**20:.1f} MiB of weights, largest layer read {res['largest_group_bytes'] / 2**20:.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
