"""A float32 CPU drafter on GGUF Q8_0 blocks: its linear layers and draft-vocabulary head run on
:class:`~workers.kernels.quant_linear.QuantLinear` (dequantized in registers, float32 activations).

Why: a draft step reads every drafter weight once per drafted position, and on CPU decoding is
bound by memory. The default drafter's float32 weights (two 2H x 2H residual blocks, the 2H -> H
projection, the RNN and the 8,192-row draft head: about 35 MB) cost about 5 ms of a 35 ms
speculative step at 1x2; Q8_0 (8.5 bits per weight) reads a quarter of that.

Exactness: verification does not depend on the drafter, so greedy speculative output stays equal
to plain output whatever the drafter computes; Q8_0 only moves which tokens are proposed (the
acceptance rate). The rows of a ``shared`` head that come from a Q8_0 LM head in a GGUF file
re-quantize to the same blocks (each block's largest value keeps ``|q| = 127``).

Quantization is gguf-py's (``gguf.quants.quantize``, ggml's ``quantize_row_q8_0``).
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)

FORMAT = "Q8_0"


def q8_0_linear(weight: torch.Tensor, bias: torch.Tensor | None = None):
    """float32 ``[N, K]`` weight (K a multiple of 32) -> a :class:`QuantLinear` on its Q8_0 blocks.

    Raises:
        ValueError: K not a multiple of 32. KernelUnavailable: the kernels cannot be loaded.
    """
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    from workers.kernels.quant_linear import QuantLinear

    w = weight.detach().to(torch.float32).contiguous()
    if w.ndim != 2 or w.shape[1] % 32:
        raise ValueError(f"Q8_0 needs a 2-D weight with a multiple of 32 columns, got {tuple(w.shape)}")
    blocks = quantize(w.numpy(), GGMLQuantizationType.Q8_0)
    return QuantLinear(FORMAT, blocks, w.shape[1], None if bias is None else bias.detach())


def quantize_drafter_for_cpu(drafter: torch.nn.Module) -> int:
    """Replace the float32 CPU ``nn.Linear`` layers of a :class:`~workers.redrafter.drafter.ReDrafter`
    (RNN, residual blocks, projection, full head) whose input width is a multiple of 32, and its
    draft-vocabulary head, by Q8_0 :class:`QuantLinear` layers. Inference only. Returns how many
    layers were replaced.

    Raises:
        KernelUnavailable: the kernels cannot be loaded (the caller decides whether to fall back).
    """
    targets = [
        (name, m) for name, m in drafter.named_modules()
        if type(m) is torch.nn.Linear and m.weight.dtype == torch.float32 and m.weight.device.type == "cpu"
        and m.in_features % 32 == 0
    ]
    for name, m in targets:
        parent_name, _, attr = name.rpartition(".")
        parent = drafter.get_submodule(parent_name) if parent_name else drafter
        setattr(parent, attr, q8_0_linear(m.weight, m.bias))
    count = len(targets)
    head = getattr(drafter, "_draft_head", None)
    if head is not None and head.dtype == torch.float32 and head.shape[1] % 32 == 0:
        object.__setattr__(drafter, "_packed_head", q8_0_linear(head))
        count += 1
    return count


def use_int8_activations_in_drafter(drafter: torch.nn.Module) -> int:
    """Put a drafter's Q8_0 layers (:func:`quantize_drafter_for_cpu`), the draft-vocabulary head
    included, on int8 activations (:meth:`~workers.kernels.quant_linear.QuantLinear.
    enable_int8_activations`): at 1x2 its two draft steps then read the draft-vocabulary head's Q8_0
    blocks with integer dot products. Proposals may change slightly; verification does not depend
    on them, so speculative output still equals plain output. Returns how many layers switched."""
    from workers.kernels.quant_linear import QuantLinear
    from workers.models.gguf_weights import use_int8_activations

    count = use_int8_activations(drafter)  # its registered Q8_0 layers
    head = getattr(drafter, "_packed_head", None)  # not a registered module
    if isinstance(head, QuantLinear):
        head.enable_int8_activations()
        count += 1
    return count
