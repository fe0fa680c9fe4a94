"""Llama-family decoder (Llama 2/3, SmolLM2, Qwen2, Mistral without sliding window) in PyTorch.

Written for serving: the new tokens of every scheduled request are packed into one ``[N]``
sequence with explicit positions and KV-cache slots (:class:`~workers.forward_batch.ForwardBatch`),
so every linear layer runs once per iteration and the same forward serves context chunks, plain
decoding and ReDrafter tree verification (tree attention mask, depth-based positions); attention
runs per group of equally long requests. Q/K/V and gate/up projections are fused (as in vLLM and nano-vllm); the loader maps
Hugging Face parameter names onto them. On float32 CPU with the C kernels
(:meth:`LlamaModel.use_cpu_kernels`), the residual adds + RMSNorms, RoPE + KV write and the
attention of decode steps and draft trees run in C (:mod:`workers.kernels`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from workers.forward_batch import AttentionGroup, ForwardBatch
from workers.kernels import decode_attention
from workers.kernels.decode_attention import AttentionPlan
from workers.kernels.decoder import decoder_forward, fused_layers, silu_mul
from workers.kernels.rms_norm import rms_norm
from workers.kv_cache import KVCache
from workers.models.config import LlamaConfig
from workers.models.rope import RotaryEmbedding, apply_rotary


class RMSNorm(torch.nn.Module):
    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)

    def add_forward(self, isa: str, residual: torch.Tensor, delta: torch.Tensor | None = None) -> torch.Tensor:
        """C kernel path (float32 CPU): ``residual += delta`` in place, then the norm of ``residual``
        (:func:`workers.kernels.rms_norm.rms_norm`). residual, delta: ``[N, hidden_size]``."""
        return rms_norm(isa, residual, self.weight, self.eps, delta)


class Attention(torch.nn.Module):
    """Grouped-query attention over the KV cache."""

    def __init__(self, cfg: LlamaConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.n_heads = cfg.num_attention_heads
        self.n_kv = cfg.num_key_value_heads
        self.head_dim = cfg.head_size
        out = (self.n_heads + 2 * self.n_kv) * self.head_dim
        self.qkv_proj = torch.nn.Linear(cfg.hidden_size, out, bias=cfg.attention_bias)
        self.o_proj = torch.nn.Linear(self.n_heads * self.head_dim, cfg.hidden_size, bias=False)

    def forward(self, x, rope: tuple[torch.Tensor, torch.Tensor], cache: KVCache, batch: ForwardBatch,
                masks: list | None = None, isa: str | None = None):
        """x: ``[N, hidden_size]`` packed tokens -> ``[N, hidden_size]``.

        rope: cos and signed sin ``[N, 1, head_dim]`` (:class:`RotaryEmbedding`). masks: per group,
        an additive float mask (:func:`additive_mask`) for SDPA or an
        :class:`~workers.kernels.decode_attention.AttentionPlan` for the C kernel; None to use
        ``group.mask``. isa: the kernel build for RoPE + KV write in C (float32 CPU), or None.
        """
        N = x.shape[0]
        prompt_rows = batch.prefill_rows
        qkv = project(self.qkv_proj, x, prompt_rows)
        if isa is not None:
            q = decode_attention.rope_write_kv(isa, qkv, *rope, batch.slot_mapping, cache.k[self.layer],
                                               cache.v[self.layer], self.n_heads, self.n_kv)
        else:
            q_size, kv_size = self.n_heads * self.head_dim, self.n_kv * self.head_dim
            # queries and keys rotated in one call (elementwise, so bit-identical to two calls)
            qk = apply_rotary(qkv[:, : q_size + kv_size].view(N, self.n_heads + self.n_kv, self.head_dim), *rope)
            q, k = qk[:, : self.n_heads], qk[:, self.n_heads :]
            v = qkv[:, q_size + kv_size :].view(N, self.n_kv, self.head_dim)
            cache.write(self.layer, batch.slot_mapping, k, v)
        groups = batch.groups
        masks = masks or [g.mask for g in groups]
        if len(groups) == 1:
            out = self._attend(q, cache, groups[0], masks[0])
        else:
            out = torch.cat([self._attend(q[g.start : g.start + g.num_tokens], cache, g, m)
                             for g, m in zip(groups, masks)])
        return project(self.o_proj, out, prompt_rows)

    def _attend(self, q, cache: KVCache, group, mask: torch.Tensor | AttentionPlan) -> torch.Tensor:
        """q: ``[batch * seq_len, n_heads, head_dim]`` of one group -> ``[batch * seq_len, n_heads * head_dim]``."""
        if isinstance(mask, AttentionPlan):
            return decode_attention.attend(mask, q, cache.k[self.layer], cache.v[self.layer])
        B, T = group.batch, group.seq_len
        keys, values = cache.read(self.layer, group)
        q = q.view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)
        return out.transpose(1, 2).reshape(B * T, self.n_heads * self.head_dim)


class MLP(torch.nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.inter = cfg.intermediate_size
        self.gate_up_proj = torch.nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = torch.nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x, prompt_rows: int | torch.Tensor = 0, isa: str | None = None):
        """x: ``[N, hidden_size]``; prompt_rows: the rows that are prompt tokens (:func:`project`);
        isa: the kernel build for ``silu * up`` in C (float32 CPU, as :mod:`workers.kernels.decoder`
        computes it), or None for torch's ops."""
        gate_up = project(self.gate_up_proj, x, prompt_rows)
        if isa is not None:
            return project(self.down_proj, silu_mul(isa, gate_up, self.inter), prompt_rows)
        return project(self.down_proj, F.silu(gate_up[..., : self.inter]) * gate_up[..., self.inter :], prompt_rows)


