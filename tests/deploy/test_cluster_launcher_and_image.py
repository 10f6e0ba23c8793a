"""deploy/ray-cluster.yaml passes the checks `ray up` makes before it calls the cloud (Ray's cluster
schema, defaults, node types), its `ray start` lines are valid options, and it agrees with the GPU
config, the RayService and the image; deploy/Dockerfile is checked statically (no Docker engine
here): instructions, pins, and that what it copies and runs exists in the repository."""

from __future__ import annotations

import copy
import re
import shlex
import tomllib

import pytest
import yaml

from serve_app.serving.config import ServeConfig
from tests.deploy.manifests import (
    CLUSTER_LAUNCHER,
    CONFIG_DIR,
    DOCKERFILE,
    REPO,
    pod_templates,
    ray_container,
    rayservice,
)

DOCKER_INSTRUCTIONS = {"FROM", "RUN", "CMD", "LABEL", "EXPOSE", "ENV", "ADD", "COPY", "ENTRYPOINT", "VOLUME", "USER",
                       "WORKDIR", "ARG", "ONBUILD", "STOPSIGNAL", "HEALTHCHECK", "SHELL"}


@pytest.fixture(scope="module")
def cluster_config():
    return yaml.safe_load(CLUSTER_LAUNCHER.read_text())


def ray_start_args(commands: list[str]) -> list[str]:
    """The options of the `ray start` in a node type's start commands."""
    (line,) = [part.strip() for cmd in commands for part in cmd.split(";") if part.strip().startswith("ray start")]
    return shlex.split(line.replace("$RAY_HEAD_IP", "127.0.0.1"))[2:]


def gpu_app_config() -> ServeConfig:
    (app,) = yaml.safe_load((CONFIG_DIR / "gpu.yaml").read_text())["applications"]
    return ServeConfig.from_dict(app["args"])


def test_cluster_config_passes_ray_up_validation(cluster_config):
    from ray.autoscaler._private.util import prepare_config, validate_config

    validate_config(copy.deepcopy(cluster_config))
    prepared = prepare_config(copy.deepcopy(cluster_config))  # merges the provider's defaults, as `ray up` does
    validate_config(prepared)
    assert prepared["provider"]["type"] == cluster_config["provider"]["type"]


def test_readme_gcp_variant_passes_ray_up_validation(cluster_config):
    """docs/deploy.md shows the GCP blocks that replace the AWS ones."""
    from ray.autoscaler._private.util import prepare_config, validate_config

    section = (REPO / "docs" / "deploy.md").read_text()
    (block,) = [b for b in re.findall(r"```yaml\n(.*?)```", section, re.S) if "type: gcp" in b]
    gcp = yaml.safe_load(block)
    assert set(gcp) == {"provider", "auth", "available_node_types"}, "only the provider-specific blocks differ"
    assert {n: {k: v for k, v in t.items() if k != "node_config"} for n, t in gcp["available_node_types"].items()} == \
        {n: {k: v for k, v in t.items() if k != "node_config"} for n, t in cluster_config["available_node_types"].items()}
    validate_config(prepare_config({**copy.deepcopy(cluster_config), **gcp}))


def test_start_commands_are_valid_ray_start_options(cluster_config):
    from ray.scripts.scripts import start

    head = ray_start_args(cluster_config["head_start_ray_commands"])
    worker = ray_start_args(cluster_config["worker_start_ray_commands"])
    for args in (head, worker):
        start.make_context("ray start", list(args))  # raises on an unknown option or a bad value
    assert "--head" in head and "--num-cpus=0" in head
    assert "--dashboard-host=127.0.0.1" in head, "the dashboard's job API runs code: loopback only (ray dashboard tunnels)"
    assert "--metrics-export-port=8080" in head and "--metrics-export-port=8080" in worker
    head_type = cluster_config["available_node_types"][cluster_config["head_node_type"]]
    assert head_type["resources"] == {"CPU": 0}, "the autoscaler must know the head takes no replicas"


