"""ServeConfig validation, the shipped Serve YAMLs, the app builder, request → SamplingParams mapping
and error mapping (no Ray cluster, no model)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from ray.exceptions import RayTaskError
from ray.serve.schema import ServeDeploySchema

from serve_app.serving import app as app_module
from serve_app.serving.config import ServeConfig
from serve_app.serving.errors import to_api_error, validation_error
from serve_app.serving.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    UnsupportedParameterError,
)

REPO = Path(__file__).resolve().parents[2]


# ---- config ----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("args", "param"),
    [
        ({"model": ""}, "model"),
        ({"model": "m", "num_replicas": 0}, "num_replicas"),
        ({"model": "m", "num_cpus_per_replica": -1}, "num_cpus_per_replica"),
        ({"model": "m", "max_queued_requests": 0}, "max_queued_requests"),
        ({"model": "m", "request_timeout_s": 0}, "request_timeout_s"),
        ({"model": "m", "max_request_bytes": 10}, "max_request_bytes"),
        ({"model": "m", "backend": "tgi"}, "backend"),
        ({"model": "m", "engine": {"dtype": "int4"}}, "dtype"),
        ({"model": "m", "engine": {"max_num_seqs": 0}}, "max_num_seqs"),
        ({"model": "m", "engine": {"not_an_option": 1}}, "not_an_option"),
        ({"model": "m", "engine": {"speculative": {"method": "lookahead"}}}, "speculative.method"),
        ({"model": "m", "engine": {"speculative": {"method": "ngram", "k": 9}}}, "speculative.k"),
        ({"model": "m", "replicas": 2}, "replicas"),
        ({"model": "m", "stat_logger_factories": ["no_colon"]}, "stat_logger_factories"),
    ],
)
def test_serve_config_rejects_bad_values(args, param):
    with pytest.raises(ValueError, match=rf"^{param}:"):
        ServeConfig.from_dict(args)


def test_serve_config_is_frozen_and_picklable():
    import pickle

    cfg = ServeConfig.from_dict({"model": "models/x", "engine": {"max_num_seqs": 4, "dtype": "bfloat16"}})
    assert cfg.engine == (("dtype", "bfloat16"), ("max_num_seqs", 4))
    assert cfg.backend_config.options.scheduler.max_num_seqs == 4 and cfg.model_name == "x"
    assert pickle.loads(pickle.dumps(cfg)) == cfg
    with pytest.raises(AttributeError):
        cfg.num_replicas = 3  # type: ignore[misc]


@pytest.mark.parametrize("name", ["local.yaml", "gpu.yaml"])
def test_shipped_serve_configs_validate(name):
    raw = yaml.safe_load((REPO / "configs" / name).read_text())
    schema = ServeDeploySchema.model_validate(raw)
    assert schema.http_options.port == 8000
    (application,) = schema.applications
    assert application.import_path == "serve_app.serving.app:build_app"
    cfg = ServeConfig.from_dict(application.args)
    if name == "local.yaml":
        assert schema.http_options.host == "127.0.0.1"
        assert cfg.num_replicas == 2 and cfg.num_cpus_per_replica <= 0.5 and cfg.num_gpus_per_replica == 0
        assert cfg.backend_config.options.model.device == "cpu"
        assert cfg.request_routing_stats_period_s <= 1.0
    else:
        assert cfg.num_gpus_per_replica == 1 and cfg.backend_config.options.model.device == "cuda"
        assert cfg.backend_config.options.model.dtype == "bfloat16"


def test_build_app_resolves_model_path(monkeypatch, tmp_path):
    model = tmp_path / "models" / "tiny"
    model.mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert app_module.resolve_model_path("models/tiny") == str(model)
    assert app_module.resolve_model_path("models/smollm2-135m-instruct") == str(REPO / "models" / "smollm2-135m-instruct") \
        or not (REPO / "models" / "smollm2-135m-instruct").is_dir()
    with pytest.raises(ValueError, match="^model:"):
        app_module.resolve_model_path("models/does-not-exist")
    application = app_module.build_app({"model": "models/tiny", "num_replicas": 3, "num_cpus_per_replica": 0.25})
    assert application is not None


def test_api_key_never_travels_in_deployment_arguments(monkeypatch, tmp_path):
    """Serve keeps deployment arguments in its controller state (and shows them on its dashboard):
    the key is read from the environment inside each ingress replica instead."""
    from ray import cloudpickle

    from serve_app.serving.ingress import api_key_from_env

    (tmp_path / "tiny").mkdir()
    monkeypatch.setenv("MY_KEY_VAR", "sk-zzz-secret")
    application = app_module.build_app({"model": str(tmp_path / "tiny"), "api_key_env": "MY_KEY_VAR"})
    assert b"sk-zzz-secret" not in cloudpickle.dumps(application)
    assert api_key_from_env("MY_KEY_VAR") == "sk-zzz-secret"  # what the ingress replica reads
    assert api_key_from_env("") == ""  # api_key_env "": no authentication
    monkeypatch.delenv("MY_KEY_VAR")
    assert api_key_from_env("MY_KEY_VAR") == ""
    with pytest.raises(ValueError, match="^api_key: not a serving option"):
        ServeConfig.from_dict({"model": "m", "api_key": "sk-in-the-config"})


def test_serving_layer_imports_without_torch():
    code = ("import sys; import serve_app.serving.app, serve_app.serving.ingress, serve_app.serving.llm_server, "
            "serve_app.backends.native; assert 'torch' not in sys.modules, 'torch imported'; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


# ---- request → sampling params ----------------------------------------------------------------------
def test_completion_request_mapping():
    req = CompletionRequest.model_validate({"model": "m", "prompt": "hi", "stop": "\n", "top_k": 5, "seed": 3})
    params = req.sampling_params()
    assert params.max_tokens == 16 and params.temperature == 1.0 and params.top_p == 1.0  # OpenAI defaults
    assert params.stop == ("\n",) and params.top_k == 5 and params.seed == 3
    assert CompletionRequest.model_validate({"model": "m", "prompt": [1, 2, 3]}).prompts() == [[1, 2, 3]]
    assert CompletionRequest.model_validate({"model": "m", "prompt": [[1, 2], [3]]}).prompts() == [[1, 2], [3]]
    assert CompletionRequest.model_validate({"model": "m", "prompt": ["a", "b"]}).prompts() == ["a", "b"]
    with pytest.raises(ValueError, match="^prompt:"):
        CompletionRequest.model_validate({"model": "m", "prompt": []}).prompts()


def test_speculative_engine_option_and_per_request_opt_out():
    cfg = ServeConfig.from_dict({"model": "models/x", "engine": {"speculative": {"method": "ngram", "max_k": 6}}})
    spec = cfg.backend_config.options.speculative
    assert spec.enabled and (spec.max_k, spec.k) == (6, 0)  # adaptive by default
    assert not ServeConfig.from_dict({"model": "models/x"}).backend_config.options.speculative.enabled  # absent: off
    assert CompletionRequest.model_validate({"model": "m", "prompt": "hi"}).sampling_params(100).speculative
    opted_out = CompletionRequest.model_validate({"model": "m", "prompt": "hi", "speculative": False})
    assert opted_out.sampling_params(100).speculative is False


def test_chat_request_mapping():
    req = ChatCompletionRequest.model_validate({
        "model": "m", "n": 2, "seed": 7, "max_completion_tokens": 9, "max_tokens": 99,
        "messages": [{"role": "developer", "content": "Be brief."},
                     {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                     {"role": "assistant", "content": None, "name": "bot"}],
    })
    assert req.engine_messages() == ({"role": "system", "content": "Be brief."}, {"role": "user", "content": "a\nb"},
                                     {"role": "assistant", "content": "", "name": "bot"})
    assert [req.sampling_params(j).seed for j in range(2)] == [7, 8]  # distinct per choice
    assert req.sampling_params().max_tokens == 9  # max_completion_tokens wins
    no_limit = ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "x"}]})
    assert no_limit.sampling_params().max_tokens is None  # the engine fills in the room left in the context
    for extra, param in [({"functions": [{"name": "f"}]}, "functions"), ({"function_call": "auto"}, "function_call"),
                         ({"n": 9}, "n")]:
        r = ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "x"}], **extra})
        with pytest.raises(UnsupportedParameterError) as e:
            r.validate_supported(max_n=8)
        assert e.value.param == param


# ---- error mapping ---------------------------------------------------------------------------------
def test_error_mapping():
    wrapped = RayTaskError("generate", "Traceback ...", ValueError("top_p: must be in (0, 1]")).as_instanceof_cause()
    err = to_api_error(wrapped)
    assert (err.status, err.param, err.code, err.type) == (400, "top_p", "invalid_value", "invalid_request_error")
    assert err.message == "top_p: must be in (0, 1]"
    err = to_api_error(ValueError("prompt: too long"), param_aliases={"prompt": "messages"})
    assert err.param == "messages"
    assert to_api_error(TimeoutError()).status == 504
    assert to_api_error(ValueError("something without a field")).param is None
    err = validation_error([{"type": "missing", "loc": ("body", "messages", 0, "role"), "msg": "Field required"}])
    assert (err.status, err.param, err.code) == (400, "messages.0.role", "missing_required_parameter")
    err = validation_error([{"type": "string_type", "loc": ("body", "prompt", "str"), "msg": "Input should be a valid string"},
                            {"type": "list_type", "loc": ("body", "prompt", "list[str]"), "msg": "Input should be a valid list"}])
    assert err.param == "prompt" and "1 more problem" in err.message
