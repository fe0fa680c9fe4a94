"""The ReDrafter draft head (Cheng et al., "Recurrent Drafter for Fast Speculative Decoding in
Large Language Models", arXiv 2403.09919, Sec. 3.1).

RNN state over drafted tokens, ``s_0 = 0``::

    s_t = SiLU(W e(x_{t-1}) + U s_{t-1} + b)        rnn_w: W (no bias), rnn_u: U with bias b

Head input ``concat(h, s_t)`` (``h``: the base model's post-final-norm hidden state at the last
accepted token, ``[2H]`` in all), ``num_draft_layers`` residual blocks ``x + SiLU(Linear(x))`` of
width 2H, then an output layer to the vocabulary. Parameter names are those of Apple's
ml-recurrent-drafter checkpoints (``rnn_u``, ``rnn_w``, ``lm_head.{i}.linear``, ``lm_head.{N}``),
which TensorRT-LLM's ReDrafter converter reads.

Two output layers:

* ``"full"`` (Apple's): ``lm_head.{N}``: Linear(2H -> V, no bias), 2H*V parameters.
* ``"shared"``: ``out_proj``: Linear(2H -> H, no bias), then the base model's (frozen) LM head.
  Far smaller on disk; :meth:`ReDrafter.export_apple_state_dict` folds the projection into the
  head (``W_head @ W_proj``), giving an exactly equivalent Apple-layout ``lm_head.{N}``.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

DRAFT_VOCAB_FILE = "draft_vocab.json"


@dataclass
class DrafterConfig:
    """Shape of a draft head. Keys follow Apple's ``DrafterConfig`` (plus ``head_type``)."""

    vocab_size: int
    hidden_size: int
    num_draft_layers: int = 2
    head_type: str = "shared"
    rnn: bool = True
    model_type: str = "recurrent_drafting_drafter"

    @property
    def exit_dim(self) -> int:
        return 2 * self.hidden_size


