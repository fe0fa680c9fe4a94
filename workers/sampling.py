"""The base model's adjusted next-token distribution for a request's sampling parameters."""

from __future__ import annotations

import functools

import torch

from workers.kernels.argmax import argmax_rows

from workers.sampling_params import SamplingParams


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """The argmax of each row of ``logits`` (``[N, V]`` -> ``[N]`` long; ties: the lowest index, as
    ``torch.argmax``; NaN counts as the maximum). On float32 CPU logits with rdserve's C kernels
    loaded, ``workers/kernels/argmax.c`` (the same indices, ~10x faster on a batch of rows); else
    ``max(dim).indices``, about 3x faster than ``argmax(dim)`` on CPU for the vocabulary's width
    (Xeon, 2 threads, 49,152 columns: 21 rows 0.26 against 0.73 ms). Every greedy step takes it."""
    # the tensor is checked first: CUDA or bfloat16 logits never load (or build) the C library
    if logits.dim() == 2 and logits.dtype == torch.float32 and logits.is_cpu and logits.is_contiguous() \
            and logits.shape[1] and (isa := _argmax_isa()) is not None:
        return argmax_rows(isa, logits)
    return logits.max(dim=-1).indices


@functools.cache
def _argmax_isa() -> str | None:
    """The C kernels' build when they load here (the first call decides, for the process), else None."""
    from workers.kernels import build

    try:
        return build.load()
    except build.KernelUnavailable:
        return None


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
        return one_hot.scatter_(-1, greedy_tokens(logits)[:, None], 1.0)
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


_MASK64 = (1 << 64) - 1


def _mix64(x: int) -> int:
    """SplitMix64's finalizer (Steele, Lea, Flood, OOPSLA 2014): a bijection of 64-bit ints whose
    outputs for consecutive inputs pass statistical tests of independence."""
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def keyed_uniform(seed: int, position: int) -> float:
    """The uniform draw in ``[0, 1)`` (53 bits) that picks the token at sequence ``position``
    (0-based index in prompt + output) of a request seeded ``seed`` (any Python int; taken modulo 2^64).

    A draw depends on ``(seed, position)`` alone, not on how many draws came before, so a request's
    sampled tokens do not depend on whether a step drafted, on the tree's shape or on its batch.
    """
    key = _mix64((seed & _MASK64) ^ 0x9E3779B97F4A7C15)
    return (_mix64((key + position * 0x9E3779B97F4A7C15) & _MASK64) >> 11) * 2.0**-53


def sample_keyed(probs: torch.Tensor, draws: list[float]) -> list[int]:
    """Inverse-CDF sampling, one token per row. probs: ``[N, V] float32`` (rows sum to ~1, entries
    >= 0); draws: N uniforms in ``[0, 1)`` (:func:`keyed_uniform`).

    Row i's token is the first index whose cumulative probability (float64) exceeds
    ``draws[i] * total``, so it is distributed exactly as the row for a uniform draw, never a
    zero-probability token, and the same draw on the same row gives the same token.

    Raises:
        RuntimeError: a row with NaN, infinite or negative entries, or no mass (as ``torch.multinomial``
            does: the logits were not a distribution, e.g. after an overflow).
    """
    cdf = probs.double().cumsum(-1)
    totals = cdf[:, -1]  # NaN or inf anywhere in a row makes its total so
    if not (torch.isfinite(totals).all() and (totals > 0).all() and probs.min() >= 0):
        raise RuntimeError("probability tensor contains either inf, nan, element < 0 or a row without mass")
    targets = torch.tensor(draws, dtype=torch.float64, device=probs.device) * totals
    tokens = torch.searchsorted(cdf, targets.unsqueeze(-1), right=True).squeeze(-1).tolist()
    vocab = probs.shape[-1]
    for i, token in enumerate(tokens):
        if token >= vocab:  # the draw rounded up to the total: the last token with mass
            tokens[i] = int(probs[i].nonzero()[-1])
    return tokens
