"""DecodeGraphs' input staging, on CPU: what a replay reads and writes, with the graphs stood in for.

A captured graph reads only the persistent buffers and writes the KV cache and its logits. Here
each "graph" re-runs the same forward pass over those buffers (`DecodeGraphs._forward` at the
bucket size), so `run` — the copies into the buffers and the padding of rows past the batch — is
checked without CUDA: logits must equal an eager pass over the step's own inputs, for batch sizes
between buckets and after a larger batch left its rows behind, and padding rows (slot -1, length 0)
must leave the KV cache as the eager pass leaves it. Triton attention, interpreted.
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("the kernels run on CPU tensors only under TRITON_INTERPRET=1 (tests/conftest.py sets it "
                "without a GPU)", allow_module_level=True)
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # the interpreter's own numpy use

from serve_app.engine.attention import WholeStepAttentionMetadata  # noqa: E402
from serve_app.engine.attention_triton import TritonAttention  # noqa: E402
from serve_app.engine.cuda_graphs import DecodeGraphs  # noqa: E402
from serve_app.engine.input_batch import InputBatch  # noqa: E402
from serve_app.engine.models.llama import LlamaArgs, LlamaForCausalLM  # noqa: E402
from serve_app.engine.outputs import ScheduledRequest  # noqa: E402
from serve_app.types import SamplingParams  # noqa: E402

BLOCK, NUM_BLOCKS, MAX_BLOCKS = 16, 24, 4


class EagerReplay:
    """Stands in for the graph captured at `bucket`: the same pass over the same buffers."""

    def __init__(self, graphs: DecodeGraphs, bucket: int) -> None:
        self.graphs, self.bucket = graphs, bucket

    def replay(self) -> None:
        self.graphs.logits[self.bucket] = self.graphs._forward(self.bucket)


def tiny_model() -> LlamaForCausalLM:
    args = LlamaArgs(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                     head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0, rope_scaling=None, max_position_embeddings=128,
                     tie_word_embeddings=True, qkv_bias=False, sliding_window=None)
    model = LlamaForCausalLM(args)
    gen = torch.Generator().manual_seed(0)
    for p in model.parameters():
        p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    model.init_rope(args.max_position_embeddings)
    return model.eval()


def caches(model) -> list[tuple[torch.Tensor, torch.Tensor]]:
    a = model.args
    shape = (NUM_BLOCKS, BLOCK, a.num_kv_heads, a.head_dim)
    gen = torch.Generator().manual_seed(1)  # some context already in the cache
    return [(torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)) for _ in range(a.num_layers)]


def decodes(contexts: list[int]) -> list[ScheduledRequest]:
    """One decode per request, request i on blocks 4i.. (its context ends at `contexts[i]`)."""
    greedy = SamplingParams(temperature=0.0)
    return [ScheduledRequest(f"r{i}", (3 + i,), ctx - 1, tuple(range(MAX_BLOCKS * i, MAX_BLOCKS * i + -(-ctx // BLOCK))),
                             True, False, greedy, None) for i, ctx in enumerate(contexts)]


def eager_logits(model, kv, step) -> torch.Tensor:
    return model.compute_logits(model(step.input_ids, step.positions, kv, WholeStepAttentionMetadata(TritonAttention(), step)))


@torch.inference_mode()
def test_replays_match_eager_passes_and_padding_writes_nothing():
    model = tiny_model()
    batch = InputBatch(BLOCK, torch.device("cpu"))
    kv_graph = caches(model)
    graphs = DecodeGraphs(model, kv_graph, max_batch=4, max_blocks_per_seq=MAX_BLOCKS, device=torch.device("cpu"))
    assert graphs.buckets == [1, 2, 4]
    graphs.graphs = {b: EagerReplay(graphs, b) for b in graphs.buckets}
    kv_eager = caches(model)
    # a full bucket, then 3 requests (bucket 4: one padding row where the 4th request's inputs are
    # left behind), then 1; contexts cross block boundaries
    for contexts in ([17, 40, 5, 33], [9, 50, 16], [21]):
        step = batch.build(decodes(contexts))
        assert graphs.can_run(step)
        expected = eager_logits(model, kv_eager, step)
        got = graphs.run(step)
        assert got.shape == expected.shape == (len(contexts), model.args.vocab_size)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        for (kg, vg), (ke, ve) in zip(kv_graph, kv_eager, strict=True):
            # the same slots written with the same values, and nothing else (padding rows: slot -1)
            torch.testing.assert_close(kg, ke, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(vg, ve, rtol=1e-5, atol=1e-5)
    assert graphs.num_replays == 3


def test_only_decodes_that_fit_the_buffers_replay():
    model = tiny_model()
    batch = InputBatch(BLOCK, torch.device("cpu"))
    graphs = DecodeGraphs(model, caches(model), max_batch=2, max_blocks_per_seq=MAX_BLOCKS, device=torch.device("cpu"))
    assert graphs.can_run(batch.build(decodes([5, 64])))
    assert not graphs.can_run(batch.build(decodes([5, 6, 7])))  # more sequences than the largest bucket
    assert not graphs.can_run(batch.build(decodes([5, 80])))  # a block table wider than the buffers
    chunk = ScheduledRequest("p", (1, 2), 0, (0,), True, True, SamplingParams(), None)
    assert not graphs.can_run(batch.build([chunk]))  # prompt chunks run eagerly
