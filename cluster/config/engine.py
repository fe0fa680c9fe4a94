"""The ``engine`` and ``speculation`` sections: the workers' own option models with a server's defaults."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator
from pydantic.fields import FieldInfo

from cluster.config.base import resolve_path
from workers.engine_options import EngineOptions
from workers.speculation.options import SpeculationOptions


def serving_defaults(base: type[BaseModel], name: str, **defaults) -> type[BaseModel]:
    """``base`` (defined in ``workers``) as a config section: unknown keys are errors, and the fields
    in ``defaults`` start at the value a server wants (``field=value``, or ``field=(value,
    description)`` where the meaning of the default differs). Everything else is ``base``'s."""
    namespace: dict = {"__annotations__": {}, "__doc__": base.__doc__, "model_config": ConfigDict(extra="forbid")}
    for field, value in defaults.items():
        value, description = value if isinstance(value, tuple) else (value, None)
        info = base.model_fields[field]
        namespace["__annotations__"][field] = info.annotation
        namespace[field] = FieldInfo.merge_field_infos(info, default=value, **(
            {"description": description} if description else {}))
    return type(name, (base,), namespace)


_Engine = serving_defaults(
    EngineOptions, "_Engine", decode_activations="auto", adaptive_threads=True,
    num_threads=(None, "torch intra-op threads; null = cores / serve.replicas (with autoscaling: cores / "
                 "max_replicas, so a full machine is not oversubscribed). Above the cores of the machine a replica "
                 "starts on, it logs a warning and uses the cores (more threads than cores only contend)"))


class EngineConfig(_Engine):
    """The engine section: :class:`workers.engine_options.EngineOptions` (fields and descriptions
    there) with a server's defaults, and the backend."""

    backend: Literal["torch", "tensorrt_llm"] = Field("torch", description="'torch': rdserve's engine; "
                                                      "'tensorrt_llm': TensorRT-LLM's ReDrafter engines (not wired "
                                                      "into this build yet)")


_Speculation = serving_defaults(SpeculationOptions, "_Speculation", num_beams=4, draft_len_per_beam=4,
                                prompt_lookup_num_tokens=4)


class SpeculationConfig(_Speculation):
    """The speculation section: :class:`workers.speculation.options.SpeculationOptions` (the draft
    tree and the engine's policy) with a server's defaults, and the per-request mode
    (:func:`cluster.replica.spec_mode.choose_mode`). Relative calibration paths resolve against the YAML's folder.

    ``spec_max_load``: under a policy that is not live (fixed, table, off), an ``auto`` request is
    decoded speculatively when the replica's load (requests it holds, running or queued, counting the
    new one) is at most this; above it, plain. 0 turns speculation off for ``auto`` requests.
    """

    default_mode: Literal["auto", "spec", "plain"] = Field(
        "auto", description="a request's mode when it names none (body extension rdserve.mode): 'auto' follows "
        "the policy and spec_max_load, 'spec' and 'plain' force one")
    spec_max_load: int = Field(4, ge=0, description="auto requests speculate while the replica holds at most this "
                               "many (policy fixed/table/off); on a replica whose compute path has a "
                               "by_compute_path table, that table's largest speculating batch size replaces it")

    _resolve_calibration = field_validator("calibration")(resolve_path)

    @field_validator("by_compute_path")
    @classmethod
    def _resolve_path_calibrations(cls, value: dict | None, info: ValidationInfo) -> dict | None:
        if value is None:
            return None
        return {k: v if v.calibration is None else v.model_copy(update={"calibration": resolve_path(v.calibration, info)})
                for k, v in value.items()}