class ResBlock(torch.nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.linear = torch.nn.Linear(dim, dim, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.silu(self.linear(x))


class ReDrafter(torch.nn.Module):
    """Draft head. ``base_lm_head`` (``[V, H]``) is required for ``head_type="shared"``."""

    def __init__(self, cfg: DrafterConfig, base_lm_head: torch.Tensor | None = None):
        super().__init__()
        if cfg.head_type not in ("full", "shared"):
            raise ValueError(f"head_type must be 'full' or 'shared', got {cfg.head_type!r}")
        if not cfg.rnn:
            raise ValueError("only rnn=true drafters are supported")
        self.config = cfg
        H, D = cfg.hidden_size, cfg.exit_dim
        self.rnn_u = torch.nn.Linear(H, H, bias=True)
        self.rnn_w = torch.nn.Linear(H, H, bias=False)
        blocks: list[torch.nn.Module] = [ResBlock(D) for _ in range(cfg.num_draft_layers)]
        if cfg.head_type == "full":
            blocks.append(torch.nn.Linear(D, cfg.vocab_size, bias=False))
        else:
            if base_lm_head is None:
                raise ValueError("a 'shared' drafter needs the base model's LM head weight")
            self.out_proj = torch.nn.Linear(D, H, bias=False)
            self.register_buffer("base_lm_head", base_lm_head, persistent=False)
        self.lm_head = torch.nn.Sequential(*blocks)
        self.draft_vocab: torch.Tensor | None = None
        self._draft_head: torch.Tensor | None = None
        self._packed_head = None  # inference only (pack_for_cpu); a plain attribute, not a submodule

    def restrict_vocab(self, token_ids: torch.Tensor | None) -> None:
        """Draft only from ``token_ids`` (``[Vd] long``), or from the whole vocabulary with ``None``.

        The output layer then computes ``Vd`` logits instead of ``V`` (as FR-Spec, arXiv
        2502.14856, does for EAGLE heads): on CPU the vocabulary projection dominates a draft
        step. Verification is unchanged, so decoding stays exact; tokens outside the set are just
        never drafted. ``logits`` then returns ``[..., Vd]`` scores and beam search maps indices
        back through ``draft_vocab``.
        """
        if token_ids is None:
            self.draft_vocab, self._draft_head, self._packed_head = None, None, None
            return
        full = self.base_lm_head if self.config.head_type == "shared" else self.lm_head[-1].weight
        self.draft_vocab = token_ids.to(full.device)
        self._draft_head = full[self.draft_vocab].t().contiguous().t()
        self._packed_head = None

    def step_state(self, prev_state: torch.Tensor, token_embeds: torch.Tensor) -> torch.Tensor:
        """RNN update ``[..., H], [..., H] -> [..., H]`` (Sec. 3.1)."""
        return F.silu(self.rnn_w(token_embeds) + self.rnn_u(prev_state))

    def first_state(self, token_embeds: torch.Tensor) -> torch.Tensor:
        """``step_state`` from the zero state (the first draft step, Sec. 3.1): ``U 0 + b = b``, so
        the recurrent matmul is skipped. ``[..., H] -> [..., H]``."""
        x = self.rnn_w(token_embeds)
        return F.silu(x if self.rnn_u.bias is None else x + self.rnn_u.bias)

    def logits(self, context: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        """Draft logits ``[..., V] float32`` from ``context`` ``[..., H]`` and ``state`` ``[..., H]``."""
        x = torch.cat([context, state], dim=-1)
        if self._draft_head is not None:
            x = self.lm_head[: self.config.num_draft_layers](x)
            if self.config.head_type == "shared":
                x = self.out_proj(x)
            if self._packed_head is not None:
                return self._packed_head(x).float()
            return F.linear(x, self._draft_head).float()
        x = self.lm_head(x)
        if self.config.head_type == "shared":
            x = F.linear(self.out_proj(x), self.base_lm_head)
        return x.float()

    def export_apple_state_dict(self) -> dict[str, torch.Tensor]:
        """State dict in Apple's full layout; for ``shared`` heads ``lm_head.{N} = W_head @ W_proj``."""
        state = {k: v.detach().clone().contiguous() for k, v in self.state_dict().items()}
        if self.config.head_type == "shared":
            proj = state.pop("out_proj.weight")
            n = self.config.num_draft_layers
            state[f"lm_head.{n}.weight"] = (self.base_lm_head.double() @ proj.double()).to(proj.dtype)
        return state

    def save(self, path: str | Path, apple_layout: bool = False) -> None:
        """Write ``config.json`` and ``model.safetensors`` (Apple layout when ``apple_layout``), and
        ``draft_vocab.json`` when the draft vocabulary is restricted."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        cfg = asdict(self.config)
        cfg["exit_dim"] = self.config.exit_dim
        if apple_layout:
            cfg["head_type"] = "full"
            state = self.export_apple_state_dict()
        else:
            state = {k: v.detach().contiguous() for k, v in self.state_dict().items()}
        (path / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        save_file(state, str(path / "model.safetensors"))
        if self.draft_vocab is not None:
            (path / DRAFT_VOCAB_FILE).write_text(json.dumps(self.draft_vocab.tolist()) + "\n")


def pack_for_cpu(drafter: ReDrafter) -> None:
    """Inference on a float32 CPU drafter: its linear layers and draft-vocabulary head run on the
    packed kernels (:mod:`workers.kernels.packed_linear`; no autograd), or get the input-major
    layout where those are unavailable."""
    from workers.kernels.packed_linear import PackedLinear, prepare_cpu_inference

    if prepare_cpu_inference(drafter) and drafter._draft_head is not None:
        object.__setattr__(drafter, "_packed_head", PackedLinear(drafter._draft_head.contiguous()))


def load_drafter(
    path: str | Path, base_lm_head: torch.Tensor | None, dtype=torch.float32, device="cpu", use_draft_vocab: bool = True,
    weight_format: str = "float32",
) -> ReDrafter:
    """Load a drafter directory (ours or Apple's: ``config.json`` + ``model.safetensors``), with its
    ``draft_vocab.json`` restriction when present and ``use_draft_vocab``.

    ``weight_format``: ``"float32"`` (packed float32 kernels on CPU) or ``"Q8_0"`` (a float32 CPU
    drafter's layers re-quantized to GGUF Q8_0 blocks, :mod:`workers.redrafter.quantize`; what the
    engine does when it serves the base model's GGUF blocks).

    Raises:
        FileNotFoundError: missing files. ValueError: shape mismatch with the base model, or an
        unknown ``weight_format``. KernelUnavailable: ``"Q8_0"`` without the CPU kernels.
    """
    if weight_format not in ("float32", "Q8_0"):
        raise ValueError(f"drafter weight_format must be 'float32' or 'Q8_0', got {weight_format!r}")
    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"drafter directory {path} has no config.json")
    raw = json.loads((path / "config.json").read_text())
    cfg = DrafterConfig(
        vocab_size=raw["vocab_size"],
        hidden_size=raw["hidden_size"],
        num_draft_layers=raw["num_draft_layers"],
        head_type=raw.get("head_type", "full"),
        rnn=raw.get("rnn", True),
    )
    if base_lm_head is not None and tuple(base_lm_head.shape) != (cfg.vocab_size, cfg.hidden_size):
        raise ValueError(
            f"drafter {path} expects vocab {cfg.vocab_size} x hidden {cfg.hidden_size}, "
            f"base model has {tuple(base_lm_head.shape)}"
        )
    drafter = ReDrafter(cfg, base_lm_head if cfg.head_type == "shared" else None)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"drafter directory {path} has no *.safetensors")
    state = {}
    for f in files:
        state.update(load_file(str(f)))
    drafter.load_state_dict(state, strict=True)
    drafter = drafter.to(device=device, dtype=dtype).eval().requires_grad_(False)
    vocab_file = path / DRAFT_VOCAB_FILE
    if use_draft_vocab and vocab_file.is_file():
        drafter.restrict_vocab(torch.tensor(json.loads(vocab_file.read_text()), dtype=torch.long))
    if torch.device(device).type == "cpu" and dtype == torch.float32:
        if weight_format == "Q8_0":
            from workers.kernels.packed_linear import prepare_cpu_inference
            from workers.redrafter.quantize import quantize_drafter_for_cpu

            quantize_drafter_for_cpu(drafter)
            prepare_cpu_inference(drafter)  # any layer Q8_0 cannot hold (input width not a multiple of 32)
        else:
            pack_for_cpu(drafter)
    return drafter
