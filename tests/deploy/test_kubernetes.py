"""KubeRay manifests (deploy/kuberay/): they parse, carry the fields KubeRay and Kubernetes require,
and agree with the Serve app they embed, the image and the monitoring setup.

Pod templates go through the official Kubernetes client's models; the RayService's own fields through
the CRD field table in tests/deploy/manifests.py. No cluster is needed (none exists here).
"""

from __future__ import annotations

import shlex

import pytest
import ray
import yaml
from ray._private import ray_constants

from serve_app.serving.config import ServeConfig
from tests.deploy.manifests import (
    NETWORKPOLICY,
    PODMONITOR,
    PROMETHEUS_CONFIG,
    RAYSERVICE,
    RAYSERVICE_CRD,
    check_custom,
    check_k8s,
    load_docs,
    pod_templates,
    ray_container,
    rayservice,
    to_k8s_model,
)

SERVE_PORT, METRICS_PORT = 8000, 8080


@pytest.fixture(scope="module")
def service():
    return rayservice()


@pytest.fixture(scope="module")
def app_config(service):
    serve = yaml.safe_load(service["spec"]["serveConfigV2"])
    (app,) = serve["applications"]
    return ServeConfig.from_dict(app["args"])


def ports(container) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in container.get("ports", [])}


def test_rayservice_has_the_crd_fields_kuberay_requires(service):
    assert service["apiVersion"] == "ray.io/v1" and service["kind"] == "RayService"
    assert check_custom(service, RAYSERVICE_CRD, "RayService") == []
    cluster = service["spec"]["rayClusterConfig"]
    assert cluster["rayVersion"] == ray.__version__, "rayVersion must be the image's Ray (pyproject pin)"
    assert cluster["enableInTreeAutoscaling"] is True, "GPU worker pods must follow Serve's autoscaling"
    assert cluster["authOptions"]["mode"] == "token"
    (gpu,) = cluster["workerGroupSpecs"]
    assert 0 <= gpu["minReplicas"] <= gpu.get("replicas", gpu["minReplicas"]) <= gpu["maxReplicas"]


