"""Rotary position embedding (RoFormer, arXiv 2104.09864) with Hugging Face ``rope_scaling`` types."""

from __future__ import annotations

import math

import torch


def inv_frequencies(head_dim: int, rope_theta: float, rope_scaling: dict | None) -> torch.Tensor:
    """Inverse frequencies ``[head_dim // 2] float32``.

    Supports ``rope_scaling`` of type ``linear`` and ``llama3`` (as in transformers'
    ``ROPE_INIT_FUNCTIONS``) and none; ``dynamic``/``yarn`` raise ``ValueError``.
    """
    # float32 as in transformers, so that parity holds at long positions
    inv = 1.0 / (rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if not rope_scaling:
        return inv.float()
    kind = rope_scaling.get("rope_type", rope_scaling.get("type"))
    if kind in (None, "default"):
        return inv.float()
    if kind == "linear":
        return (inv / rope_scaling["factor"]).float()
    if kind == "llama3":
        factor = rope_scaling["factor"]
        low = rope_scaling.get("low_freq_factor", 1.0)
        high = rope_scaling.get("high_freq_factor", 4.0)
        old_ctx = rope_scaling["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled).float()
    raise ValueError(f"rope_scaling type {kind!r} is not supported (supported: linear, llama3)")


class RotaryEmbedding(torch.nn.Module):
    """Precomputed cos and signed sin tables (rotate-half convention, as in Hugging Face Llama, with
    the first half of sin negated so :func:`apply_rotary` needs no negation)."""

    def __init__(self, head_dim: int, max_positions: int, rope_theta: float, rope_scaling: dict | None):
        super().__init__()
        inv = inv_frequencies(head_dim, rope_theta, rope_scaling)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv)
        emb = torch.cat([freqs, freqs], dim=-1)
        half = head_dim // 2
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin_signed", torch.cat([-emb[:, :half].sin(), emb[:, half:].sin()], -1),
                             persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin ``[N, 1, D]`` for positions ``[N]`` (looked up once per forward)."""
        return self.cos[positions].unsqueeze(-2).to(dtype), self.sin_signed[positions].unsqueeze(-2).to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[N, heads, D]`` (any heads: queries and keys in one call) with the tables of
    :class:`RotaryEmbedding`: ``x * cos + rotate_half(x) * sin``, the sign of ``rotate_half`` folded
    into ``sin_signed``; bit-identical to the unfolded form since ``(-a) * s == a * (-s)`` exactly."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat([x[..., half:], x[..., :half]], dim=-1) * sin_signed
