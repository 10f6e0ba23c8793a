"""A random-weight model with a real model's architecture and tokenizer, for loadtest/gpu_check.sh where the
weights cannot be had (no network) but the model directory's small files were copied over: token-exactness
and throughput do not depend on the weights' values; the GPU tests skip the text check (`RANDOM_WEIGHTS`).

    python -m loadtest.random_model --like models/smollm2-135m-instruct --out build/random-smollm2
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

SMALL_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json", "special_tokens_map.json")
MARKER = "RANDOM_WEIGHTS"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--like", required=True, help="a model directory with at least config.json and tokenizer files")
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    like, out = Path(args.like), Path(args.out)
    if (out / MARKER).is_file() and (out / "model.safetensors").is_file():
        print(f"[random-model] {out} already exists")
        return
    config = AutoConfig.from_pretrained(like)
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    for name in SMALL_FILES:
        if (like / name).is_file():
            shutil.copy2(like / name, out / name)
    (out / MARKER).write_text(f"random weights (seed {args.seed}) with the architecture of {like}\n")
    print(f"[random-model] wrote {out} ({sum(t.numel() for t in model.parameters()) / 1e6:.0f}M parameters, RANDOM weights)")


if __name__ == "__main__":
    main()
