"""Speculative decoding with a draft model (a second model with its own paged KV cache).

- SmolLM2 as its own draft: every proposal is accepted, and the output is HF's (an exact check of
  the verification path);
- a perturbed SmolLM2 as the draft: proposals are accepted and rejected, and outputs (greedy and
  seeded sampling) are token-for-token those without speculation, also when the draft's cache is
  too small for every request; both caches end empty and consistent;
- rejection sampling (acceptance `rejection`) keeps the target's distribution: chi-square tests of
  the pure sampler and of the engine on tiny constructed models against the exact distribution,
  with a control showing the test rejects the draft's own distribution.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from serve_app.engine import LLM, SamplingParams
from serve_app.engine.spec_decode.rejection import rejection_sample
from tests.engine.conftest import MAX_TOKENS
from tests.recording_logger import RecordingLogger

pytestmark = pytest.mark.heavy  # a draft model beside the target, many steps each: make test, not make test-fast

GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
LONG = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
PERTURBATION = 0.05  # noise std per weight matrix, relative to the matrix's std: about half the proposals accepted


@pytest.fixture(scope="module")
def perturbed_dir(model_dir, tmp_path_factory) -> str:
    """SmolLM2 with Gaussian noise on every weight matrix: a draft that agrees often, not always."""
    from safetensors.torch import load_file, save_file

    src, dst = Path(model_dir), tmp_path_factory.mktemp("perturbed-draft")
    gen = torch.Generator().manual_seed(0)
    weights = load_file(src / "model.safetensors")
    noisy = {name: w + (torch.randn(w.shape, generator=gen) * w.float().std() * PERTURBATION).to(w.dtype) if w.dim() == 2 else w
             for name, w in weights.items()}
    save_file(noisy, dst / "model.safetensors", metadata={"format": "pt"})
    for f in src.iterdir():
        if f.name != "model.safetensors":
            shutil.copyfile(f, dst / f.name)
    return str(dst)


def run(model_dir, prompts, params, spec=None, **kwargs):
    stats = RecordingLogger()
    llm = LLM(model_dir, dtype="float32", stat_loggers=[stats], speculative=spec, **kwargs)
    outs = llm.generate(prompts, params)
    core = llm.engine.core
    core.block_manager.check_integrity()
    assert core.block_manager.num_used_blocks == 0
    proposer = core.scheduler.speculator.proposer if core.scheduler.speculator else None
    if proposer is not None and hasattr(proposer, "blocks"):  # the draft's own cache: freed with each request
        proposer.blocks.check_integrity()
        assert proposer.blocks.num_used_blocks == 0 and not proposer._seqs
    proposed = sum(s.spec_num_proposed for s in stats.steps)
    accepted = sum(s.spec_num_accepted for s in stats.steps)
    return [list(o.token_ids) for o in outs], proposed, accepted


@pytest.mark.parametrize("k", [4, 0], ids=["k4", "adaptive"])
def test_the_model_as_its_own_draft_accepts_every_proposal(model_dir, prompt_ids, hf_reference, k):
    tokens, proposed, accepted = run(model_dir, prompt_ids, GREEDY, {"method": "draft", "draft_model": model_dir, "k": k})
    assert tokens == hf_reference
    assert proposed > 0 and accepted == proposed


def test_a_perturbed_draft_keeps_outputs_identical(model_dir, prompt_ids, perturbed_dir):
    params = [SamplingParams(temperature=0.8, top_p=0.95, seed=3 + i, max_tokens=MAX_TOKENS) for i in range(len(prompt_ids))]
    params[0] = params[3] = GREEDY
    reference, _, _ = run(model_dir, prompt_ids, params)
    for spec in ({"method": "draft", "draft_model": perturbed_dir, "k": 3}, {"method": "draft", "draft_model": perturbed_dir}):
        tokens, proposed, accepted = run(model_dir, prompt_ids, params, spec)
        assert tokens == reference, spec
        assert 0 < accepted < proposed  # both acceptances and rejections (rolled back in both caches)


def test_a_full_draft_cache_drops_draft_state_not_outputs(model_dir, prompt_ids, perturbed_dir):
    """A draft cache of 10 blocks of 16 tokens, where these 8 requests need 4-8 blocks each: the
    draft drops other requests' state, or proposes nothing for a request it cannot hold; outputs do
    not change."""
    reference, _, _ = run(model_dir, prompt_ids, GREEDY)
    block_bytes = 30 * 2 * 16 * 3 * 64 * 4  # layers x (K, V) x tokens x KV heads x head dim x fp32
    spec = {"method": "draft", "draft_model": perturbed_dir, "k": 3, "draft_kv_cache_memory_gib": 10 * block_bytes / 2**30}
    tokens, proposed, _ = run(model_dir, prompt_ids, GREEDY, spec)
    assert tokens == reference and proposed > 0


def test_aborts_mid_speculation_and_preemption_free_both_caches(model_dir, prompt_ids, perturbed_dir):
    """Requests aborted between verification steps, and a target cache small enough to preempt:
    the target's and the draft's block accounting stay exact and both end empty."""
    from serve_app.types import GenerateRequest

    stats = RecordingLogger()
    llm = LLM(model_dir, dtype="float32", num_blocks=12, block_size=16, stat_loggers=[stats],
              speculative={"method": "draft", "draft_model": perturbed_dir, "k": 3})
    engine, core = llm.engine, llm.engine.core
    draft = core.scheduler.speculator.proposer
    for i, prompt in enumerate(prompt_ids):
        engine.add_request(GenerateRequest(f"r{i}", prompt=prompt, sampling_params=LONG))
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
        core.block_manager.check_integrity()
        draft.blocks.check_integrity()
        if steps in (3, 6):  # mid-decode: some requests hold draft state and rolled-back proposals
            engine.abort([f"r{steps}", f"r{steps + 1}"])
            assert not {f"r{steps}", f"r{steps + 1}"} & set(draft._seqs)
    assert core.block_manager.num_used_blocks == 0 and draft.blocks.num_used_blocks == 0 and not draft._seqs
    assert sum(s.num_preempted for s in stats.steps) > 0 and sum(s.spec_num_accepted for s in stats.steps) > 0


def test_a_draft_with_another_vocabulary_is_refused_at_start(model_dir, tiny_pair):
    with pytest.raises(ValueError, match="^speculative.draft_model: its vocabulary"):
        LLM(model_dir, dtype="float32", speculative={"method": "draft", "draft_model": tiny_pair[1]})
    with pytest.raises(ValueError, match="^speculative.draft_model: .*not found"):
        LLM(model_dir, dtype="float32", speculative={"method": "draft", "draft_model": str(Path(model_dir) / "missing")})


def test_greedy_requests_keep_the_exact_rule_under_rejection_sampling(model_dir, prompt_ids, hf_reference, perturbed_dir):
    spec = {"method": "draft", "draft_model": perturbed_dir, "k": 3, "acceptance": "rejection"}
    tokens, proposed, accepted = run(model_dir, prompt_ids, GREEDY, spec)
    assert tokens == hf_reference and 0 < accepted < proposed


# ---- distribution: chi-square against the exact distribution --------------------------------------
def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor, min_expected: float = 5.0) -> float:
    """Goodness of fit of `counts` to `probs` (cells expected below `min_expected` pooled)."""
    expected = probs * counts.sum()
    small = expected < min_expected
    obs = torch.cat([counts[~small], counts[small].sum().unsqueeze(0)])
    exp = torch.cat([expected[~small], expected[small].sum().unsqueeze(0)])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    stat = float(((obs - exp) ** 2 / exp).sum())
    dof = len(exp) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(stat / 2, dtype=torch.float64)))


def test_rejection_sampler_output_has_the_target_distribution():
    """k = 2 proposals drawn from q; each output position (accepted proposal, residual or bonus draw)
    follows p. Positions 0 and 1 are tested over all 20,000 trials, whatever was accepted before."""
    gen = torch.Generator().manual_seed(0)
    p = torch.tensor([[0.5, 0.2, 0.2, 0.1, 0.0], [0.1, 0.1, 0.3, 0.3, 0.2], [0.25, 0.25, 0.25, 0.25, 0.0]])
    q = torch.tensor([[0.1, 0.6, 0.1, 0.1, 0.1], [0.3, 0.3, 0.1, 0.1, 0.2]])
    trials = 20_000
    first = torch.zeros(5)
    for _ in range(trials):
        x0 = int(torch.multinomial(q[0], 1, generator=gen))
        x1 = int(torch.multinomial(q[1], 1, generator=gen))
        out = rejection_sample(p, q, [x0, x1], [None, None], [None] * 3, gen)
        first[out[0]] += 1
    assert chi_square_p_value(first, p[0]) > 1e-3
    # the control: the draft's own distribution is rejected by the same test
    assert chi_square_p_value(first, q[0]) < 1e-9


VOCAB = 4
PROMPT = [1, 2, 3]


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    """(target model, target dir, draft dir): two random models over a 4-token vocabulary."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)
    paths, models = [], []
    for seed in (0, 1):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config).eval()
        for w in model.parameters():
            if w.dim() == 2:  # spread the logits: distinct, not uniform distributions
                torch.nn.init.normal_(w, std=0.3)
        path = tmp_path_factory.mktemp(f"tiny-{seed}")
        model.save_pretrained(path)
        paths.append(str(path))
        models.append(model)
    return models[0], paths[0], paths[1]


