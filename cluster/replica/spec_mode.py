"""Per-request decoding-mode policy: speculative (ReDrafter) or plain, from the replica's load.

Speculation lowers latency per request but spends extra compute per step on draft verification,
so under load a replica falls back to plain decoding. A request may force a mode with the body
extension ``"rdserve": {"mode": "spec" | "plain" | "auto"}`` (see ``cluster.ingress.protocol``).
"""

from __future__ import annotations

from cluster.config import SpeculationConfig

MODES = ("auto", "spec", "plain")


def choose_mode(
    load: int, requested: str | None, cfg: SpeculationConfig, speculative_available: bool,
    per_iteration: bool = False, unavailable: str = "no drafter loaded",
) -> tuple[str, str]:
    """Decide ``("spec" | "plain", reason)`` for one request.

    load: requests the replica holds (running + queued), counting this one, so ``load >= 1``.
    requested: the request's ``rdserve.mode``; None falls back to ``cfg.default_mode``.
    per_iteration: the engine's policy is live (the goodput model, ``speculation.policy: auto``); an ``auto``
    request may then speculate, and the engine decides each iteration whether it drafts (plain at
    high load or while its own acceptance is below break-even).
    A forced ``spec`` without a drafter degrades to plain (the reason says so) rather than failing;
    ``unavailable`` is that reason when speculation is unavailable for another cause.
    """
    mode = requested or cfg.default_mode
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    source = "requested" if requested else "default_mode"
    if not speculative_available:
        return "plain", f"{unavailable} ({source} {mode})"
    if mode == "spec":
        return "spec", f"{source} spec"
    if mode == "plain":
        return "plain", f"{source} plain"
    if per_iteration:
        return "spec", "auto: the goodput model picks plain or a draft-tree shape every iteration " \
                       "(speculation.policy auto)"
    if load <= cfg.spec_max_load:
        return "spec", f"auto: load {load} <= spec_max_load {cfg.spec_max_load}"
    return "plain", f"auto: load {load} > spec_max_load {cfg.spec_max_load}"