def test_the_field_check_catches_typos_and_wrong_types(service):
    import copy

    bad = copy.deepcopy(service)
    cluster = bad["spec"]["rayClusterConfig"]
    cluster["headGroupSpec"]["rayStartParams"]["num-cpus"] = 0  # must be a string
    cluster["workerGroupSpecs"][0]["maxReplica"] = 4  # typo
    cluster["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]["resource"] = {}  # typo
    cluster["headGroupSpec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["cpu"] = "4 cores"
    errors = "\n".join(check_custom(bad, RAYSERVICE_CRD, "RayService"))
    assert "rayStartParams.num-cpus: values must be strings" in errors
    assert "workerGroupSpecs[0].maxReplica: not a field" in errors
    assert "containers[0].resource: not a field of V1Container" in errors
    assert "limits.cpu: invalid quantity" in errors
    del bad["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]["name"]
    with pytest.raises(ValueError, match="name"):
        to_k8s_model(bad["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["template"], "V1PodTemplateSpec")


@pytest.mark.parametrize("group", ["head", "gpu"])
def test_pod_templates_are_valid_kubernetes_objects(service, group):
    template = pod_templates(service)[group]
    assert check_k8s(template, "V1PodTemplateSpec", group) == []
    pod = to_k8s_model(template, "V1PodTemplateSpec")
    container = pod.spec.containers[0]
    assert container.image and container.image == ray_container(pod_templates(service)["head"])["image"], \
        "one image for every group"
    # requests == limits (Ray sizes itself from the limits; a guaranteed pod is not evicted first)
    assert container.resources.requests == container.resources.limits
    assert {"cpu", "memory"} <= set(container.resources.limits)
    assert container.readiness_probe and container.liveness_probe
    mounts = {m.mount_path: m.name for m in container.volume_mounts}
    volumes = {v.name: v for v in pod.spec.volumes}
    assert volumes[mounts["/dev/shm"]].empty_dir.medium == "Memory", "Ray's object store needs a real /dev/shm"


def test_one_gpu_per_worker_pod_and_one_per_llm_replica(service, app_config):
    cluster = service["spec"]["rayClusterConfig"]
    head = ray_container(cluster["headGroupSpec"]["template"])
    assert "nvidia.com/gpu" not in head["resources"]["limits"]
    assert cluster["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0", "no replicas on the head"
    (gpu,) = cluster["workerGroupSpecs"]
    limits = ray_container(gpu["template"])["resources"]["limits"]
    gpus_per_pod = int(limits["nvidia.com/gpu"])
    assert gpus_per_pod == 1 and app_config.num_gpus_per_replica == 1
    tolerations = gpu["template"]["spec"].get("tolerations", [])
    assert any(t["key"] == "nvidia.com/gpu" for t in tolerations), "GPU nodes are usually tainted"
    # autoscaling bounds fit the worker group: every LLMServer replica can get a GPU
    scaling = app_config.autoscaling_settings
    assert scaling is not None, "the RayService autoscales LLMServer"
    assert scaling.max_replicas * app_config.num_gpus_per_replica <= gpu["maxReplicas"] * gpus_per_pod
    assert scaling.min_replicas * app_config.num_gpus_per_replica <= gpu["minReplicas"] * gpus_per_pod
    # CPUs: the head has none, so a GPU pod may hold its LLMServer replica and every ingress replica
    cpus = float(limits["cpu"])
    needed = app_config.num_cpus_per_replica * gpus_per_pod + app_config.ingress_num_cpus * app_config.ingress_num_replicas
    assert needed <= cpus, f"a GPU pod needs {needed} CPUs, has {cpus}"


def test_ports_probes_and_metrics(service, app_config):
    serve = yaml.safe_load(service["spec"]["serveConfigV2"])
    assert serve["http_options"]["port"] == SERVE_PORT and serve["http_options"]["host"] == "0.0.0.0"
    agent_port = ray_constants.DEFAULT_DASHBOARD_AGENT_LISTEN_PORT
    cluster = service["spec"]["rayClusterConfig"]
    groups = {"head": cluster["headGroupSpec"], **{g["groupName"]: g for g in cluster["workerGroupSpecs"]}}
    for name, group in groups.items():
        container = ray_container(group["template"])
        named = ports(container)
        assert named["metrics"] == METRICS_PORT == int(group["rayStartParams"]["metrics-export-port"]), name
        assert named["serve"] == SERVE_PORT, name
        assert container["livenessProbe"]["httpGet"] == {"path": "/api/healthz", "port": agent_port}, name
        # every pod may host an ingress replica: each mounts the keys Secret where the config reads it,
        # and the Secret is required (a pod without keys would serve nobody, or refuse to start)
        mounts = {m["name"]: m for m in container["volumeMounts"]}
        volumes = {v["name"]: v for v in group["template"]["spec"]["volumes"]}
        assert mounts["api-keys"]["mountPath"] == app_config.api_keys_file and mounts["api-keys"]["readOnly"], name
        assert volumes["api-keys"]["secret"] == {"secretName": "serve-app-api-keys"}, name
        assert not app_config.api_key_env and not container.get("env"), name
    head = ray_container(cluster["headGroupSpec"]["template"])
    assert ports(head)["dashboard"] == 8265 and ports(head)["gcs-server"] == 6379
    assert head["readinessProbe"]["httpGet"] == {"path": "/api/healthz", "port": agent_port}
    # a GPU worker is ready when its raylet is up and its Serve proxy answers (KubeRay's own rule)
    (gpu,) = cluster["workerGroupSpecs"]
    command = shlex.join(ray_container(gpu["template"])["readinessProbe"]["exec"]["command"])
    assert f"localhost:{agent_port}/api/local_raylet_healthz" in command
    assert f"localhost:{SERVE_PORT}/-/healthz" in command


def test_ray_start_params_are_ray_start_options(service):
    from ray.scripts.scripts import start

    cluster = service["spec"]["rayClusterConfig"]
    for group in [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]:
        args = [f"--{key}={value}" for key, value in group["rayStartParams"].items()]
        start.make_context("ray start", args)  # raises on an unknown option or a bad value


def test_podmonitor_scrapes_the_metrics_port_of_every_ray_pod(service):
    (monitor,) = load_docs(PODMONITOR)
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1" and monitor["kind"] == "PodMonitor"
    assert check_k8s(monitor["metadata"], "V1ObjectMeta", "metadata") == []
    selector = monitor["spec"]["selector"]["matchLabels"]
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    for name, template in pod_templates(service).items():
        assert selector.items() <= template["metadata"]["labels"].items(), f"{name} pods are not selected"
        assert endpoint["port"] in ports(ray_container(template)), name
    # same job label as deploy/prometheus/prometheus.yml, so the rules and dashboards work unchanged
    (job,) = [c["job_name"] for c in yaml.safe_load(PROMETHEUS_CONFIG.read_text())["scrape_configs"]]
    assert {"targetLabel": "job", "replacement": job} in endpoint["relabelings"]


def test_the_network_policy_confines_rays_ports(service):
    """Only the API port is open to all; the dashboard (job submission runs code) only to the KubeRay
    operator; every other port only to the cluster's own pods; and it selects every Ray pod."""
    (policy,) = load_docs(NETWORKPOLICY)
    assert policy["kind"] == "NetworkPolicy" and policy["spec"]["policyTypes"] == ["Ingress"]
    selector = policy["spec"]["podSelector"]["matchLabels"]
    for name, template in pod_templates(service).items():
        assert selector.items() <= template["metadata"]["labels"].items(), f"{name} pods are not covered"
    open_to_all = [rule for rule in policy["spec"]["ingress"] if "from" not in rule]
    assert open_to_all == [{"ports": [{"protocol": "TCP", "port": SERVE_PORT}]}]
    dashboard = [rule for rule in policy["spec"]["ingress"] if {"protocol": "TCP", "port": 8265} in rule.get("ports", [])]
    assert len(dashboard) == 1 and all("podSelector" in peer for peer in dashboard[0]["from"])
    unrestricted_ports = [rule for rule in policy["spec"]["ingress"] if "ports" not in rule]
    assert unrestricted_ports == [{"from": [{"podSelector": {"matchLabels": selector}}]}]


def test_manifests_are_plain_yaml_documents():
    for path in (RAYSERVICE, PODMONITOR, NETWORKPOLICY):
        for doc in load_docs(path):
            assert {"apiVersion", "kind", "metadata"} <= doc.keys(), path
            assert doc["metadata"]["name"], path