def test_gpu_workers_cover_the_gpu_config_autoscaling(cluster_config):
    config = gpu_app_config()
    scaling = config.autoscaling_settings
    workers = {name: t for name, t in cluster_config["available_node_types"].items()
               if name != cluster_config["head_node_type"]}
    (gpu,) = [t for t in workers.values() if t["resources"].get("GPU")]
    assert gpu["resources"]["GPU"] == 1 and config.num_gpus_per_replica == 1
    assert gpu["max_workers"] * gpu["resources"]["GPU"] >= scaling.max_replicas
    assert cluster_config["max_workers"] >= gpu["max_workers"]
    assert gpu["min_workers"] * gpu["resources"]["GPU"] >= scaling.min_replicas
    needed = config.num_cpus_per_replica + config.ingress_num_cpus * config.ingress_num_replicas
    assert gpu["resources"]["CPU"] >= needed


def test_same_image_on_vms_and_kubernetes(cluster_config):
    images = {ray_container(t)["image"] for t in pod_templates(rayservice()).values()}
    assert images == {cluster_config["docker"]["image"]}


# ---- Dockerfile --------------------------------------------------------------------------------------
def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out, current = [], ""
    for raw in DOCKERFILE.read_text().splitlines():
        line = raw.strip()
        if not current and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):
            continue
        current = f"{current} {line[:-1].strip()}" if line.endswith("\\") else f"{current} {line}"
        if not line.endswith("\\"):
            keyword, _, args = current.strip().partition(" ")
            out.append((keyword, args.strip()))
            current = ""
    assert not current, "a continuation line runs off the end of the Dockerfile"
    return out


def test_dockerfile_instructions_and_pins():
    instructions = dockerfile_instructions()
    assert {k for k, _ in instructions} <= DOCKER_INSTRUCTIONS
    args = dict(a.split("=", 1) for k, a in instructions if k == "ARG" and "=" in a)
    base = args["PYTHON_IMAGE"]
    assert re.fullmatch(r"python:3\.11[\w.-]*", base) and not base.endswith(":latest"), "pin the base image"
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    pins = dict(re.match(r"([\w\[\],-]+)==(\S+)", d).groups() for d in pyproject["project"]["dependencies"])
    assert args["TORCH_VERSION"] == pins["torch"], "the image's torch must be pyproject's pin"
    assert all("==" in pkg for pkg in args["CLOUD_PACKAGES"].strip('"').split()), "pin cloud SDKs exactly"
    stages = [a for k, a in instructions if k == "FROM"]
    assert len(stages) == 2 and stages[-1].endswith(" AS runtime")
    runtime = instructions[[k for k, _ in instructions].index("FROM", 1):]
    user = [a for k, a in runtime if k == "USER"]
    assert user and user[-1] not in ("root", "0"), "run as a non-root user"
    env = " ".join(a for k, a in runtime if k == "ENV")
    assert "PATH=/app/.venv/bin:" in env and "HOME=/home/" in env  # the cluster launcher reads HOME from the image
    assert "RAY_worker_niceness=0" in env.split()  # `ray start` in the image: the engine replicas at normal priority
    exposed = {int(p) for k, a in runtime if k == "EXPOSE" for p in a.split()}
    assert {6379, 8265, 8000, 8080} <= exposed


def test_dockerfile_uses_the_makefile_and_copies_what_exists():
    instructions = dockerfile_instructions()
    makefile = (REPO / "Makefile").read_text()
    runs = [a for k, a in instructions if k == "RUN"]
    run = " ".join(runs)
    for target in (t for a in runs for t in re.findall(r"(?:^|&&|;)\s*make ([\w.-]+)", a)):
        assert re.search(rf"^{re.escape(target)}:", makefile, re.M), f"make {target}: no such Makefile target"
    assert "make install" in run and "make model" in run
    model_dir = re.search(r"^MODEL_DIR := (\S+)", makefile, re.M).group(1)
    (app,) = yaml.safe_load(rayservice()["spec"]["serveConfigV2"])["applications"]
    workdir = [a for k, a in instructions if k == "WORKDIR"][-1]
    assert app["args"]["model"] == f"{workdir}/{model_dir}", "the RayService loads the model `make model` wrote"
    ignore = (DOCKERFILE.parent / "Dockerfile.dockerignore").read_text().split()
    for _, arguments in (i for i in instructions if i[0] == "COPY" and "--from" not in i[1]):
        *sources, _ = arguments.split()
        for source in sources:
            assert (REPO / source).exists(), f"COPY {source}: not in the repository"
            assert f"!{source.rstrip('/')}" in [line.rstrip("/") for line in ignore], f"{source} is excluded from the context"
