"""How much of a second chat turn the prefix cache serves, with and without batch invariance.

Batch invariance keeps only prompt blocks in the prefix cache when the prompt and the decode
kernels differ (docs/batch-invariance.md): a second turn then recomputes the first answer's tokens
instead of reusing their K/V. This measures what that costs: for each question of the committed
invariance fixture, turn 1 asks it (greedy, `--max-tokens` tokens), turn 2 sends the whole
conversation plus a follow-up; the figure is turn 2's cached prompt tokens over its prompt tokens,
and the time turn 2 takes, per mode, each mode in a fresh engine.

    .venv/bin/python loadtest/bench_multiturn_reuse.py --out reports/batch_invariance/multiturn.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from serve_app.engine import LLM, SamplingParams

FIXTURE = Path("tests/engine/data/invariance_chats.json")
FOLLOW_UP = "Explain that in more detail."


def measure(model: str, questions: list[str], max_tokens: int, invariant: bool) -> dict:
    llm = LLM(model, dtype="bfloat16", batch_invariant=invariant)
    greedy = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    cached = prompt = 0
    seconds = 0.0
    for q in questions:
        first = [{"role": "user", "content": q}]
        answer = llm.chat([first], greedy)[0].text
        second = [*first, {"role": "assistant", "content": answer}, {"role": "user", "content": FOLLOW_UP}]
        start = time.perf_counter()
        out = llm.chat([second], SamplingParams(temperature=0, max_tokens=1))[0]
        seconds += time.perf_counter() - start
        cached += out.metrics.num_cached_tokens
        prompt += out.num_prompt_tokens
    return {"batch_invariant": invariant, "turns": len(questions), "cached_tokens": cached, "prompt_tokens": prompt,
            "cached_share": cached / prompt, "second_turn_s": seconds, "paths": llm.engine.core.model_runner.paths.describe()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="models/smollm2-135m-instruct")
    parser.add_argument("--max-tokens", type=int, default=64, help="first answer's length")
    parser.add_argument("--out", type=Path, default=Path("build/multiturn_reuse.json"))
    args = parser.parse_args()
    questions = json.loads(FIXTURE.read_text())["questions"]
    runs = []
    for invariant in (True, False):
        runs.append(measure(args.model, questions, args.max_tokens, invariant))
        r = runs[-1]
        print(f"[multiturn] batch_invariant={invariant}: turn 2 cached {r['cached_tokens']}/{r['prompt_tokens']} prompt tokens "
              f"({r['cached_share']:.0%}), {r['second_turn_s']:.2f} s for {r['turns']} turns", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"max_tokens": args.max_tokens, "follow_up": FOLLOW_UP, "runs": runs}, indent=2) + "\n")
    print(f"[multiturn] wrote {args.out}")


if __name__ == "__main__":
    main()
