"""One vLLM engine across several CPU ranks behind Ray Serve: configs/vllm-local-tp.yaml
(tensor_parallel_size 3; SmolLM2-135M's 9 attention heads and 3 KV heads cannot be split 2 ways), in
fp32 with a small KV cache here, on a private Ray instance with 4 logical CPUs (the group needs 3.5
of them; they are scheduling tokens, not cores), 127.0.0.1 only:

- the replica's placement group, read back from Ray's placement-group table: the replica's bundle
  plus one {"CPU": 1} bundle per rank, STRICT_PACK, created, on one node; the replica actor runs in it;
- the ranks are vLLM worker processes of that replica (vLLM's mp executor: it has no Ray executor on
  CPU), one per tensor-parallel rank, each pinned to its share of the cores (two cores: "0|1|0");
- greedy fp32 completions through the HTTP API equal HF transformers' on real chat prompts, token
  count and text (measured equal on all eight, although the ranks' all-reduce adds partial sums in
  another order than one engine's matmul), and chat says what the one-rank engine says;
- deleting the app removes the placement group, ends the rank processes, frees Ray's CPUs and leaves
  no shared memory behind (last test).
"""

from __future__ import annotations

import contextlib
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import psutil
import pytest
import yaml

pytest.importorskip("vllm")

from serve_app.backends.vllm_options import split_cores  # noqa: E402
from serve_app.metrics import local_stack  # noqa: E402
from tests.engine.conftest import CHAT_PROMPTS, hf_greedy  # noqa: E402
from tests.polling import wait_for  # noqa: E402
from tests.serving.conftest import APP_NAME, MODEL_NAME, ServedApp, openai_client, replica_actors  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "vllm-local-tp.yaml"
RAY_CPUS = 4
MAX_TOKENS = 24
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


def config_args(model_dir: str) -> dict:
    """The shipped config's app args, in fp32 (comparable with HF) with a test-sized cache, no API key."""
    (app,) = yaml.safe_load(CONFIG.read_text())["applications"]
    args = dict(app["args"])
    args["engine"] = {**args["engine"], "dtype": "float32", "kv_cache_memory_gib": 0.25, "max_num_seqs": 16}
    return {**args, "model": model_dir, "api_key_env": "", "health_check_period_s": 2.0}


def unmapped_shm() -> set[str]:
    """Shared-memory segments in /dev/shm that no live process maps (left behind, if new)."""
    mapped = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        with contextlib.suppress(OSError):
            mapped |= {line.split("/dev/shm/", 1)[1].split()[0] for line in maps.read_text().splitlines() if "/dev/shm/" in line}
    return set(os.listdir("/dev/shm")) - mapped


@pytest.fixture(scope="module")
def served(model_dir):
    """(ServedApp, ranks, /dev/shm's unmapped segments before): Ray with RAY_CPUS logical CPUs +
    Serve + the app on a free loopback port."""
    from ray import serve

    from serve_app.serving.app import build_app

    args = config_args(model_dir)
    shm_before = unmapped_shm()
    started = time.monotonic()
    with local_stack.ray_instance(num_cpus=RAY_CPUS, namespace="vllm-tp"):
        port = local_stack.free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app(args), name=APP_NAME, route_prefix="/")
        print(f"\n[vllm tp] Ray + Serve + a {args['engine']['tensor_parallel_size']}-rank vLLM replica ready "
              f"in {time.monotonic() - started:.1f} s")
        yield ServedApp(f"http://127.0.0.1:{port}", args), args["engine"]["tensor_parallel_size"], shm_before


def replica_actor():
    """Ray's state record (`ActorState`: pid, placement_group_id, node_id) of the only LLMServer replica."""
    from ray.util.state import list_actors

    (handle,) = replica_actors().values()
    (actor,) = list_actors(filters=[("actor_id", "=", handle._actor_id.hex())], detail=True, timeout=30)
    return actor


def title(proc: psutil.Process) -> str:
    """vLLM's process title ("VLLM::Worker_TP0"): the kernel keeps 15 characters of the name, the
    command line has it whole."""
    with contextlib.suppress(psutil.Error):
        return (proc.cmdline() or [proc.name()])[0].split()[0]
    return ""


