"""The model executor: what the engine calls to run the base model on one replica.

:class:`LocalExecutor` runs the whole model in this process (TP1). The tensor-parallel executor
(:mod:`workers.tp`) has the same methods and runs the same calls on every rank of an MPI group, so
the engine (scheduler, runner, drafter, sampling) never knows how many ranks there are.
"""

from __future__ import annotations

import torch

from workers.forward_batch import ForwardBatch
from workers.kernels.packed_linear import prepare_cpu_inference
from workers.models.llama import LlamaForCausalLM


class LocalExecutor:
    """One model and its KV cache of ``num_slots`` slots (plus a trash slot) in this process.

    A float32 CPU model's linear layers are swapped in place for the packed kernels, or given the
    input-major layout where those are unavailable
    (:func:`workers.kernels.packed_linear.prepare_cpu_inference`).
    """

    def __init__(self, model: LlamaForCausalLM, num_slots: int, kv_dtype: torch.dtype | None = None):
        self.model = model
        self.config = model.config
        self.device = model.lm_head.weight.device
        self.dtype = model.lm_head.weight.dtype
        prepare_cpu_inference(model)
        self.cache = model.new_cache(num_slots, kv_dtype)

    @property
    def trash_slot(self) -> int:
        return self.cache.trash_slot

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Hidden states ``[N, hidden_size]`` (post final norm) of the batch's packed tokens."""
        return self.model(self.cache, batch)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden: [M, hidden_size]`` -> logits ``[M, vocab_size] float32``."""
        return self.model.logits(hidden)

    @torch.inference_mode()
    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """KV compaction: copy every layer's entries at slots ``src`` to ``dst`` (``[K] long``)."""
        self.cache.copy_slots(src, dst)

    @torch.inference_mode()
    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Input embeddings ``[..., hidden_size]`` of token ids ``[...]`` (the drafter's ``e``)."""
        return self.model.model.embed_tokens(ids)

    @property
    def embed_weight(self) -> torch.Tensor:
        """The input embedding table ``[vocab_size, hidden_size]`` (what :meth:`embed` gathers from)."""
        return self.model.model.embed_tokens.weight

    @property
    def failure(self) -> None:
        """A single process has no ranks that can fail (see ``TPExecutor.failure``)."""
        return None

    def close(self) -> None:
        """Nothing to release for a single process."""
