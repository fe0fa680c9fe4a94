"""``kubernetes:`` in the rdserve config: what the pods get that a local run does not need.

Pod sizes are requests equal to limits (Guaranteed QoS: an engine's threads are not throttled by a
neighbour's burst). Each engine pod holds exactly one engine replica; the Ray head runs Serve's
controller, the HTTP proxy and the OpenAI ingress, and no engine (``num-cpus: "0"``).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

QUANTITY = r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|k|M|G|T)?$"
"""A Kubernetes memory quantity such as ``16Gi`` (bytes with a binary or decimal suffix)."""


class KubernetesConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    image: str = Field("rdserve:0.1.0", min_length=1, description="serving image (k8s/Dockerfile); "
                       "`rdserve k8s render --image` overrides it")
    namespace: str = Field("rdserve", pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$",
                           description="namespace of every object; `--namespace` overrides it")
    name: str = Field("rdserve", pattern=r"^[a-z]([-a-z0-9]{0,38}[a-z0-9])?$",
                      description="RayService name; prefixes the other objects' names")
    worker_cpus: int = Field(4, ge=1, description="CPU cores of one engine pod; also the engine's torch "
                             "threads when engine.num_threads is null (one replica per pod)")
    worker_memory: str = Field("16Gi", pattern=QUANTITY, description="memory of one engine pod")
    head_cpus: int = Field(2, ge=1, description="CPU cores of the Ray head (Serve controller, proxy, ingress)")
    head_memory: str = Field("8Gi", pattern=QUANTITY, description="memory of the Ray head pod")
    shm_size: str = Field("8Gi", pattern=QUANTITY, description="/dev/shm of every pod (memory emptyDir): "
                          "Ray's object store and NCCL's shared-memory transport")
    models_claim: str | None = Field(None, description="PersistentVolumeClaim mounted read-only at "
                                     "models_mount on every pod, for model/drafter directories not in the "
                                     "image; null = no volume")
    models_mount: str = Field("/models", pattern=r"^/", description="where models_claim is mounted")
    idle_timeout_s: int = Field(120, ge=0, description="an engine pod without a replica for this long is "
                                "removed by the in-tree autoscaler (with Serve autoscaling)")
