"""Write the manifests of one config into a directory, one object per file, applied in name order
(``kubectl apply -f DIR``: the namespace first)."""

from __future__ import annotations

from pathlib import Path

import yaml

from cluster.config import RdserveConfig
from cluster.deploy.k8s.rayservice import namespace_object, pod_monitor, rayservice


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (``serveConfigV2``) as literal blocks, so the embedded Serve config reads as YAML;
    no anchors/aliases (the pods' shared env and volumes are written out in each pod)."""

    def ignore_aliases(self, data) -> bool:
        return True


def _str(dumper: yaml.SafeDumper, value: str):
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style="|" if "\n" in value else None)


_Dumper.add_representer(str, _str)


def dump(obj: dict) -> str:
    return yaml.dump(obj, Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=110)


def manifests(cfg: RdserveConfig, image: str | None = None, namespace: str | None = None) -> dict[str, dict]:
    """``{file name: object}``; ``image``/``namespace`` default to ``kubernetes.image``/``.namespace``.

    Raises:
        ConfigError: see :func:`cluster.deploy.k8s.pods.pod_config`.
    """
    image = image or cfg.kubernetes.image
    namespace = namespace or cfg.kubernetes.namespace
    return {"namespace.yaml": namespace_object(namespace),
            "rayservice.yaml": rayservice(cfg, image, namespace),
            "podmonitor.yaml": pod_monitor(cfg, namespace)}


def write_manifests(objects: dict[str, dict], out: Path, source: str) -> list[Path]:
    """Write each object under ``out`` with a header naming ``source`` (how it was rendered)."""
    out.mkdir(parents=True, exist_ok=True)
    header = f"# Rendered by `{source}`: edit the config and render again (make k8s), not this file.\n"
    paths = []
    for file_name, obj in objects.items():
        path = out / file_name
        path.write_text(header + dump(obj))
        paths.append(path)
    return paths
