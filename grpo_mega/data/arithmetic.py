"""A small arithmetic prompt set in verl's schema, for examples and smoke runs of real models.

    python -m grpo_mega.data.arithmetic --out data/arith_train.parquet [--n 256] [--seed 0] [--max 20]

Each row asks for a sum, difference or product of two small integers, with the answer in \\boxed{} so that
the math reward (math-verify) can check it: `prompt` (one user message), `reward_model.ground_truth`,
`data_source`, `ability`, `extra_info` - the columns verl's preprocessing scripts write.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


def make_rows(n: int, seed: int = 0, max_operand: int = 20, split: str = "train") -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        a, b, op = rng.randint(0, max_operand), rng.randint(0, max_operand), rng.choice(sorted(OPS))
        question = f"What is {a} {op} {b}? Put the final answer in \\boxed{{}}."
        rows.append(dict(
            data_source="arithmetic",
            prompt=[{"role": "user", "content": question}],
            ability="math",
            reward_model={"style": "rule", "ground_truth": str(OPS[op](a, b))},
            extra_info={"split": split, "index": i},
        ))
    return rows


def write(rows: list[dict], out: Path) -> Path:
    """.parquet (as verl writes it) or .jsonl, by the file's suffix."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.partial")
    if out.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), tmp)
    elif out.suffix == ".jsonl":
        tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    else:
        raise ValueError(f"{out}: expected a .parquet or .jsonl path")
    tmp.rename(out)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--n", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max", type=int, default=20, help="largest operand")
    ap.add_argument("--split", default="train")
    args = ap.parse_args()
    write(make_rows(args.n, args.seed, args.max, args.split), args.out)
    print(f"wrote {args.n} prompts to {args.out}")


if __name__ == "__main__":
    main()
