"""Tensor-parallel model executor: the :class:`~workers.executor.LocalExecutor` interface over
``tp_size`` MPI ranks, so the engine runs unchanged on TP1 or TPn.

The leader (this process, rank 0) takes every decision; each call broadcasts one command
(:mod:`workers.tp.wire`) and then runs the same work as every rank on its own shard
(:class:`~workers.tp.worker.ShardWorker`). Hidden states come back replicated, logits gathered on
the leader.

The ReDrafter draft head runs on the leader only: it needs the leader's (replicated) hidden
states, the input embedding of drafted tokens and the base LM head weight, so the leader keeps
full copies of the embedding and LM head weights besides its shards (:attr:`TPExecutor.embed_weight`,
:attr:`TPExecutor.lm_head_weight`). :meth:`TPExecutor.embed` therefore needs no collective.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
import torch.nn.functional as F

from workers.forward_batch import ForwardBatch
from workers.models.config import LlamaConfig
from workers.models.llama import LlamaForCausalLM
from workers.models.loader import load_model
from workers.tp.comm import RankFailure, process_alive
from workers.tp.launch import start_group
from workers.tp.layers import check_tp_size
from workers.tp.wire import pack
from workers.tp.worker import ShardWorker


class TPExecutor:
    """The model of ``model_path`` split over ``tp_size`` ranks, with a KV cache of ``num_slots``
    slots (plus the trash slot) on every rank (each with its KV heads).

    Args:
        model_path: Hugging Face model directory, loaded by every rank.
        tp_size: number of ranks, this process included.
        num_slots: KV-cache slots.
        dtype: weights and KV cache dtype.
        device: ``"cpu"`` (collectives through MPI) or ``"cuda"`` (through NCCL; rank r on GPU r).
        gpus: with ``"cuda"``, the GPU id of each rank (rank 0's is this process's own, e.g. set by
            Ray); spawned rank r then sees only ``gpus[r]``. None: rank r uses GPU r of what it sees.
        num_threads: torch threads of each non-leader rank (default ``cpu_count // tp_size``, at
            least 1); the leader's threads are left as they are.

        model: the leader's model, already loaded from ``model_path`` (e.g. by the engine); it is
            sharded in place. Default: the leader loads its own.

    Under ``mpiexec -n tp_size``, the constructor does not return on ranks other than 0: they serve
    the leader and exit the process (see :mod:`workers.tp.launch`).

    Raises:
        ValueError: a ``tp_size`` the model cannot be split by (:func:`~workers.tp.layers.check_tp_size`).
        RuntimeError: the ranks could not be started.
        RankFailure: from any call once a rank has died; the executor is then unusable (close it).
    """

    def __init__(self, model_path: str, tp_size: int, num_slots: int, *, dtype: torch.dtype = torch.float32,
                 device: str = "cpu", num_threads: int | None = None, model: LlamaForCausalLM | None = None,
                 gpus: list[str] | None = None, kv_dtype: torch.dtype | None = None):
        self.config: LlamaConfig = LlamaConfig.from_dir(model_path)
        check_tp_size(self.config, tp_size)
        self.tp_size = tp_size
        self.comm = start_group(tp_size, "nccl" if torch.device(device).type == "cuda" else "mpi", gpus)
        self.device = getattr(self.comm, "device", torch.device("cpu"))
        self.dtype = dtype
        self._failure: RankFailure | None = None
        self._closed = False
        try:
            threads = num_threads or max(1, (os.cpu_count() or 1) // tp_size)
            init = {"model_path": str(model_path), "dtype": str(dtype).removeprefix("torch."),
                    "num_slots": num_slots, "num_threads": threads,
                    "kv_dtype": None if kv_dtype is None else str(kv_dtype).removeprefix("torch.")}
            self._broadcast("init", init)
            if model is None:
                model = load_model(model_path, dtype, str(self.device))
            self.embed_weight = model.model.embed_tokens.weight
            self.lm_head_weight = model.lm_head.weight
            self.worker = self._guard(ShardWorker, model, num_slots, self.comm, kv_dtype)
        except BaseException:
            self.close()
            raise

    @property
    def trash_slot(self) -> int:
        return self.worker.cache.trash_slot

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Hidden states ``[N, hidden_size]`` (post final norm) of the batch's packed tokens."""
        self._broadcast("forward", (batch,))
        return self._guard(self.worker.forward, batch)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden: [M, hidden_size]`` -> logits ``[M, vocab_size] float32`` (gathered vocab slices)."""
        self._broadcast("logits", (hidden,))
        return self._guard(self.worker.logits, hidden)

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """KV compaction on every rank: copy all layers' entries at slots ``src`` to ``dst`` (``[K] long``)."""
        self._broadcast("copy_slots", (src, dst))
        self._guard(self.worker.copy_slots, src, dst)

    @torch.inference_mode()
    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Input embeddings ``[..., hidden_size]`` of ids ``[...]`` from the leader's full copy."""
        return F.embedding(ids, self.embed_weight)

    @property
    def failure(self) -> RankFailure | None:
        """The rank failure that made this executor unusable, or None while it is healthy."""
        return self._failure

    def close(self) -> None:
        """Shut the ranks down (after a rank failure: kill the survivors). Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._failure is None:
            try:
                self._broadcast("shutdown", ())
                self.comm.disconnect()
                return
            except RankFailure:
                pass
        for pid in self.comm.pids[1:]:
            if process_alive(pid):
                try:
                    os.kill(pid, 9)
                except ProcessLookupError:
                    pass

    def _broadcast(self, op: str, args) -> None:
        if self._closed and op != "shutdown":
            raise RuntimeError("TPExecutor is closed")
        if self.tp_size > 1:
            self._guard(self.comm.broadcast, (op, pack(args)))

    def _guard(self, fn, *args):
        """Run ``fn``; remember and re-raise a :class:`RankFailure` (every later call raises it too)."""
        if self._failure is not None:
            raise self._failure
        try:
            return fn(*args)
        except RankFailure as e:
            self._failure = e
            raise


def tp_executor_factory(model_path: str, tp_size: int, num_threads: int | None = None,
                        gpus: list[str] | None = None) -> Callable[..., TPExecutor]:
    """``executor_factory(model, num_slots, kv_dtype=None)`` for :class:`workers.engine.Engine`: a
    :class:`TPExecutor` whose leader shards the engine's loaded model (same dtype and device);
    ``gpus`` as in :class:`TPExecutor`."""
    def make(model: LlamaForCausalLM, num_slots: int, kv_dtype: torch.dtype | None = None) -> TPExecutor:
        w = model.lm_head.weight
        return TPExecutor(model_path, tp_size, num_slots, dtype=w.dtype, device=w.device.type,
                          num_threads=num_threads, model=model, gpus=gpus, kv_dtype=kv_dtype)
    return make
