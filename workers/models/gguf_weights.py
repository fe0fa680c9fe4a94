"""Serve a model's linear layers from the GGUF file's quantized blocks (``engine.weights``).

The engine loads the Hugging Face directory (float32, dequantized by ``rdserve model pull``) and then
replaces each linear layer whose GGUF tensors are Q4_1 or Q8_0 by a
:class:`~workers.kernels.quant_linear.QuantLinear` on those blocks as shipped. Norms and the input
embedding lookup stay float32 (identical values: GGUF stores them as F32, or the embedding rows are
the dequantized Q8_0 ones). A fused layer takes its GGUF parts in order (``qkv_proj`` = attn_q,
attn_k, attn_v; ``gate_up_proj`` = ffn_gate, ffn_up); the LM head is ``output.weight``, or
``token_embd.weight`` when tied. For ``general.architecture == "llama"``, llama.cpp's converter
permuted the rows of attn_q and attn_k (interleaved rotary pairs); the same row permutation is
undone here on whole rows of blocks (as transformers' GGUF loader does on floats).

Other tensor types: F32/F16/BF16 linears keep the float32 packed kernel; other quantizations
(Q4_K, Q6_K, ...) are an error with ``weights: gguf`` and fall back to float32 with ``auto``.

Default SmolLM2-135M-Instruct Q4_1 file: every layer linear is Q4_1, the tied head (token_embd) is
Q8_0, norms are F32: nothing falls back.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from workers.kernels.gguf_blocks import FORMATS

log = logging.getLogger(__name__)

WEIGHTS = ("auto", "gguf", "float32")
FLOAT_TYPES = ("F32", "F16", "BF16")
LAYER_PARTS = {
    "self_attn.qkv_proj": ("attn_q", "attn_k", "attn_v"),
    "self_attn.o_proj": ("attn_output",),
    "mlp.gate_up_proj": ("ffn_gate", "ffn_up"),
    "mlp.down_proj": ("ffn_down",),
}


@dataclass
class GGUFReport:
    """What :func:`use_gguf_weights` did: our layer name -> format served (``Q4_1``, ``Q8_0``) or
    the reason it stayed float32."""

    path: Path
    quantized: dict[str, str] = field(default_factory=dict)
    float32: dict[str, str] = field(default_factory=dict)

    def summary(self) -> str:
        counts: dict[str, int] = {}
        for fmt in self.quantized.values():
            counts[fmt] = counts.get(fmt, 0) + 1
        kept = ", ".join(f"{n}: {why}" for n, why in list(self.float32.items())[:4])
        more = f" (+{len(self.float32) - 4} more)" if len(self.float32) > 4 else ""
        return (f"GGUF weights from {self.path.name}: " + ", ".join(f"{c} {f}" for f, c in sorted(counts.items()))
                + (f"; float32: {kept}{more}" if self.float32 else "; nothing falls back to float32"))


def find_gguf_for(model_path: str | Path) -> Path | None:
    """The GGUF file a model directory was converted from: the only ``*.gguf`` inside it, or for the
    default model's directory the shipped file (``workers.models.pull.find_gguf``); else None.

    Raises:
        ValueError: several ``*.gguf`` files in the directory.
    """
    model_path = Path(model_path)
    files = sorted(model_path.glob("*.gguf"))
    if len(files) > 1:
        raise ValueError(f"{model_path} holds several GGUF files ({', '.join(f.name for f in files)}); keep one")
    if files:
        return files[0]
    from workers.models.pull import default_model_dir, find_gguf

    if model_path.resolve() == default_model_dir().resolve():
        return find_gguf()
    return None


def resolve_weights(weights: str, model_path: str | Path, dtype: str, device: str, tp_size: int) -> Path | None:
    """The GGUF file to serve from, or None for float32 weights.

    ``auto``: the model's GGUF (:func:`find_gguf_for`) when the engine runs float32 on CPU with one
    rank and the kernels load, else float32. ``gguf``: that file, or an error saying why not.

    Raises:
        ValueError: an unknown value, or ``gguf`` where it cannot be served (names the reason).
    """
    if weights not in WEIGHTS:
        raise ValueError(f"weights must be one of {WEIGHTS}, got {weights!r}")
    if weights == "float32":
        return None
    why = None
    if dtype != "float32" or not str(device).startswith("cpu"):
        why = f"GGUF weights run on CPU with dtype float32 (got {dtype} on {device})"
    elif tp_size != 1:
        why = f"GGUF weights need tp_size 1 (got {tp_size})"
    gguf = None if why else find_gguf_for(model_path)
    if why is None and gguf is None:
        why = f"no *.gguf file in {model_path} (and it is not the default model's directory)"
    if why is None:
        from workers.kernels import build

        try:
            build.load()
        except build.KernelUnavailable as e:
            why = f"the CPU kernels are unavailable: {e}"
    if why is not None:
        if weights == "gguf":
            raise ValueError(f"engine weights 'gguf': {why}; use weights 'float32'")
        log.info("weights auto: float32 (%s)", why)
        return None
    return gguf


def row_permutation(rows: int, n_head: int) -> np.ndarray:
    """Indices ``perm`` with ``hf_rows = gguf_rows[perm]`` for llama.cpp's permuted attn_q/attn_k
    (``rows = n_head * head_dim``; rotary pairs interleaved in GGUF, halves in Hugging Face)."""
    return np.arange(rows).reshape(n_head, rows // n_head // 2, 2).swapaxes(1, 2).reshape(-1)


def use_gguf_weights(model: torch.nn.Module, path: str | Path, strict: bool = True) -> GGUFReport:
    """Replace the linear layers of a float32 CPU :class:`~workers.models.llama.LlamaForCausalLM`
    by :class:`QuantLinear` on the GGUF file's blocks wherever they are Q4_1/Q8_0.

    Raises:
        ValueError: a tensor missing or shaped unlike the model, an architecture mismatch, or (with
            ``strict``) a quantization other than Q4_1/Q8_0/F32/F16/BF16 (named, with the layer).
        KernelUnavailable: the kernels cannot be loaded.
    """
    from workers.kernels.quant_linear import QuantLinear
    from workers.models.gguf_file import GGUFFile

    path = Path(path)
    file = GGUFFile(path)
    tensors = file.tensors
    arch = file.metadata.get("general.architecture")
    cfg = model.config
    expected = "qwen2" if cfg.model_type == "qwen2" else "llama"  # llama.cpp files Mistral as "llama"
    if arch != expected:
        raise ValueError(f"{path.name} is a {arch!r} GGUF file, the model ({cfg.model_type}) needs {expected!r}")
    report = GGUFReport(path)

    def build_layer(name: str, module: torch.nn.Module, parts: list[tuple[str, int | None]], tied=None):
        found = []
        for tname, n_head in parts:
            t = tensors.get(tname)
            if t is None:
                raise ValueError(f"{path.name} has no tensor {tname} (for {name})")
            found.append((tname, t, n_head))
        types = {t.type for _, t, _ in found}
        rows = sum(t.shape[0] if len(t.shape) > 1 else 1 for _, t, _ in found)
        k = found[0][1].shape[-1]
        if (rows, k) != (module.out_features, module.in_features):
            raise ValueError(f"{path.name}: {'+'.join(p for p, _ in parts)} are [{rows}, {k}], "
                             f"{name} is [{module.out_features}, {module.in_features}]")
        if len(types) == 1 and (fmt := types.pop()) in FORMATS:
            blocks = []
            for _, t, n_head in found:
                data = np.asarray(t.data)
                blocks.append(data[row_permutation(data.shape[0], n_head)] if n_head else data)
            layer = QuantLinear(fmt, np.concatenate(blocks) if len(blocks) > 1 else blocks[0], k,
                                bias=module.bias, tied_weight=tied)
            report.quantized[name] = fmt
            return layer
        kinds = sorted({t.type for _, t, _ in found})
        unsupported = [k_ for k_ in kinds if k_ not in FORMATS + FLOAT_TYPES]
        if unsupported and strict:
            raise ValueError(f"{path.name}: {name} is stored as {'/'.join(kinds)}; GGUF serving supports "
                             f"{', '.join(FORMATS)} (and float linears); use engine weights 'float32' or 'auto'")
        report.float32[name] = "/".join(kinds) if len(kinds) > 1 or unsupported else kinds[0]
        return None

    permute = arch == "llama"
    for i, layer in enumerate(model.model.layers):
        for rel, parts in LAYER_PARTS.items():
            heads = {"attn_q": cfg.num_attention_heads, "attn_k": cfg.num_key_value_heads}
            spec = [(f"blk.{i}.{p}.weight", heads.get(p) if permute else None) for p in parts]
            parent_name, _, attr = rel.rpartition(".")
            parent = layer.get_submodule(parent_name)
            new = build_layer(f"model.layers.{i}.{rel}", getattr(parent, attr), spec)
            if new is not None:
                setattr(parent, attr, new)
    tied = "output.weight" not in tensors
    head = build_layer("lm_head", model.lm_head, [("token_embd.weight" if tied else "output.weight", None)],
                       tied=model.lm_head.weight if tied and cfg.tie_word_embeddings else None)
    if head is not None:
        model.lm_head = head
    log.info("%s", report.summary())
    return report


def use_bf16_prefill(model: torch.nn.Module) -> int:
    """Give every GGUF-block linear of the decoder layers a bfloat16 weight for prompt rows
    (:meth:`~workers.kernels.quant_linear.QuantLinear.enable_bf16_prefill`); the LM head, which
    prefill runs on one row per prompt, keeps its float32 kernel. Returns how many were given one."""
    from workers.kernels.quant_linear import QuantLinear

    n = 0
    for name, module in model.named_modules():
        if isinstance(module, QuantLinear) and not name.endswith("lm_head"):
            module.enable_bf16_prefill()
            n += 1
    return n


def use_int8_activations(model: torch.nn.Module) -> int:
    """Put every GGUF-block linear of ``model`` (decoder layers and LM head) on the int8-activation
    kernel for the rows that do not take the bfloat16 prefill path: decode steps, draft trees,
    recomputed tokens (:meth:`~workers.kernels.quant_linear.QuantLinear.enable_int8_activations`).
    Returns how many. The kernel is the fastest this CPU runs (AVX512-VNNI or AVX2, the same results).
    """
    from workers.kernels.quant_linear import QuantLinear

    layers = [m for m in model.modules() if isinstance(m, QuantLinear)]
    for module in layers:
        module.enable_int8_activations()
    return len(layers)
