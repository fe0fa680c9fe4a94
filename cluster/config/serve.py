"""The ``serve`` and ``observability`` sections: replicas, autoscaling, pools, HTTP, limits, metrics."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BeforeValidator, Field, SecretStr, StrictBool, ValidationInfo, field_validator

from cluster.config.base import _Section
from cluster.config.keys import ApiKeySource, parse_api_keys


class AutoscalingConfig(_Section):
    """Engine replicas scaled by load (``cluster.routing.autoscaling``); Ray Serve applies the bounds and delays.

    The defaults suit a model that loads in tens of seconds: react to a burst within about
    ``upscale_delay_s`` + ``metrics_interval_s``, keep a warm replica through lulls of a few minutes.
    """

    min_replicas: int = Field(1, ge=1, description="never fewer; >= 1 because a cold start (model load, "
                              "tens of seconds) would land in some request's TTFT")
    max_replicas: int = Field(2, ge=1, description="never more; 2 is the smallest bound that scales at all, "
                              "raise it to what the cluster's GPUs or cores can hold")
    target_ongoing_requests: float = Field(
        8.0, gt=0, description="requests per replica (decoding, queued in its engine, or queued in Serve) the "
        "replica count aims at: ceil(total / this). 8 = half of engine.max_batch_size's default 16, so a new "
        "replica is on its way before the first one's batch is full",
    )
    upscale_delay_s: float = Field(10.0, ge=0, description="demand must stay above the current count this long "
                                   "before a replica is added; bursts shorter than this are absorbed by "
                                   "in-flight batching")
    downscale_delay_s: float = Field(300.0, ge=0, description="demand must stay below the current count this "
                                     "long before a replica is stopped; a warm replica outlives short lulls")
    metrics_interval_s: float = Field(
        2.0, gt=0, description="replicas and handles push their stats this often; Serve's default 10 s would "
        "add up to 10 s to every decision (Serve 2.60 marks the field deprecated for env vars it does not read yet)",
    )
    look_back_period_s: float = Field(30.0, gt=0, description="Serve averages each replica's stats over this "
                                      "window (time-weighted mean), smoothing single requests away")
    kv_usage_target: float = Field(0.85, gt=0, le=1, description="with requests waiting in an engine, a mean KV "
                                   "cache usage (0-1) above this adds a replica: the batch cannot grow")
    slo_ttft_ms: float | None = Field(None, gt=0, description="with requests waiting in an engine, a replica's "
                                      "TTFT p90 above this (ms) adds a replica; null = not used")
    graceful_shutdown_timeout_s: float = Field(
        600.0, gt=0, description="a replica being stopped (scale-down, redeploy) first finishes its streams, "
        "for at most this long: 600 s covers a 2048-token completion at a slow 4 tokens/s",
    )

    @field_validator("max_replicas")
    @classmethod
    def _max_at_least_min(cls, value: int, info: ValidationInfo) -> int:
        low = info.data.get("min_replicas")
        if low is not None and value < low:
            raise ValueError(f"must be >= min_replicas ({low})")
        return value

    @field_validator("look_back_period_s")
    @classmethod
    def _window_longer_than_interval(cls, value: float, info: ValidationInfo) -> float:
        interval = info.data.get("metrics_interval_s")
        if interval is not None and value <= interval:
            raise ValueError(f"must be longer than metrics_interval_s ({interval} s): the window must hold "
                             "more than one report")
        return value


class PoolConfig(_Section):
    """One pool of engine replicas in two-pool mode (``serve.pools``)."""

    replicas: int = Field(1, ge=1, description="engine replicas of this pool (a fixed count; unused when "
                          "autoscaling is set)")
    autoscaling: AutoscalingConfig | None = Field(None, description="scale this pool by its load; null = "
                                                  "the fixed replicas")


class PoolsConfig(_Section):
    """Two-pool mode (``cluster.ingress.pools``): ``spec`` replicas always draft with speculation.num_beams x
    speculation.draft_len_per_beam (as a TensorRT-LLM ReDrafter engine, whose shape is built in); ``plain``
    replicas have no drafter. The ingress sends each request to the pool where the goodput model
    (speculation.calibration) expects it to decode fastest."""

    spec: PoolConfig = Field(default_factory=PoolConfig)
    plain: PoolConfig = Field(default_factory=PoolConfig)


class ServeConfig(_Section):
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=1, le=65535)
    replicas: int = Field(1, ge=1, description="engine replicas, one Engine each (a fixed count; unused when "
                          "autoscaling is set)")
    autoscaling: AutoscalingConfig | None = Field(None, description="scale the engine replicas by load; "
                                                  "null = the fixed serve.replicas")
    num_cpus_per_replica: float = Field(1.0, gt=0, description="Ray logical CPUs reserved per engine replica "
                                        "(scheduling only; the engine's threads are engine.num_threads)")
    max_ongoing_requests: int = Field(
        64, ge=1, description="requests admitted to one replica at once (decoding together, or queued in its "
        "engine; they count as its load); beyond this they wait in Serve's queue",
    )
    max_queued_requests: int | None = Field(
        None, ge=1, description="requests waiting in Serve's queue before HTTP 503; null = unbounded"
    )
    pools: PoolsConfig | None = Field(None, description="two-pool mode: a speculative and a plain pool of the "
                                      "same model, each with its replicas/autoscaling (replaces replicas and "
                                      "autoscaling above); null = one pool that speculates per request")
    request_router: Literal["goodput", "pow2"] = Field(
        "goodput", description="how a request picks its replica: 'goodput' (the replica where it is expected "
        "to complete first, from each replica's load, free KV blocks, step time and tokens per step; see "
        "cluster.routing.ranking) or 'pow2' (Ray Serve's default: the shorter queue of two random replicas)",
    )
    prefix_aware_routing: StrictBool = Field(
        True, description="with request_router 'goodput': count the prefill each replica's prefix cache saves "
        "(replicas report hashes of the prompt text they cached; workers.text_prefix), so a repeated "
        "prefix goes where it is cached while that replica's load costs less than the prefill saved")
    api_keys: Annotated[list[SecretStr] | ApiKeySource | None, BeforeValidator(parse_api_keys)] = Field(
        None, description="require 'Authorization: Bearer KEY' on /v1/* (cluster.ingress.auth): a list of keys, or "
        "{env: VAR} / {file: PATH} to read them where the ingress runs; null = no authentication")
    max_request_body_bytes: int | None = Field(
        1 << 20, ge=1024, description="largest request body accepted (bytes); a larger one gets HTTP 413 before it "
        "is parsed (cluster.ingress.body_limit); null = no cap")
    request_timeout_s: float | None = Field(None, gt=0, description="a request still running after this many "
                                            "seconds is aborted: 504, or an error event in a stream; null = no limit")
    drain_timeout_s: float = Field(30.0, gt=0, description="on shutdown (SIGTERM, Ctrl-C) or when Serve stops a "
                                   "replica without autoscaling, requests in flight may finish for this long "
                                   "before they are aborted with an error")
    colocate: StrictBool | Literal["auto"] = Field(
        "auto", description="run the engine inside the ingress replica's process, so a token goes from the engine "
        "thread to the HTTP response without crossing Ray (cluster.replica.colocated): 'auto' = when the application has "
        "exactly one engine replica (serve.replicas 1, no autoscaling, no pools, engine.tp_size 1); true = require "
        "it; false = always a separate engine deployment (EngineReplica) behind the ingress")

    def colocated(self, tp_size: int) -> bool:
        """Whether the engine runs in the ingress's process (see ``colocate``), for an engine of ``tp_size`` ranks."""
        single = self.replicas == 1 and self.autoscaling is None and self.pools is None and tp_size == 1
        return single if self.colocate == "auto" else self.colocate


class ObservabilityConfig(_Section):
    """Metrics (``cluster.observability``): recorded with Ray's metrics API, exported by Ray's metrics agent."""

    enabled: bool = Field(True, description="record rdserve's metrics (false: the engine counts nothing and "
                          "replicas record nothing; Ray's own metrics stay)")
    metrics_port: int = Field(8080, ge=1, le=65535, description="port of Ray's metrics agent (Prometheus text at "
                              "/metrics) on each node started by `rdserve up`")
    metrics_host: Literal["127.0.0.1", "0.0.0.0"] = Field(
        "127.0.0.1", description="where Ray's metrics agent listens under `rdserve up`: 127.0.0.1 keeps it and "
        "every other Ray port (GCS, raylet, workers, agents) on loopback (scrape serve.host:serve.port/metrics, "
        "which proxies it); 0.0.0.0 for a head node that Prometheus or other nodes reach, which opens all of "
        "Ray's ports on every interface too: Ray binds them together, by the node's address (cluster.deploy.local_ray)")
