"""Grammar masks on logits rows: a checked greedy row (its argmax checked against the grammar, knocked
out or masked only where forbidden) chooses exactly what the same row masked whole chooses, at every
state of a real grammar, with proposed tokens, and leaves unconstrained rows and the matcher as they
were; `mask_rows` masks as xgrammar's own kernel does.

SmolLM2's tokenizer and a JSON schema compiled against it; logits are random integers in a small
range, so each row has thousands of tokens tied at its maximum and the first-index rule is exercised.
"""

from __future__ import annotations

import json
from concurrent.futures import Future

import pytest
import torch
import xgrammar as xgr

from serve_app.engine.grammar import GrammarCompiler
from serve_app.engine.grammar_state import GrammarState
from serve_app.engine.logits_masks import MaskFiller, mask_rows
from serve_app.engine.outputs import ScheduledRequest
from serve_app.types import SamplingParams, StructuredOutput

VOCAB = 49152
EOS = 2
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "tag": {"enum": ["red", "green"]}},
          "required": ["name", "n", "tag"]}
TOP = (198, 1116, 23597)  # "\n", "\n\n", '"}': forbidden inside a JSON string (and where an object cannot end)
GREEDY = SamplingParams(temperature=0.0, max_tokens=64)
FILLED = SamplingParams(temperature=0.0, max_tokens=64, logprobs=1)  # logprobs read the whole row: masked whole


@pytest.fixture(scope="module")
def compiled(model_dir) -> Future:
    compiler = GrammarCompiler(model_dir, VOCAB)
    future = compiler.submit(StructuredOutput(json_schema=json.dumps(SCHEMA)))
    future.result()
    yield future
    compiler.shutdown()


def state(compiled: Future) -> GrammarState:
    grammar = GrammarState(compiled, frozenset({EOS}))
    assert grammar.poll() is None and grammar.ready
    return grammar


def scheduled(rid: str, grammar: GrammarState | None, params: SamplingParams, proposals: tuple[int, ...] = ()) -> ScheduledRequest:
    return ScheduledRequest(rid, (0, *proposals), 10, (0,), True, False, params, None, spec_token_ids=proposals, grammar=grammar)


def random_logits(rows: int, seed: int) -> torch.Tensor:
    """[rows, V]: `TOP` on top (in a string they are knocked out), then integers in 0..3, so each row
    has thousands of tokens tied at its maximum."""
    logits = torch.randint(0, 4, (rows, VOCAB), generator=torch.Generator().manual_seed(seed)).float()
    logits[:, TOP] = torch.tensor([5.0, 4.0, 5.0])
    return logits


def masked_choices(samplers: list[ScheduledRequest], logits: torch.Tensor) -> list[int]:
    """Each row's argmax after the step's masks."""
    masks = MaskFiller(VOCAB, torch.device("cpu"), overlap=False).start(samplers)
    assert masks.apply(logits) == {}
    return logits.argmax(dim=-1).tolist()


def test_mask_rows_masks_as_xgrammar_does():
    gen = torch.Generator().manual_seed(0)
    for vocab, rows in ((100, [0, 1, 2]), (100, [1]), (VOCAB, [0, 2]), (70, [0, 1, 2])):
        words = (vocab + 31) // 32
        bitmask = torch.randint(-2**31, 2**31 - 1, (3, words), dtype=torch.int32, generator=gen)
        logits = torch.randn(3, vocab, generator=gen)
        expected = logits.clone()
        xgr.apply_token_bitmask_inplace(expected, bitmask, vocab_size=vocab, indices=rows)
        mask_rows(logits, bitmask, rows)
        assert torch.equal(logits, expected)  # rows not listed are untouched


def test_a_checked_row_chooses_what_the_row_masked_whole_chooses(compiled):
    """Walk the grammar to its end, each step choosing from random tied logits: the checked row's
    choice equals the fully masked row's, and the matchers stay where the walk is."""
    checked, filled = state(compiled), state(compiled)
    steps = 0
    while not checked.terminated:
        logits = random_logits(1, steps).expand(2, VOCAB).clone()
        plain = logits[1].clone()
        # row 0 checked; row 1 the same logits, masked whole; row 2 unconstrained
        rows = torch.cat([logits, plain.unsqueeze(0)])
        choices = masked_choices([scheduled("c", checked, GREEDY), scheduled("f", filled, FILLED),
                                  scheduled("u", None, GREEDY)], rows)
        assert choices[0] == choices[1]
        assert torch.equal(rows[2], plain)
        assert checked.accept(choices[0]) and filled.accept(choices[1])
        steps += 1
        assert steps < 200
    assert steps > 5


def test_checked_rows_with_proposals_follow_the_proposals(compiled, tokenizer):
    """A verification's row j is checked after proposals 0..j-1: with proposals that are the rows'
    own masked choices, every row chooses what one request walking them step by step chooses; after
    a proposal that differs, the rows are unused. The matcher is left where it was. Inside a JSON
    string (most tokens allowed, so rows are decided by knocking out forbidden tokens) and at its
    end (few allowed: masked whole)."""
    for text, seed in (('{"name": "', 2), ('{"name": "abcdefghijkl', 3)):
        check_proposals(compiled, tokenizer.encode(text), seed)


def check_proposals(compiled: Future, prefix: list[int], seed: int) -> None:
    def at_prefix() -> GrammarState:
        grammar = state(compiled)
        assert all(grammar.accept(t) for t in prefix)
        return grammar

    logits = random_logits(4, seed)
    reference, walker = [], at_prefix()  # one row at a time, advancing by each choice
    for row in logits:
        choice = masked_choices([scheduled("w", walker, FILLED)], row.unsqueeze(0).clone())[0]
        reference.append(choice)
        assert walker.accept(choice)
    grammar = at_prefix()
    assert masked_choices([scheduled("v", grammar, GREEDY, tuple(reference[:3]))], logits.clone()) == reference
    # the matcher was left where it was: it allows the first choice again
    assert grammar.allows(reference[0]) and not grammar.terminated
    # a wrong first proposal: row 0 still chooses right, the rest are left unused
    grammar = at_prefix()
    assert masked_choices([scheduled("x", grammar, GREEDY, (EOS, EOS, EOS))], logits.clone())[0] == reference[0]