def exact_joint(model, prompt: list[int], n: int) -> torch.Tensor:
    """p(t1..tn | prompt) at temperature 1 over all V^n continuations, flattened."""
    probs = torch.ones(1)
    seqs = [list(prompt)]
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor(seqs)).logits[:, -1].float()
            step = logits.softmax(-1)  # [S, V]
            probs = (probs.unsqueeze(1) * step).reshape(-1)
            seqs = [s + [t] for s in seqs for t in range(VOCAB)]
    return probs


def joint_counts(outputs: list[list[int]]) -> torch.Tensor:
    counts = torch.zeros(VOCAB ** 3)
    for t in outputs:
        counts[(t[0] * VOCAB + t[1]) * VOCAB + t[2]] += 1
    return counts


def test_rejection_sampling_in_the_engine_keeps_the_target_distribution(tiny_pair):
    """3,000 seeded requests at temperature 1: after the first token, a step verifies 2 proposals of
    the draft (a different random model) by rejection sampling. The joint distribution of the first
    3 tokens fits the target's exact one; the draft's own outputs do not."""
    target, target_dir, draft_dir = tiny_pair
    n = 3_000
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=4, ignore_eos=True) for i in range(n)]
    spec = {"method": "draft", "draft_model": draft_dir, "k": 2, "acceptance": "rejection"}
    kwargs = dict(block_size=8, num_blocks=4096, max_num_seqs=256)
    tokens, proposed, accepted = run(target_dir, [PROMPT] * n, params, spec, **kwargs)
    assert 0 < accepted < proposed
    exact = exact_joint(target, PROMPT, 3)
    assert chi_square_p_value(joint_counts(tokens), exact) > 1e-3
    drafted, _, _ = run(draft_dir, [PROMPT] * n, params, **kwargs)
    assert chi_square_p_value(joint_counts(drafted), exact) < 1e-9  # the test can tell the models apart