def worker_processes() -> dict[int, tuple[str, list[int]]]:
    """Every vLLM tensor-parallel worker on the machine: pid → (title, its ancestors' pids)."""
    out = {}
    for proc in psutil.process_iter():
        if title(proc).startswith("VLLM::Worker_TP"):
            with contextlib.suppress(psutil.Error):
                out[proc.pid] = (title(proc), [p.pid for p in proc.parents()])
    return out


def rank_processes(replica_pid: int) -> list[psutil.Process]:
    """The replica's tensor-parallel workers (replica → engine core → workers), by rank."""
    workers = worker_processes()
    mine = [pid for pid, (_, ancestors) in workers.items() if replica_pid in ancestors]
    assert mine, f"no worker process under the replica (pid {replica_pid}); workers on the machine: {workers}"
    return sorted((psutil.Process(pid) for pid in mine), key=title)


@pytest.fixture(scope="module")
def placement(served):
    """(placement group id, replica actor record, rank processes), read once the app is running."""
    actor = replica_actor()
    return actor.placement_group_id, actor, rank_processes(actor.pid)


def test_replica_placement_group_has_a_bundle_per_rank(served, placement):
    import ray

    _, ranks, _ = served
    pg_id, actor, _ = placement
    assert pg_id, actor  # the replica actor runs inside a placement group
    table = ray.util.placement_group_table()[pg_id]
    assert table["state"] == "CREATED" and table["strategy"] == "STRICT_PACK"
    assert table["bundles"] == {0: {"CPU": 0.5}, **{i: {"CPU": 1.0} for i in range(1, ranks + 1)}}
    assert set(table["bundles_to_node_id"].values()) == {actor.node_id}  # all on the replica's node


def test_ranks_are_processes_of_the_replica_each_on_its_cores(served, placement):
    _, ranks, _ = served
    _, _, procs = placement
    assert [title(p) for p in procs] == [f"VLLM::Worker_TP{r}" for r in range(ranks)]
    # what the backend computed in the replica: the machine's cores split among the ranks
    expected = [[int(c) for c in group.split(",")] for group in split_cores(sorted(os.sched_getaffinity(0)), ranks).split("|")]
    assert [sorted(p.cpu_affinity()) for p in procs] == expected


def test_greedy_fp32_through_http_equals_hf(served, model_dir):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    app, _, _ = served
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = [list(tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                                  return_dict=True)["input_ids"]) for p in CHAT_PROMPTS]

    def complete(prompt: list[int]) -> dict:
        body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
        r = httpx.post(f"{app.base_url}/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()

    with ThreadPoolExecutor(len(prompts)) as pool:  # all at once: the ranks run them as one batch
        replies = list(pool.map(complete, prompts))

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    eos = model.config.eos_token_id
    expected = [hf_greedy(model, p, MAX_TOKENS, eos) for p in prompts]
    del model
    for prompt, reply, ids in zip(CHAT_PROMPTS, replies, expected, strict=True):
        choice = reply["choices"][0]
        assert reply["usage"]["completion_tokens"] == len(ids), prompt
        assert choice["text"] == tokenizer.decode([t for t in ids if t != eos]), prompt
        assert choice["finish_reason"] == ("stop" if ids[-1] == eos else "length"), prompt
    assert {r["choices"][0]["finish_reason"] for r in replies} == {"stop", "length"}  # both endings seen

    chat = openai_client(app).chat.completions.create(model=MODEL_NAME, messages=FRANCE, max_tokens=16, temperature=0)
    assert chat.choices[0].message.content == "The capital of France is Paris."  # as the one-rank engine


def test_deleting_the_app_frees_the_placement_group_and_the_ranks(served, placement):
    """Last: it takes the app down."""
    import ray
    from ray import serve

    _, ranks, shm_before = served
    pg_id, _, procs = placement
    assert len(procs) == ranks and all(p.is_running() for p in procs)
    serve.delete(APP_NAME)
    wait_for(lambda: ray.util.placement_group_table().get(pg_id, {}).get("state", "REMOVED") == "REMOVED", 60,
             message="the replica's placement group removed")
    _, alive = psutil.wait_procs(procs, timeout=60)
    assert not alive, alive
    wait_for(lambda: ray.available_resources().get("CPU") == RAY_CPUS, 30, message="all of Ray's CPUs free")
    # the engine core's message queue and the ranks' all-reduce buffers: unlinked, not left in memory
    # (another process on the machine leaving a segment right now would fail this too)
    wait_for(lambda: not (unmapped_shm() - shm_before), 30, message="no shared memory left behind")
