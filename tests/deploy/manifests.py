"""Loading and checking the deployment manifests (tests/deploy).

Kubernetes core types (pod templates, resource requirements, services) are checked against the
official `kubernetes` Python client's models: every key must be a field of its model (a typo would be
dropped silently by the API server's pruning, or rejected by `kubectl apply --validate=strict`), every
value must have the model's type, and the object must deserialize into the model (required fields).

The RayService custom resource has no model there: `RAYSERVICE_CRD` lists the `ray.io/v1` fields a
manifest may use, with their types, enums and required fields, as KubeRay's CRD defines them
(written against KubeRay v1.7.0, `apis/ray/v1/rayservice_types.go` and `raycluster_types.go`;
`authOptions` needs KubeRay >= 1.6). Fields outside this table are reported: add them here, after
checking the CRD, before using them.
"""

from __future__ import annotations

import datetime
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
CONFIG_DIR = REPO / "configs"
RAYSERVICE = REPO / "deploy" / "kuberay" / "rayservice.yaml"
PODMONITOR = REPO / "deploy" / "kuberay" / "podmonitor.yaml"
NETWORKPOLICY = REPO / "deploy" / "kuberay" / "networkpolicy.yaml"
CLUSTER_LAUNCHER = REPO / "deploy" / "ray-cluster.yaml"
DOCKERFILE = REPO / "deploy" / "Dockerfile"
PROMETHEUS_CONFIG = REPO / "deploy" / "prometheus" / "prometheus.yml"


def load_docs(path: Path) -> list[dict[str, Any]]:
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    assert docs and all(isinstance(d, dict) for d in docs), f"{path}: expected YAML mappings"
    return docs


def rayservice() -> dict[str, Any]:
    (doc,) = load_docs(RAYSERVICE)
    return doc


def serve_configs() -> dict[str, dict[str, Any]]:
    """Every Serve config we ship: configs/*.yaml and the RayService's serveConfigV2, by label."""
    out = {path.name: yaml.safe_load(path.read_text()) for path in sorted(CONFIG_DIR.glob("*.yaml"))}
    out["rayservice.yaml:serveConfigV2"] = yaml.safe_load(rayservice()["spec"]["serveConfigV2"])
    return out


