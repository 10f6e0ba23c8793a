"""Load-test workload profiles (pure Python: no Locust), as docs/loadtest.md lists them; each user keeps a
`shared-prefix` conversation for `turns` turns. A request carries both renderings (chat `messages`, a transcript
`prompt`); everything is drawn from the caller's seeded `random.Random`.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

PROFILES = ("short-chat", "long-prompt", "skewed", "shared-prefix")
APIS = ("auto", "chat", "completions", "mixed")
ENDPOINTS = {"chat": "/chat/completions", "completions": "/completions"}

QUESTIONS = (
    "What is the capital of France?", "Give me three tips for better sleep.", "Explain photosynthesis in one paragraph.",
    "Write a haiku about the sea.", "What is the difference between a list and a tuple in Python?", "Why is the sky blue?",
    "Suggest a name for a pet turtle.", "How do I boil an egg?", "What does HTTP stand for?",
    "Summarize the plot of Romeo and Juliet in two sentences.", "What are the primary colors?", "How many continents are there? Name them.",
    "Translate 'good morning' into Spanish and German.", "What is a prime number? Give two examples.",
    "Write a short motivational sentence for a Monday.", "What is the boiling point of water at sea level?",
    "Explain what a black hole is to a ten-year-old.", "List three fruits that are high in vitamin C.", "What is the Pythagorean theorem?",
    "Describe a cat in one sentence.", "How does a bicycle stay upright?", "What is machine learning, briefly?",
    "Give me a fun fact about octopuses.", "What should I pack for a weekend hiking trip?",
)
FOLLOW_UPS = ("Can you explain that more simply?", "Give me an example.", "Why is that?", "Can you summarize your answer in one sentence?",
              "What is a common mistake people make about this?", "How would you explain it to a child?")
_WORDS = (
    "the system data model request server cache memory token batch queue latency user network time value "
    "result process engine layer block table step policy stream metric report service load test record "
    "simple river mountain city market history season garden music language window evening morning north "
    "quickly slowly carefully often never always because although while during between across under over "
    "bright quiet heavy small large ancient modern careful gentle sudden green blue golden silver"
).split()

SYSTEM_PROMPT_SEED = 1234  # the shared prefix is the same text in every process and every run


def filler_text(rng: random.Random, num_words: int) -> str:
    """Plausible-looking prose of `num_words` words (≈ 1.1 tokens per word with SmolLM2's tokenizer)."""
    sentences, words = [], 0
    while words < num_words:
        n = min(rng.randint(8, 18), num_words - words)
        sentence = " ".join(rng.choice(_WORDS) for _ in range(n))
        sentences.append(sentence[0].upper() + sentence[1:] + ".")
        words += n
    return " ".join(sentences)


def shared_system_prompt(num_words: int = 400) -> str:
    return "You are a helpful assistant for an online store. Store policies follow. " + filler_text(random.Random(SYSTEM_PROMPT_SEED), num_words)


@dataclass(frozen=True)
class LLMRequest:
    """One request, in both renderings; `tag` names its class within the profile (stats rows)."""

    messages: tuple[dict, ...]
    max_tokens: int
    tag: str
    default_api: str  # the API this profile would naturally use ("chat" or "completions")

    @property
    def prompt(self) -> str:
        """The conversation as a plain transcript, for /v1/completions."""
        lines = [f"{m['role'].capitalize()}: {m['content']}" for m in self.messages]
        return "\n".join(lines) + "\nAssistant:"


def choose_api(request: LLMRequest, api: str, rng: random.Random) -> str:
    """`api` (one of APIS) → chat or completions; 'auto': the profile's own choice; 'mixed': either at random."""
    if api == "mixed":
        return rng.choice(("chat", "completions"))
    return request.default_api if api == "auto" else api


class Workload:
    """Draws requests of `profile` (one of PROFILES) for one simulated user: not shared (the multi-turn state is per user)."""

    def __init__(self, profile: str, rng: random.Random, *, turns: int = 4, max_tokens: int = 0) -> None:
        if turns < 1:
            raise ValueError("turns: must be >= 1")
        self.profile, self.rng, self.turns, self.max_tokens = profile, rng, turns, max_tokens  # max_tokens 0: the profile's own
        self.messages: list[dict] = []  # shared-prefix: this user's conversation so far
        self.turn = 0
        self._system = shared_system_prompt() if profile == "shared-prefix" else ""

    def _cap(self, default: int) -> int:
        return self.max_tokens or default

    def next_request(self) -> LLMRequest:
        if self.profile == "short-chat":
            return self._short()
        if self.profile == "long-prompt":
            return self._long(max_tokens=64, tag="long-prompt")
        if self.profile == "skewed":
            return self._long(max_tokens=256, tag="long") if self.rng.random() < 0.1 else self._short()
        return self._next_turn()

    def _short(self) -> LLMRequest:
        messages = ({"role": "user", "content": self.rng.choice(QUESTIONS)},)
        return LLMRequest(messages, self._cap(self.rng.randint(32, 96)), "short", "chat")

    def _long(self, max_tokens: int, tag: str) -> LLMRequest:
        content = "Summarize the following document in a few sentences.\n\n" + filler_text(self.rng, 1000)  # ≈ 1,100 tokens, each new
        return LLMRequest(({"role": "user", "content": content},), self._cap(max_tokens), tag, "completions")

    def _next_turn(self) -> LLMRequest:
        if self.turn >= self.turns or not self.messages:
            self.messages, self.turn = [{"role": "system", "content": self._system}], 0
        self.messages.append({"role": "user", "content": self.rng.choice(QUESTIONS if self.turn == 0 else FOLLOW_UPS)})
        self.turn += 1
        return LLMRequest(tuple(dict(m) for m in self.messages), self._cap(self.rng.randint(32, 64)), f"turn-{self.turn}", "chat")

    def record_reply(self, text: str) -> None:
        """Append the server's reply to the conversation (shared-prefix); a failed turn ends the conversation."""
        if self.profile == "shared-prefix" and text:
            self.messages.append({"role": "assistant", "content": text})
        elif self.profile == "shared-prefix":
            self.turn = self.turns


class PoissonArrivals:
    """Open-loop arrivals: exponential gaps at `rate_per_s` (> 0), one clock shared by every user of a process; the
    user that claims an arrival sleeps until it, so arrivals do not depend on how fast the server answers."""

    def __init__(self, rate_per_s: float, seed: int = 0) -> None:
        self.rate_per_s, self.rng = rate_per_s, random.Random(seed)
        self._next: float | None = None

    def claim(self, now: float) -> float:
        self._next = (now if self._next is None else self._next) + self.rng.expovariate(self.rate_per_s)
        return self._next


def api_base(host: str) -> str:
    """The OpenAI base URL from Locust's --host: `http://h:8000` → `http://h:8000/v1`; a host that
    already has a path (`http://h:8000/v1`, `https://x/openai/v1`) is used as is."""
    host = host.rstrip("/")
    scheme_sep = host.find("://")
    path = host[scheme_sep + 3 :].partition("/")[2] if scheme_sep >= 0 else ""
    return host if path else host + "/v1"
