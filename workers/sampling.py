"""Sampling parameters and the base model's adjusted next-token distribution."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


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


def adjusted_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution the request samples from: temperature, then top-k, then top-p.

    logits: ``[N, V] float32``. Returns ``[N, V] float32`` probabilities, each row renormalised.
    Greedy (temperature 0) gives a one-hot at ``torch.argmax`` (ties: lowest index). top_k 0 keeps
    all tokens. top_p keeps the smallest set of most likely tokens whose cumulative probability
    reaches top_p (nucleus sampling, Holtzman et al. arXiv 1904.09751), at least one.
    Both filters act on one stable descending sort, so ties keep the lowest token ids.
    """
    if params.greedy:
        one_hot = torch.zeros_like(logits, dtype=torch.float32)
        return one_hot.scatter_(-1, logits.argmax(dim=-1, keepdim=True), 1.0)
    logits = logits.float()
    # no inf/inf at tiny T; and a T below float32's range (e.g. 1e-300) would round to 0 and give 0/0
    temperature = max(params.temperature, torch.finfo(torch.float32).tiny)
    scaled = (logits - logits.amax(dim=-1, keepdim=True)) / temperature
    if params.top_k <= 0 and params.top_p >= 1.0:
        return torch.softmax(scaled, dim=-1)
    sorted_logits, order = torch.sort(scaled, dim=-1, descending=True, stable=True)
    if params.top_k > 0:
        sorted_logits[:, params.top_k :] = float("-inf")
    sorted_probs = torch.softmax(sorted_logits, dim=-1)
    if params.top_p < 1.0:
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs  # [N, V] mass of more likely tokens
        outside = mass_before >= params.top_p
        outside[:, 0] = False
        sorted_probs = sorted_probs.masked_fill(outside, 0.0)
        sorted_probs = sorted_probs / sorted_probs.sum(dim=-1, keepdim=True)
    return torch.zeros_like(sorted_probs).scatter_(-1, order, sorted_probs)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """Draw one token per row. probs: ``[N, V] float32`` -> ``[N] long``."""
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def make_generator(seed: int | None, device: str | torch.device = "cpu") -> torch.Generator:
    """A generator on ``device``, seeded with ``seed`` or, when None, with a fresh random seed."""
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator
