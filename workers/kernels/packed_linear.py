"""``torch.nn.Linear`` with panel-packed float32 weights for CPU decoding (see ``packed_gemm.c``;
the GGUF quantized formats are in :mod:`workers.kernels.quant_linear`).

Decoding streams every weight from memory once per step. For the 2-33 rows of a batched step or a
ReDrafter tree, torch's CPU GEMM costs up to 2x its single-row cost on our machines; the packed
kernel keeps it close to one weight pass (``benchmarks/linear_kernels.py``). It also makes each
row's result independent of the other rows, so greedy speculative decoding reproduces plain
decoding bit for bit.
"""

from __future__ import annotations

import torch

from workers.kernels import build, hugepages

PANEL = 32


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """``[N, K] float32`` -> panels ``[ceil(N / 32), K, 32]`` (``panels[p, k, j] = W[32 p + j, k]``,
    zero rows pad the last panel), on huge pages (:mod:`workers.kernels.hugepages`)."""
    n, k = weight.shape
    padded = torch.nn.functional.pad(weight.detach(), (0, 0, 0, -n % PANEL))
    panels = hugepages.empty((padded.shape[0] // PANEL, k, PANEL), padded.dtype)
    return panels.copy_(padded.view(-1, PANEL, k).transpose(1, 2))


def unpack_weight(panels: torch.Tensor, out_features: int) -> torch.Tensor:
    """Inverse of :func:`pack_weight`: ``[P, K, 32]`` -> ``[out_features, K]`` (a new tensor)."""
    return panels.transpose(1, 2).reshape(-1, panels.shape[1])[:out_features].contiguous()


class PackedLinear(torch.nn.Module):
    """Inference-only ``x @ weight.T + bias`` on float32 CPU tensors: ``[..., K] -> [..., N]``.

    ``weight``: ``[N, K]``; ``bias``: ``[N]`` or None. The module keeps ``weight`` itself when
    ``keep_weight`` (a tied LM head shares it with the input embedding); otherwise only the panels
    are kept and the ``weight`` property returns an unpacked copy.

    Raises:
        ValueError: a weight that is not float32 on CPU. KernelUnavailable: see
            :mod:`workers.kernels.build`.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, keep_weight: bool = False):
        super().__init__()
        if weight.dtype != torch.float32 or weight.device.type != "cpu":
            raise ValueError(f"PackedLinear needs a float32 CPU weight, got {weight.dtype} on {weight.device}")
        self.out_features, self.in_features = weight.shape
        self.register_buffer("panels", pack_weight(weight), persistent=False)
        self.bias = None if bias is None else bias.detach().contiguous()
        self._weight = weight if keep_weight else None
        self.isa = build.load()  # fail here, not in the first forward; the variant stays with the module

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear, keep_weight: bool = False) -> "PackedLinear":
        return cls(linear.weight, linear.bias, keep_weight)

    @property
    def weight(self) -> torch.Tensor:
        return self._weight if self._weight is not None else unpack_weight(self.panels, self.out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # called ~120 times per decoding step: cheap checks, no reshape/view for 2-D contiguous input
        if x.dtype != torch.float32 or not x.is_cpu:
            raise ValueError(f"PackedLinear takes float32 CPU input, got {x.dtype} on {x.device}")
        panels, bias = self._buffers["panels"], self.bias
        if panels.dtype != torch.float32 or not panels.is_cpu or not panels.is_contiguous() or (
                bias is not None and (bias.dtype != torch.float32 or not bias.is_cpu)):
            raise RuntimeError("PackedLinear weights were moved or cast (.to/.half/...); it is float32-CPU only")
        return build.run_linear(build.kernel(self.isa, "rd_linear_packed"), x, panels, bias,
                                self.in_features, self.out_features)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        """``state_dict()`` holds ``weight`` (and ``bias``) as for the ``nn.Linear`` it replaced."""
        destination[prefix + "weight"] = self.weight.detach()
        if self.bias is not None:
            destination[prefix + "bias"] = self.bias

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        """Loads ``weight`` (and ``bias``) as an ``nn.Linear`` would, repacking them."""
        for name in ("weight", "bias") if self.bias is not None else ("weight",):
            if prefix + name not in state_dict:
                missing_keys.append(prefix + name)
        if prefix + "weight" in state_dict:
            w = state_dict[prefix + "weight"].to(torch.float32)
            if tuple(w.shape) != (self.out_features, self.in_features):
                error_msgs.append(f"size mismatch for {prefix}weight: {tuple(w.shape)} vs "
                                  f"{(self.out_features, self.in_features)}")
                return
            self.panels = pack_weight(w)
            if self._weight is not None:
                with torch.no_grad():
                    self._weight.copy_(w)
        if self.bias is not None and prefix + "bias" in state_dict:
            self.bias = state_dict[prefix + "bias"].detach().to(torch.float32).contiguous()

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def pack_linears(module: torch.nn.Module) -> int:
    """Replace every float32 CPU ``nn.Linear`` (exactly that type: tensor-parallel subclasses keep
    their own forward) inside ``module`` by a :class:`PackedLinear`; returns how many.

    A weight shared with another parameter holder (tied embeddings) is kept. Does nothing (returns
    0, after one logged warning) when the kernels are unavailable; see :mod:`workers.kernels.build`.
    """
    targets = [
        (name, m) for name, m in module.named_modules()
        if type(m) is torch.nn.Linear and m.weight.dtype == torch.float32 and m.weight.device.type == "cpu"
    ]
    if not targets or not build.available():
        return 0
    shared = _shared_parameters(module)
    for name, m in targets:
        parent_name, _, attr = name.rpartition(".")
        parent = module.get_submodule(parent_name) if parent_name else module
        setattr(parent, attr, PackedLinear.from_linear(m, keep_weight=id(m.weight) in shared))
    return len(targets)


def _shared_parameters(module: torch.nn.Module) -> set[int]:
    seen: dict[int, int] = {}
    for _, m in module.named_modules(remove_duplicate=False):
        for p in m.parameters(recurse=False):
            seen[id(p)] = seen.get(id(p), 0) + 1
    return {k for k, n in seen.items() if n > 1}


def use_input_major_weights(module: torch.nn.Module) -> None:
    """Store every Linear weight ``[out, in]`` with input-major strides (a transposed view of an
    ``[in, out]`` contiguous tensor).

    Values are unchanged; on CPU, MKL's float32 GEMM for one row and for 4-16 rows runs faster
    with this layout (``benchmarks/linear_kernels.py``). The engine uses it only where the packed
    kernels (:func:`pack_linears`) are unavailable.
    """
    for m in module.modules():
        if isinstance(m, torch.nn.Linear) and m.weight.is_contiguous():
            m.weight.data = m.weight.data.t().contiguous().t()


def prepare_cpu_inference(module: torch.nn.Module) -> bool:
    """Make a float32 CPU module fast for inference: :func:`pack_linears`, or where the kernels
    are unavailable the input-major weight layout torch's GEMM prefers
    (:func:`use_input_major_weights`); and every submodule with a
    ``use_cpu_kernels(isa)`` method (:class:`~workers.models.llama.LlamaModel`: norms, RoPE,
    attention in C) is switched to the kernels when they are available. Returns True when packed.
    Modules in other dtypes or on other devices are left alone (bfloat16 runs on oneDNN/AMX, which
    prefers the row-major layout)."""
    params = list(module.parameters())
    if not params or params[0].dtype != torch.float32 or params[0].device.type != "cpu":
        return False
    packed = pack_linears(module) > 0
    isa = build.load() if build.available() else None
    for m in module.modules():
        if callable(getattr(m, "use_cpu_kernels", None)):
            m.use_cpu_kernels(isa)
    if packed:
        return True
    use_input_major_weights(module)
    return False
