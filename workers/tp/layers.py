"""Tensor parallelism as a property of layers: shard a loaded Llama in place (gpt-fast ``tp.py``
style; the model file is untouched).

Megatron-LM's scheme (Shoeybi et al., arXiv 1909.08053 Sec. 3), with TensorRT-LLM's ``tp_size``:

* column-parallel ``qkv_proj`` and ``gate_up_proj``: each rank keeps its output rows. Both are
  fused, so each part is sharded on its own: ``q | k | v`` by heads, ``gate | up`` by
  intermediate channels; the local module then holds ``q_local | k_local | v_local`` (resp.
  ``gate_local | up_local``) and the unchanged model code splits it with the local head counts
  (``n_heads``, ``n_kv``) and ``inter``;
* row-parallel ``o_proj`` and ``down_proj`` (:class:`RowParallelLinear`): each rank keeps the
  input columns matching its heads/channels and the partial sums are all-reduced;
* vocabulary-parallel embedding (:class:`VocabParallelEmbedding`): ids outside the rank's vocab
  slice give zeros, then all-reduce;
* vocabulary-parallel LM head (:class:`VocabParallelLMHead`): each rank computes the logits of its
  vocab slice; the leader gathers them.

KV heads (:func:`head_split`): when ``tp_size`` divides ``num_key_value_heads`` the KV heads are
split like the query heads. Otherwise, when ``num_key_value_heads`` divides ``tp_size``, KV heads are
replicated: each rank keeps the one KV head its query heads read (``tp_size / num_key_value_heads``
ranks hold each KV head, in their weights and their KV cache), as vLLM and TensorRT-LLM do.
Any other combination is rejected by :func:`check_tp_size`.

Norms, RoPE and everything after the final norm stay replicated: hidden states are identical on all
ranks after every all-reduce.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from workers.models.config import LlamaConfig
from workers.models.llama import LlamaForCausalLM
from workers.tp.comm import Communicator


def check_tp_size(cfg: LlamaConfig, tp_size: int) -> None:
    """Raises:
        ValueError: when ``tp_size`` does not divide the attention heads or the intermediate size,
            or neither divides the other with the KV heads.
    """
    if tp_size < 1:
        raise ValueError(f"tp_size must be >= 1, got {tp_size}")
    if cfg.num_attention_heads % tp_size:
        raise ValueError(f"tp_size={tp_size} must divide num_attention_heads={cfg.num_attention_heads}")
    if cfg.intermediate_size % tp_size:
        raise ValueError(f"tp_size={tp_size} must divide intermediate_size={cfg.intermediate_size}")
    n_kv = cfg.num_key_value_heads
    if n_kv % tp_size and tp_size % n_kv:
        raise ValueError(
            f"tp_size={tp_size} and num_key_value_heads={n_kv}: one must divide the other "
            "(KV heads are split, or replicated)"
        )


def head_split(n_heads: int, n_kv: int, tp_size: int, rank: int) -> tuple[range, range]:
    """Query heads and KV heads rank ``rank`` keeps (see the module docstring for the rule)."""
    per_rank = n_heads // tp_size
    q = range(rank * per_rank, (rank + 1) * per_rank)
    if n_kv % tp_size == 0:
        per_rank_kv = n_kv // tp_size
        return q, range(rank * per_rank_kv, (rank + 1) * per_rank_kv)
    kv = rank * n_kv // tp_size  # query heads of one rank all read this KV head
    return q, range(kv, kv + 1)


def vocab_split(vocab_size: int, tp_size: int, rank: int) -> tuple[int, int, int]:
    """``(start, end, shard)``: rank ``rank`` owns ids ``[start, end)``; every shard is padded to
    ``shard = ceil(vocab_size / tp_size)`` rows so the gathered logits have equal parts."""
    shard = -(-vocab_size // tp_size)
    start = min(rank * shard, vocab_size)
    return start, min(start + shard, vocab_size), shard


class RowParallelLinear(torch.nn.Linear):
    """``y = all_reduce(x_local @ W_local^T)`` (+ bias once, after the sum).

    weight: ``[out_features, in_features / tp_size]``; x: ``[N, in_features / tp_size]``;
    returns ``[N, out_features]``, identical on every rank.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, comm: Communicator):
        super().__init__(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
        self.weight = torch.nn.Parameter(weight, requires_grad=False)
        if bias is not None:
            self.bias = torch.nn.Parameter(bias, requires_grad=False)
        self.comm = comm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.comm.all_reduce(F.linear(x, self.weight))
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(torch.nn.Module):
    """Embedding of ids ``[...]`` -> ``[..., hidden_size]`` from this rank's rows ``[start, end)``
    (``weight: [shard, hidden_size]``, zero-padded), summed over ranks."""

    def __init__(self, weight: torch.Tensor, start: int, end: int, comm: Communicator):
        super().__init__()
        self.weight = torch.nn.Parameter(weight, requires_grad=False)
        self.start, self.end, self.comm = start, end, comm

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        outside = (ids < self.start) | (ids >= self.end)
        out = F.embedding((ids - self.start).masked_fill(outside, 0), self.weight)
        return self.comm.all_reduce(out.masked_fill_(outside[..., None], 0))


class VocabParallelLMHead(torch.nn.Linear):
    """Logits of this rank's vocab slice, gathered on the leader.

    weight: ``[shard, hidden_size]`` (zero rows pad the last slice). ``forward(hidden [M, H])``
    returns ``[M, vocab_size] float32`` on the leader and ``None`` on the other ranks.
    """

    def __init__(self, weight: torch.Tensor, vocab_size: int, comm: Communicator):
        super().__init__(weight.shape[1], weight.shape[0], bias=False, device="meta")
        self.weight = torch.nn.Parameter(weight, requires_grad=False)
        self.vocab_size, self.comm = vocab_size, comm

    def forward(self, hidden: torch.Tensor) -> torch.Tensor | None:
        logits = self.comm.gather(F.linear(hidden, self.weight).float())
        return None if logits is None else logits[:, : self.vocab_size]


def _rows(w: torch.Tensor, parts: list[tuple[int, int]]) -> torch.Tensor:
    return torch.cat([w[a:b] for a, b in parts]).contiguous()


@torch.no_grad()
def shard_model(model: LlamaForCausalLM, comm: Communicator) -> None:
    """Shard ``model`` in place for rank ``comm.rank`` of ``comm.world_size``.

    Afterwards every attention module has local ``n_heads``/``n_kv``, every MLP a local ``inter``,
    ``model.new_cache`` allocates the local KV heads, ``model.model(cache, batch)`` returns the
    full (replicated) hidden states on every rank and ``model.lm_head(hidden)`` the full logits on
    the leader (``None`` elsewhere). All ranks must run the same calls in the same order.

    Raises:
        ValueError: see :func:`check_tp_size`.
    """
    cfg, tp, rank = model.config, comm.world_size, comm.rank
    check_tp_size(cfg, tp)
    hd = cfg.head_size
    q_heads, kv_heads = head_split(cfg.num_attention_heads, cfg.num_key_value_heads, tp, rank)
    q_size, kv_size = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    qkv_parts = [
        (q_heads.start * hd, q_heads.stop * hd),
        (q_size + kv_heads.start * hd, q_size + kv_heads.stop * hd),
        (q_size + kv_size + kv_heads.start * hd, q_size + kv_size + kv_heads.stop * hd),
    ]
    inter = cfg.intermediate_size // tp
    i0 = rank * inter
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        qkv = attn.qkv_proj
        qkv.weight = torch.nn.Parameter(_rows(qkv.weight, qkv_parts), requires_grad=False)
        if qkv.bias is not None:
            qkv.bias = torch.nn.Parameter(_rows(qkv.bias, qkv_parts), requires_grad=False)
        qkv.out_features = qkv.weight.shape[0]
        attn.n_heads, attn.n_kv = len(q_heads), len(kv_heads)
        o = attn.o_proj
        attn.o_proj = RowParallelLinear(o.weight[:, qkv_parts[0][0] : qkv_parts[0][1]].contiguous(), o.bias, comm)
        gu = mlp.gate_up_proj
        gu.weight = torch.nn.Parameter(
            _rows(gu.weight, [(i0, i0 + inter), (mlp.inter + i0, mlp.inter + i0 + inter)]), requires_grad=False
        )
        gu.out_features = gu.weight.shape[0]
        mlp.down_proj = RowParallelLinear(mlp.down_proj.weight[:, i0 : i0 + inter].contiguous(), None, comm)
        mlp.inter = inter

    start, end, shard = vocab_split(cfg.vocab_size, tp, rank)

    def vocab_rows(w: torch.Tensor) -> torch.Tensor:
        out = w.new_zeros(shard, w.shape[1])
        out[: end - start] = w[start:end]
        return out

    embed = vocab_rows(model.model.embed_tokens.weight)
    head = embed if cfg.tie_word_embeddings else vocab_rows(model.lm_head.weight)
    model.model.embed_tokens = VocabParallelEmbedding(embed, start, end, comm)
    model.lm_head = VocabParallelLMHead(head, cfg.vocab_size, comm)
