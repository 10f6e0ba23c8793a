"""W5 workloads (speculative decoding): chat prompts as token ids, deterministic from a seed.

- grounded: the reply copies or edits text from the prompt (copy a paragraph word for word, fix a
  typo in a code snippet and return the whole snippet, quote the sentences that mention something):
  prompt lookup finds most of the reply in the prompt;
- open-ended: the reply is new text (stories, explanations): prompt lookup finds little.
"""

from __future__ import annotations

import random
from typing import Any

SENTENCES = [
    "The old lighthouse keeper climbed the spiral stairs every evening at dusk.",
    "He lit the great lamp and wrote the names of passing ships in a leather notebook.",
    "The notebook had belonged to his grandfather, who kept the same light for forty years.",
    "On stormy nights the waves broke over the rocks and shook the windows of the tower.",
    "Fishermen in the village said the light had never once gone dark in a century.",
    "In the spring the keeper painted the railings white and mended the wooden door.",
    "A small grey cat followed him up the stairs and slept beside the warm lamp.",
    "Every Sunday a boat brought bread, oil and letters from the mainland.",
    "The river flows through the valley and turns the wheel of the old mill.",
    "Children from the school walk along the bank to watch the herons fish in the shallows.",
    "The baker opens his shop at five and sells warm rolls to the workers on the early train.",
    "At the market the farmers sell apples, cheese, honey and fresh eggs from their farms.",
]
CODE = [
    "def total_price(items):\n    total = 0\n    for item in items:\n        total += item.price * item.quantity\n    retrun total\n",
    "def is_even(number):\n    if number % 2 == 0:\n        return True\n    else:\n        retrun False\n",
    "def greet(name):\n    message = 'Hello, ' + name + '!'\n    print(mesage)\n    return message\n",
]
TOPICS = ["a dragon who is afraid of the dark", "the first day at a new school", "a robot learning to cook",
          "why the sea is salty", "how bees make honey", "a journey to the moon", "the history of bicycles",
          "a friendship between a fox and a crow", "how rain forms", "a lost key that opens a secret garden"]


def _paragraph(rng: random.Random, num: int = 4) -> str:
    return " ".join(rng.sample(SENTENCES, num))


def grounded_messages(rng: random.Random) -> str:
    kind = rng.randrange(3)
    if kind == 0:
        return f"Copy this paragraph word for word:\n\n{_paragraph(rng)}"
    if kind == 1:
        return f"Fix the spelling mistake in this Python code and write out the whole corrected code:\n\n{rng.choice(CODE)}"
    return f"Repeat the following text exactly, then stop:\n\n{_paragraph(rng, 3)}"


def open_messages(rng: random.Random) -> str:
    topic = rng.choice(TOPICS)
    return rng.choice([f"Write a short story about {topic}.", f"Explain {topic} to a ten year old.",
                       f"Write a poem about {topic}."])


WORKLOADS = {"grounded": grounded_messages, "open": open_messages}


def make_prompts(tokenizer: Any, workload: str, num: int, seed: int) -> list[list[int]]:
    rng = random.Random(f"{workload}-{seed}")
    make = WORKLOADS[workload]
    return [list(tokenizer.apply_chat_template([{"role": "user", "content": make(rng)}], add_generation_prompt=True,
                                               return_dict=True)["input_ids"]) for _ in range(num)]