def pod_templates(service: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """'head' and each worker group's name → its pod template."""
    cluster = service["spec"]["rayClusterConfig"]
    out = {"head": cluster["headGroupSpec"]["template"]}
    out.update({g["groupName"]: g["template"] for g in cluster.get("workerGroupSpecs", [])})
    return out


def ray_container(template: dict[str, Any]) -> dict[str, Any]:
    """KubeRay runs Ray in the first container of a group's pod template."""
    return template["spec"]["containers"][0]


# ---- Kubernetes core types: the official client's models -------------------------------------------
_PRIMITIVES: dict[str, tuple[type, ...]] = {"str": (str,), "int": (int,), "float": (int, float), "bool": (bool,),
                                            "bytes": (str,), "datetime": (str, datetime.datetime),
                                            "date": (str, datetime.date)}
_QUANTITY_MAPS = ("limits", "requests", "capacity", "allocatable")


def _check_quantity(value: Any, path: str) -> list[str]:
    from kubernetes.utils import parse_quantity

    if isinstance(value, bool) or not isinstance(value, str | int | float):
        return [f"{path}: a quantity must be a string or a number, got {value!r}"]
    try:
        parse_quantity(value)
    except ValueError as exc:
        return [f"{path}: invalid quantity {value!r} ({exc})"]
    return []


def check_k8s(data: Any, type_name: str, path: str) -> list[str]:
    """Problems of `data` as the Kubernetes type `type_name`: a client model name such as
    'V1PodTemplateSpec', or the client's 'List[...]' / 'Dict[str, ...]' / 'Optional[...]' / primitives."""
    import kubernetes.client as k8s

    if type_name.startswith("Optional["):
        return [] if data is None else check_k8s(data, type_name[9:-1], path)
    if type_name.startswith("List["):
        if not isinstance(data, list):
            return [f"{path}: expected a list, got {type(data).__name__}"]
        return [e for i, item in enumerate(data) for e in check_k8s(item, type_name[5:-1], f"{path}[{i}]")]
    if type_name.startswith("Dict["):
        if not isinstance(data, dict):
            return [f"{path}: expected a mapping, got {type(data).__name__}"]
        value_type = type_name[5:-1].split(",", 1)[1].strip()
        if path.rsplit(".", 1)[-1] in _QUANTITY_MAPS:
            return [e for k, v in data.items() for e in _check_quantity(v, f"{path}.{k}")]
        return [e for k, v in data.items() for e in check_k8s(v, value_type, f"{path}.{k}")]
    if type_name == "object":  # IntOrString and friends
        return [] if isinstance(data, str | int) and not isinstance(data, bool) else [f"{path}: expected int or string"]
    if type_name in _PRIMITIVES:
        ok = isinstance(data, _PRIMITIVES[type_name]) and (type_name == "bool" or not isinstance(data, bool))
        return [] if ok else [f"{path}: expected {type_name}, got {data!r}"]
    model = getattr(k8s, type_name)
    if not isinstance(data, dict):
        return [f"{path}: expected a {type_name} mapping, got {type(data).__name__}"]
    by_json = {json_key: attr for attr, json_key in model.attribute_map.items()}
    errors = []
    for key, value in data.items():
        if key not in by_json:
            errors.append(f"{path}.{key}: not a field of {type_name}")
        else:
            errors += check_k8s(value, model.openapi_types[by_json[key]], f"{path}.{key}")
    return errors


def to_k8s_model(data: dict[str, Any], type_name: str) -> Any:
    """Deserialize into the client's model (raises ValueError on a missing required field)."""
    import kubernetes.client as k8s

    return k8s.ApiClient()._ApiClient__deserialize(data, type_name)


# ---- RayService (ray.io/v1): the CRD fields we rely on ----------------------------------------------
STR, BOOL, INT32, STR_MAP = "string", "boolean", "int32", "map[string]string"


def k8s_type(name: str) -> str:
    return f"k8s:{name}"


def enum(*values: str) -> tuple[str, ...]:
    return values


def obj(fields: dict[str, Any], required: tuple[str, ...] = ()) -> dict[str, Any]:
    return {"fields": fields, "required": required}


AUTOSCALER_OPTIONS = obj({
    "resources": k8s_type("V1ResourceRequirements"), "image": STR, "imagePullPolicy": enum("Always", "Never", "IfNotPresent"),
    "securityContext": k8s_type("V1SecurityContext"), "idleTimeoutSeconds": INT32,
    "upscalingMode": enum("Default", "Aggressive", "Conservative"), "version": enum("v1", "v2"),
    "env": [k8s_type("V1EnvVar")], "envFrom": [k8s_type("V1EnvFromSource")],
    "volumeMounts": [k8s_type("V1VolumeMount")], "command": [STR], "args": [STR]})
HEAD_GROUP = obj({
    "template": k8s_type("V1PodTemplateSpec"), "headService": k8s_type("V1Service"), "enableIngress": BOOL,
    "resources": STR_MAP, "labels": STR_MAP, "rayStartParams": STR_MAP,
    "serviceType": enum("ClusterIP", "NodePort", "LoadBalancer", "ExternalName")}, required=("template",))
WORKER_GROUP = obj({
    "groupName": STR, "replicas": INT32, "minReplicas": INT32, "maxReplicas": INT32, "idleTimeoutSeconds": INT32,
    "resources": STR_MAP, "labels": STR_MAP, "rayStartParams": STR_MAP, "template": k8s_type("V1PodTemplateSpec"),
    "suspend": BOOL, "numOfHosts": INT32, "priority": INT32},
    required=("groupName", "maxReplicas", "minReplicas", "template"))
RAY_CLUSTER_SPEC = obj({
    "rayVersion": STR, "enableInTreeAutoscaling": BOOL, "autoscalerOptions": AUTOSCALER_OPTIONS,
    "authOptions": obj({"mode": enum("disabled", "token"), "secretName": STR, "enableK8sTokenAuth": BOOL}),
    "headServiceAnnotations": STR_MAP, "headGroupSpec": HEAD_GROUP, "workerGroupSpecs": [WORKER_GROUP],
    "suspend": BOOL}, required=("headGroupSpec",))
RAYSERVICE_SPEC = obj({
    "serveConfigV2": STR, "rayClusterConfig": RAY_CLUSTER_SPEC,
    "upgradeStrategy": obj({"type": enum("NewCluster", "NewClusterWithIncrementalUpgrade", "None")}),
    "rayClusterDeletionDelaySeconds": INT32, "excludeHeadPodFromServeSvc": BOOL,
    "serveService": k8s_type("V1Service"), "suspend": BOOL}, required=("rayClusterConfig",))
RAYSERVICE_CRD = obj({"apiVersion": STR, "kind": STR, "metadata": k8s_type("V1ObjectMeta"), "spec": RAYSERVICE_SPEC},
                 required=("apiVersion", "kind", "metadata", "spec"))


def check_custom(data: Any, spec: Any, path: str) -> list[str]:
    """Problems of `data` against a field table built with obj/enum/k8s_type/STR/..."""
    if isinstance(spec, dict):
        if not isinstance(data, dict):
            return [f"{path}: expected a mapping"]
        errors = [f"{path}.{name}: required" for name in spec["required"] if name not in data]
        for key, value in data.items():
            if key not in spec["fields"]:
                errors.append(f"{path}.{key}: not a field we checked in the CRD")
            else:
                errors += check_custom(value, spec["fields"][key], f"{path}.{key}")
        return errors
    if isinstance(spec, list):
        if not isinstance(data, list):
            return [f"{path}: expected a list"]
        return [e for i, item in enumerate(data) for e in check_custom(item, spec[0], f"{path}[{i}]")]
    if isinstance(spec, tuple):
        return [] if data in spec else [f"{path}: {data!r} is not one of {spec}"]
    if spec.startswith("k8s:"):
        errors = check_k8s(data, spec[4:], path)
        if not errors:
            try:
                to_k8s_model(data, spec[4:])
            except ValueError as exc:
                errors.append(f"{path}: {exc}")
        return errors
    if spec == STR:
        return [] if isinstance(data, str) else [f"{path}: expected a string, got {data!r}"]
    if spec == BOOL:
        return [] if isinstance(data, bool) else [f"{path}: expected true/false, got {data!r}"]
    if spec == INT32:
        ok = isinstance(data, int) and not isinstance(data, bool) and -(2**31) <= data < 2**31
        return [] if ok else [f"{path}: expected an int32, got {data!r}"]
    if spec == STR_MAP:  # e.g. rayStartParams: `num-cpus: 0` (an int) is rejected by the API server
        if not isinstance(data, dict):
            return [f"{path}: expected a mapping"]
        return [f"{path}.{k}: values must be strings, got {v!r}" for k, v in data.items() if not isinstance(v, str)]
    raise AssertionError(f"unknown spec {spec!r}")
