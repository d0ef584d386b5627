"""deploy/examples/kserve, checked statically: the ConfigMap and the predictor pod it makes
pass kubernetes-validate, kvpilot accepts its settings, and the KServe objects use only the
fields KServe's CRDs have (kserve/kserve at aaac4e294dae2c7b1aa1886447793f3aa1c30912:
config/crd/full/serving.kserve.io_servingruntimes.yaml and ..._inferenceservices.yaml)."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import kubernetes_validate
import yaml

from kvpilot.agent.config.load import validate_config

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "deploy" / "examples" / "kserve"
KUBERNETES_VERSION = "1.30.0"
# The CRDs' properties, copied from the files named above.
SERVING_RUNTIME_SPEC = {
    "affinity",
    "annotations",
    "builtInAdapter",
    "containers",
    "disabled",
    "grpcDataEndpoint",
    "grpcEndpoint",
    "hostIPC",
    "httpDataEndpoint",
    "imagePullSecrets",
    "labels",
    "multiModel",
    "nodeSelector",
    "protocolVersions",
    "replicas",
    "resourceClaims",
    "schedulerName",
    "storageHelper",
    "supportedModelFormats",
    "tolerations",
    "volumes",
    "workerSpec",
}
MODEL_FORMAT = {"autoSelect", "name", "priority", "version"}
# The v1beta1 predictor is a pod spec plus the model; these are the fields the example uses.
PREDICTOR_USED = {"model", "initContainers"}
PREDICTOR_HAS = {"model", "initContainers", "shareProcessNamespace", "serviceAccountName"}
MODEL_HAS = {"modelFormat", "runtime", "args", "resources", "env", "storageUri", "name"}


def _load(name: str) -> dict[str, Any]:
    return dict(yaml.safe_load((EXAMPLE / name).read_text()))


def _pod() -> dict[str, Any]:
    """The predictor pod KServe makes: the runtime's containers and volumes, the
    InferenceService's init container."""
    runtime = _load("servingruntime.yaml")["spec"]
    predictor = _load("inferenceservice.yaml")["spec"]["predictor"]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "llama-predictor"},
        "spec": {
            "initContainers": predictor["initContainers"],
            "containers": runtime["containers"],
            "volumes": runtime["volumes"],
            "hostIPC": runtime["hostIPC"],
        },
    }


def test_the_configmap_and_the_predictor_pod_pass_kubernetes_validate() -> None:
    kubernetes_validate.validate(_load("kvpilot-config.yaml"), KUBERNETES_VERSION, strict=True)
    kubernetes_validate.validate(_pod(), KUBERNETES_VERSION, strict=True)


def test_the_kserve_objects_use_only_fields_their_crds_have() -> None:
    runtime = _load("servingruntime.yaml")
    assert runtime["apiVersion"] == "serving.kserve.io/v1alpha1"
    assert set(runtime["spec"]) <= SERVING_RUNTIME_SPEC and "containers" in runtime["spec"]
    for model_format in runtime["spec"]["supportedModelFormats"]:
        assert set(model_format) <= MODEL_FORMAT
    service = _load("inferenceservice.yaml")
    assert service["apiVersion"] == "serving.kserve.io/v1beta1"
    predictor = service["spec"]["predictor"]
    assert set(predictor) == PREDICTOR_USED and PREDICTOR_USED <= PREDICTOR_HAS
    assert set(predictor["model"]) <= MODEL_HAS
    assert predictor["model"]["runtime"] == runtime["metadata"]["name"]


def test_the_plugin_reaches_vllm_and_kvpilot_watches_it() -> None:
    pod = _pod()["spec"]
    containers = {c["name"]: c for c in pod["containers"]}
    (init,) = pod["initContainers"]
    server = containers["kserve-container"]
    env = {e["name"]: e.get("value") for e in server["env"]}
    plugin_mount = next(m for m in server["volumeMounts"] if m["name"] == "kvpilot-plugin")
    assert env["PYTHONPATH"] == plugin_mount["mountPath"]
    assert [m["name"] for m in init["volumeMounts"]] == ["kvpilot-plugin"]
    assert "--backend=vllm" in server["args"]
    # The plugin and kvpilot come from the release's image.
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert init["image"] == containers["kvpilot"]["image"] == f"ghcr.io/kvpilot/kvpilot:{version}"
    config = validate_config(yaml.safe_load(_load("kvpilot-config.yaml")["data"]["kvpilot.yaml"]))
    assert config.runtime.kind == "attach"
    (watched,) = config.runtime.servers
    assert urlsplit(watched.url).port == int(
        _load("servingruntime.yaml")["spec"]["annotations"]["prometheus.kserve.io/port"]
    )
    assert watched.kvpool_url is not None
    assert urlsplit(watched.kvpool_url).port == int(env["KVPILOT_KVPOOL_PORT"])
    config_volume = next(v for v in pod["volumes"] if v["name"] == "kvpilot-config")
    assert config_volume["configMap"]["name"] == _load("kvpilot-config.yaml")["metadata"]["name"]
