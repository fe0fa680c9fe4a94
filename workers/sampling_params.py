"""Per-request sampling parameters: a plain dataclass with no torch import, so the HTTP ingress and the
request router can build and carry them without loading the engine (the math is in :mod:`workers.sampling`)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class SamplingParams:
    """Per-request decoding parameters (OpenAI names).

    temperature 0 means greedy (argmax). top_k 0 means no top-k filter. ``stop`` holds stop strings;
    generation also stops at the model's EOS token ids unless ``ignore_eos``.
    """

    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    ignore_eos: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