def project(linear: torch.nn.Module, x: torch.Tensor, prompt_rows: int | torch.Tensor) -> torch.Tensor:
    """``linear(x)``; a GGUF-block linear with a prefill weight (``engine.prefill_dtype``:
    :meth:`~workers.kernels.quant_linear.QuantLinear.enable_bf16_prefill`) is told which rows are
    prompt tokens (:attr:`~workers.forward_batch.ForwardBatch.prefill_rows`)."""
    if (isinstance(prompt_rows, torch.Tensor) or prompt_rows) and getattr(linear, "prefill_weight", None) is not None:
        return linear(x, prompt_rows)
    return linear(x)


class DecoderLayer(torch.nn.Module):
    def __init__(self, cfg: LlamaConfig, layer: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, rope, cache, meta, masks=None):
        x = x + self.self_attn(self.input_layernorm(x), rope, cache, meta, masks)
        return x + self.mlp(self.post_attention_layernorm(x), meta.prefill_rows)

    def forward_fused(self, isa: str, residual, h, next_norm: RMSNorm, rope, cache, meta, masks):
        """C kernel path: ``h`` is this layer's normed input, ``residual`` the stream (updated in
        place); returns ``next_norm`` of the stream after this layer, the residual adds fused into
        the norms (as vLLM's fused add + RMSNorm)."""
        h = self.post_attention_layernorm.add_forward(isa, residual, self.self_attn(h, rope, cache, meta, masks, isa))
        return next_norm.add_forward(isa, residual, self.mlp(h, meta.prefill_rows, isa))


