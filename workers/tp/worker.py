"""One rank's share of a tensor-parallel replica: the sharded model and its KV-cache shard.

Every rank, the leader included, owns a :class:`ShardWorker` and runs the same method with the
same arguments in the same order; the collectives inside the sharded layers pair up across ranks.
Only the leader keeps the results (hidden states are replicated; logits are gathered on it).
"""

from __future__ import annotations

import torch

from workers.forward_batch import ForwardBatch
from workers.models.llama import LlamaForCausalLM
from workers.kernels.packed_linear import prepare_cpu_inference
from workers.tp.comm import Communicator
from workers.tp.layers import shard_model


class ShardWorker:
    """Shards ``model`` (loaded unsharded, on this rank's device) in place and allocates its KV cache:
    ``num_slots`` slots plus the trash slot, with this rank's KV heads.

    Raises:
        ValueError: see :func:`workers.tp.layers.check_tp_size`.
    """

    def __init__(self, model: LlamaForCausalLM, num_slots: int, comm: Communicator,
                 kv_dtype: torch.dtype | None = None):
        shard_model(model, comm)
        prepare_cpu_inference(model)
        self.model, self.comm = model, comm
        self.cache = model.new_cache(num_slots, kv_dtype)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Hidden states ``[N, hidden_size]`` of the batch's packed tokens (replicated on all ranks)."""
        hidden = self.model(self.cache, batch)
        self.comm.synchronize()
        return hidden

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """``hidden: [M, hidden_size]`` -> ``[M, vocab_size] float32`` on the leader, ``None`` elsewhere."""
        logits = self.model.lm_head(hidden)
        self.comm.synchronize()
        return logits

    @torch.inference_mode()
    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy this rank's KV heads of every layer from slots ``src`` to ``dst`` (``[K] long``)."""
        self.cache.copy_slots(src, dst)
