"""`backend: vllm` configuration, in the default suite (vllm need not be installed): options are
validated on the driver with field-named errors, become the right vLLM engine arguments, feed the
router the engine's block size, and nothing here (or in the serving layer) imports vllm."""

from __future__ import annotations

import subprocess
import sys

import pytest

from serve_app.backends.vllm_options import GIB, VLLMOptions
from serve_app.config import ServeConfig
from serve_app.serving.app import request_router_config

MODEL = "models/smollm2-135m-instruct"


def vllm_config(**engine) -> ServeConfig:
    return ServeConfig(model=MODEL, backend="vllm", engine=engine)


def test_defaults_and_engine_arguments():
    config = vllm_config(enforce_eager=True, max_model_len=2048, kv_cache_memory_gib=0.25, engine_args={"max_logprobs": 0})
    options = config.vllm_options()
    assert (config.device, config.kv_block_size) == ("cpu", 128)  # vLLM's CPU default block size
    args = options.async_engine_args("/m", "served")
    assert args == {
        "model": "/m", "served_model_name": "served", "dtype": "float32", "seed": 0, "max_num_seqs": 64,
        "max_num_batched_tokens": 2048, "enable_prefix_caching": True, "enforce_eager": True, "disable_log_stats": True,
        "enable_logging_iteration_details": True, "max_model_len": 2048, "kv_cache_memory_bytes": GIB // 4, "max_logprobs": 0,
    }
    assert options.environment() == {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    assert request_router_config(config).request_router_kwargs["block_size"] == 128


def test_gpu_options():
    options = vllm_config(device="cuda", gpu_memory_utilization=0.85, block_size=32).vllm_options()
    args = options.async_engine_args("/m", "m")
    assert args["gpu_memory_utilization"] == 0.85 and "kv_cache_memory_bytes" not in args and args["block_size"] == 32
    assert options.environment() == {} and options.effective_block_size == 32
    assert VLLMOptions(device="cuda").effective_block_size == 16


@pytest.mark.parametrize(("engine", "field"), [
    ({"num_blocks": 64}, "num_blocks"),  # a native option
    ({"dtype": "int8"}, "dtype"),
    ({"device": "cuda:1"}, "device"),
    ({"max_num_seqs": 0}, "max_num_seqs"),
    ({"block_size": 17}, "block_size"),
    ({"kv_cache_memory_gib": 0}, "kv_cache_memory_gib"),
    ({"gpu_memory_utilization": 0.9}, "gpu_memory_utilization"),  # on CPU
    ({"engine_args": {"enforce_eager": True}}, "engine_args"),  # has its own option
    ({"engine_args": {"kv_cache_memory_bytes": 1}}, "engine_args"),
])
def test_bad_options_name_the_field(engine, field):
    with pytest.raises(ValueError, match=rf"^{field}:"):
        vllm_config(**engine)


def test_backend_names():
    with pytest.raises(ValueError, match=r"^backend:"):
        ServeConfig(model=MODEL, backend="tgi")
    with pytest.raises(ValueError, match=r"^backend:"):
        vllm_config().engine_config()  # the native engine's config does not apply
    with pytest.raises(ValueError, match=r"^backend:"):
        ServeConfig(model=MODEL).vllm_options()
    assert ServeConfig(model=MODEL).kv_block_size == 16 and ServeConfig(model=MODEL).device == "cpu"


def test_the_serving_layer_and_the_backend_module_never_import_vllm():
    code = (
        "import sys\n"
        "from serve_app.config import ServeConfig\n"
        "from serve_app.backends import make_backend\n"
        "import serve_app.backends.vllm, serve_app.serving.app\n"
        f"backend = make_backend(ServeConfig(model={MODEL!r}, backend='vllm'))\n"
        "assert type(backend).__name__ == 'VLLMBackend'\n"
        "print(sorted(m for m in sys.modules if m == 'vllm' or m.startswith('vllm.')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_speculative_option_maps_to_vllm_speculative_config():
    """The native engine's `speculative` option means the same on vLLM (fixed k: vLLM has no adaptive length)."""
    args = vllm_config(speculative={"method": "ngram", "max_k": 3}).vllm_options().async_engine_args("/m", "m")
    assert args["speculative_config"] == {"method": "ngram", "num_speculative_tokens": 3,
                                          "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    fixed = vllm_config(speculative={"method": "ngram", "k": 2, "ngram_min": 3}).vllm_options().async_engine_args("/m", "m")
    assert fixed["speculative_config"]["num_speculative_tokens"] == 2 and fixed["speculative_config"]["prompt_lookup_min"] == 3
    assert "speculative_config" not in vllm_config(speculative={"method": "off"}).vllm_options().async_engine_args("/m", "m")
    with pytest.raises(ValueError, match="^speculative.method:"):
        vllm_config(speculative={"method": "eagle"})
    with pytest.raises(ValueError, match="^engine_args:"):
        vllm_config(engine_args={"speculative_config": {"method": "ngram"}})