class LlamaModel(torch.nn.Module):
    """Decoder stack. ``forward`` returns post-final-norm hidden states ``[B, T, hidden_size]``."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.config = cfg
        self.embed_tokens = torch.nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = torch.nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(
            cfg.head_size, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling
        )
        self.kernel_isa: str | None = None
        self.fused_decoder = True  # with the C kernels: the whole stack in one call when the step allows it

    def use_cpu_kernels(self, isa: str | None) -> bool:
        """Run RMSNorm (fused with the residual adds), RoPE + KV write and decode attention in C
        (:mod:`workers.kernels`, build ``isa``) whenever the forward is float32 on CPU without
        autograd; None restores torch's ops. Returns whether they are used (not for head sizes the
        attention kernel lacks: see :func:`workers.kernels.decode_attention.supports`)."""
        layer = self.layers[0].self_attn if len(self.layers) else None
        ok = layer is not None and decode_attention.supports(layer.head_dim, layer.n_heads, layer.n_kv)
        self.kernel_isa = isa if ok else None
        return self.kernel_isa is not None

    def forward(self, cache: KVCache, batch: ForwardBatch) -> torch.Tensor:
        """Run the decoder on one iteration's packed tokens.

        Args:
            cache: KV cache; new keys/values are written at ``batch.slot_mapping`` before each
                attention group reads its ``kv_slots`` under its mask.
            batch: ``input_ids``, ``positions`` (RoPE positions: prefix length + tree depth for
                draft trees), ``slot_mapping``, all ``[N] long``, and the attention groups.

        Returns:
            hidden: ``[N, hidden_size]`` after the final RMSNorm.
        """
        x = self.embed_tokens(batch.input_ids)
        rope = self.rotary(batch.positions, x.dtype)
        isa = self.kernel_isa
        if isa is not None and (x.dtype != torch.float32 or not x.is_cpu or torch.is_grad_enabled()):
            isa = None
        masks = [attention_input(g, x.dtype, cache, isa) for g in batch.groups]  # once per forward, not per layer
        if isa is None:
            for layer in self.layers:
                x = layer(x, rope, cache, batch, masks)
            return self.norm(x)
        check_slots(batch.slot_mapping, cache)
        layers = fused_layers(self, cache, batch, masks) if self.fused_decoder else None
        if layers is not None:
            h = decoder_forward(self, layers, isa, x, rope, batch, masks)
            if h is not None:
                return h
        h = self.layers[0].input_layernorm.add_forward(isa, x)
        next_norms = [layer.input_layernorm for layer in self.layers[1:]] + [self.norm]
        for layer, next_norm in zip(self.layers, next_norms):
            h = layer.forward_fused(isa, x, h, next_norm, rope, cache, batch, masks)
        return h


def attention_input(group: AttentionGroup, dtype: torch.dtype, cache: KVCache,
                    isa: str | None) -> torch.Tensor | AttentionPlan:
    """What attention needs for ``group`` in every layer: the C kernel's plan when ``isa`` is given
    and the group is short enough (:func:`workers.kernels.decode_attention.plan`), else the
    additive mask for SDPA."""
    plan = decode_attention.plan(isa, group, cache.k[0].shape[0]) if isa is not None and cache.k else None
    return plan if plan is not None else additive_mask(group.mask, dtype)


def check_slots(slot_mapping: torch.Tensor, cache: KVCache) -> None:
    """Raises ValueError when a slot of ``slot_mapping`` ``[N] long`` is outside the cache (the C
    KV write does not check)."""
    if slot_mapping.numel() and (int(slot_mapping.min()) < 0 or int(slot_mapping.max()) > cache.trash_slot):
        raise ValueError(f"slot_mapping outside the KV cache's {cache.trash_slot + 1} slots")


def additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Boolean attention mask -> ``0`` / ``-inf`` of ``dtype``: what ``scaled_dot_product_attention``
    converts a boolean mask to on every call (``convert_boolean_attn_mask``), done once per forward
    for all layers, so attention computes the same values."""
    zero = torch.zeros((), dtype=dtype, device=mask.device)
    return torch.where(mask, zero, torch.full((), float("-inf"), dtype=dtype, device=mask.device))


class LlamaForCausalLM(torch.nn.Module):
    """Decoder plus LM head (tied to the input embedding when ``tie_word_embeddings``)."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg)
        self.lm_head = torch.nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, *args, **kwargs) -> torch.Tensor:
        """Hidden states, see :meth:`LlamaModel.forward`; apply :meth:`logits` to the rows needed."""
        return self.model(*args, **kwargs)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[..., hidden_size] -> [..., vocab_size] float32``."""
        return self.lm_head(hidden).float()

    def new_cache(self, num_slots: int, kv_dtype: torch.dtype | None = None) -> KVCache:
        """A KV cache of ``num_slots`` slots (plus the trash slot) on the model's device, storing
        ``kv_dtype`` (default: the model's dtype; float16 under a float32 model halves it)."""
        cfg = self.config
        p = self.model.embed_tokens.weight
        n_kv = self.model.layers[0].self_attn.n_kv if cfg.num_hidden_layers else cfg.num_key_value_heads
        return KVCache(cfg.num_hidden_layers, num_slots, n_kv, cfg.head_size, kv_dtype or p.dtype, p.device, p.dtype)
