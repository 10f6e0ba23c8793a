"""What a checkpoint says about generation: its EOS ids and its default sampling settings.

Read from `config.json` and `generation_config.json` (stdlib only, so the serving layer can use it
without torch). Llama-3-Instruct lists several EOS ids (`<|end_of_text|>`, `<|eot_id|>`, ...),
in either file: every one of them ends generation. `generation_config.json`'s sampling values
(`temperature`, `top_p`, `top_k`, `repetition_penalty`) are the defaults for requests that leave
those fields out, as in vLLM's OpenAI server; a request that sets a field always wins.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# generation_config.json keys used as request defaults (same names in our SamplingParams)
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "repetition_penalty")


def _ids(value: Any) -> set[int]:
    if value is None:
        return set()
    if isinstance(value, int):
        return {value}
    return {int(v) for v in value}


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


@dataclass(frozen=True)
class GenerationDefaults:
    eos_token_ids: frozenset[int] = frozenset()
    sampling: tuple[tuple[str, float | int], ...] = ()  # (SamplingParams field, default) pairs

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> GenerationDefaults:
        model_dir = Path(model_dir)
        config = _read_json(model_dir / "config.json")
        generation = _read_json(model_dir / "generation_config.json")
        eos = _ids(config.get("eos_token_id")) | _ids(generation.get("eos_token_id"))
        sampling = tuple((k, generation[k]) for k in SAMPLING_KEYS if generation.get(k) is not None)
        return cls(frozenset(eos), sampling)

    def sampling_value(self, name: str, requested: Any, neutral: Any) -> Any:
        """The request's value if it set one, else the checkpoint's default, else `neutral`."""
        if requested is not None:
            return requested
        return dict(self.sampling).get(name, neutral)
