"""Offline schemas for the rendered manifests, looked up next to the project: ``../shared/k8s/`` (KubeRay
v1.7.0 JSON schemas, Prometheus Operator CRDs), or ``$RDSERVE_K8S_SCHEMAS``."""

import json
import os
from pathlib import Path

import pytest
import yaml

PROJECT_ROOT = Path(__file__).resolve().parents[4]
SCHEMAS = Path(os.environ.get("RDSERVE_K8S_SCHEMAS", PROJECT_ROOT.parent / "shared" / "k8s"))


def _schema_file(relative: str) -> Path:
    path = SCHEMAS / relative
    if not path.is_file():
        pytest.fail(f"offline Kubernetes schema {relative} not found: expected under {SCHEMAS} (the shared/k8s "
                    "folder next to the project: kuberay/rayservice_v1.json from KubeRay v1.7.0, "
                    "prometheus-operator/monitoring.coreos.com_podmonitors.yaml), or set RDSERVE_K8S_SCHEMAS")
    return path


def strict(schema):
    """``additionalProperties: false`` on every object schema that lists properties and says nothing
    else (kubeconform's openapi2jsonschema transformation), so misspelt fields are rejected."""
    if isinstance(schema, dict):
        out = {k: strict(v) for k, v in schema.items()}
        if "properties" in out and "additionalProperties" not in out and \
                not out.get("x-kubernetes-preserve-unknown-fields"):
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [strict(v) for v in schema]
    return schema


@pytest.fixture(scope="session")
def rayservice_schema() -> dict:
    return json.loads(_schema_file("kuberay/rayservice_v1.json").read_text())


@pytest.fixture(scope="session")
def podmonitor_schema() -> dict:
    crd = yaml.safe_load(_schema_file("prometheus-operator/monitoring.coreos.com_podmonitors.yaml").read_text())
    version = next(v for v in crd["spec"]["versions"] if v["name"] == "v1")
    return strict(version["schema"]["openAPIV3Schema"])
