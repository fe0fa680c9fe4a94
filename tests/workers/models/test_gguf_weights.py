"""Serving a model's GGUF quantized blocks (workers/models/gguf_weights.py, gguf_file.py): the file
reader against gguf-py, the row permutation and block layout against the float32 weights
(bit-identical), the engine option, and what is refused or falls back."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
from gguf import GGUFReader
from tiny_gguf import make_tiny_gguf

from workers.engine_builder import load_engine
from workers.kernels import build
from workers.kernels.gguf_blocks import dequantize_panels
from workers.kernels.packed_linear import PackedLinear
from workers.kernels.quant_linear import QuantLinear
from workers.models.gguf_file import GGUFFile
from workers.models.gguf_weights import find_gguf_for, resolve_weights, use_gguf_weights
from workers.models.loader import load_model
from workers.models.pull import default_model_dir, is_complete
from workers.sampling_params import SamplingParams

needs_kernel = pytest.mark.skipif(not build.available(), reason="CPU kernels unavailable here (no C compiler or no AVX2, or RDSERVE_CPU_KERNELS=0)")


@pytest.fixture(scope="module")
def gguf_dir(tiny_model_dirs):
    """The untied MQA tiny model shipped as GGUF (Q4_1 layers, Q8_0 embeddings and LM head)."""
    return tiny_model_dirs["untied_mqa@gguf"]


def test_file_reader_matches_gguf_py(gguf_dir):
    path = gguf_dir / "model.gguf"
    ours, theirs = GGUFFile(path), GGUFReader(str(path))
    assert ours.metadata["general.architecture"] == "llama"
    assert set(ours.tensors) == {t.name for t in theirs.tensors}
    for t in theirs.tensors:
        mine = ours.tensors[t.name]
        assert mine.type == t.tensor_type.name
        assert mine.shape == tuple(int(d) for d in reversed(t.shape))
        assert np.array_equal(mine.data.reshape(-1), np.asarray(t.data).view(np.uint8).reshape(-1))
    with pytest.raises(ValueError, match="not a GGUF file"):
        GGUFFile(gguf_dir / "config.json")


def test_architecture_must_match_the_model(gguf_dir, monkeypatch):
    model = load_model(gguf_dir)
    monkeypatch.setattr(GGUFFile, "__init__", _renamed_arch(GGUFFile.__init__, "gpt2"))
    with pytest.raises(ValueError, match="is a 'gpt2' GGUF file, the model \\(llama\\) needs 'llama'"):
        use_gguf_weights(model, gguf_dir / "model.gguf")


def _renamed_arch(init, arch):
    def patched(self, path):
        init(self, path)
        self.metadata["general.architecture"] = arch
    return patched


@needs_kernel
def test_quantized_layers_equal_the_float32_layers(gguf_dir):
    """Every layer's dequantized blocks (attn_q/attn_k rows un-permuted) equal the float32 weights,
    and each QuantLinear returns the float32 packed kernel's bits."""
    model = load_model(gguf_dir)
    dense = {n: m.weight.detach().clone() for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    report = use_gguf_weights(model, find_gguf_for(gguf_dir))
    assert set(report.quantized) == set(dense) and not report.float32
    assert report.quantized["lm_head"] == "Q8_0" and report.quantized["model.layers.0.mlp.down_proj"] == "Q4_1"
    x = torch.randn(7, model.config.hidden_size)
    for name, w in dense.items():
        layer = model.get_submodule(name)
        assert isinstance(layer, QuantLinear) and torch.equal(layer.weight, w), name
        if w.shape[1] == x.shape[1]:
            assert torch.equal(layer(x), PackedLinear(w)(x)), name


@needs_kernel
def test_engine_serves_gguf_by_default_with_float32_output(gguf_dir):
    """weights auto picks the GGUF blocks; greedy output equals the float32 engine's token for token."""
    gguf_engine = load_engine(str(gguf_dir), None, max_seq_len=128)
    dense_engine = load_engine(str(gguf_dir), None, max_seq_len=128, weights="float32")
    assert gguf_engine.weights is not None and dense_engine.weights is None
    assert isinstance(gguf_engine.model.lm_head, QuantLinear)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    for prompt in ([5, 9, 30], [7] * 40, list(range(3, 60))):
        got = [t for d in gguf_engine.generate(prompt, params, "plain") for t in d.token_ids]
        want = [t for d in dense_engine.generate(prompt, params, "plain") for t in d.token_ids]
        assert got == want and len(got) == 24


@needs_kernel
def test_unsupported_types_are_refused_or_fall_back(tiny_model_dirs, tmp_path):
    path = shutil.copytree(tiny_model_dirs["tied_gqa2"], tmp_path / "m")
    make_tiny_gguf(path, overrides={"blk.1.ffn_down.weight": "Q5_0", "blk.0.attn_output.weight": "F32"})
    with pytest.raises(ValueError, match=r"model.layers.1.mlp.down_proj is stored as Q5_0.*weights 'float32'"):
        use_gguf_weights(load_model(path), path / "model.gguf", strict=True)
    model = load_model(path)
    report = use_gguf_weights(model, path / "model.gguf", strict=False)
    assert report.float32 == {"model.layers.1.mlp.down_proj": "Q5_0", "model.layers.0.self_attn.o_proj": "F32"}
    assert type(model.model.layers[1].mlp.down_proj) is torch.nn.Linear  # packed float32 by the executor
    assert "float32: " in report.summary() and len(report.quantized) == 7
    with pytest.raises(ValueError, match="Q5_0"):
        load_engine(str(path), None, max_seq_len=64, weights="gguf")
    assert load_engine(str(path), None, max_seq_len=64).weights.float32  # auto: served, with float32 fall-backs


def test_where_gguf_cannot_be_served(tiny_model_dirs, gguf_dir, monkeypatch):
    plain_dir = tiny_model_dirs["tied_gqa2"]
    assert resolve_weights("auto", plain_dir, "float32", "cpu", 1) is None
    with pytest.raises(ValueError, match=r"no \*.gguf file"):
        resolve_weights("gguf", plain_dir, "float32", "cpu", 1)
    with pytest.raises(ValueError, match="dtype float32 \\(got bfloat16"):
        resolve_weights("gguf", gguf_dir, "bfloat16", "cpu", 1)
    with pytest.raises(ValueError, match="tp_size 1"):
        resolve_weights("gguf", gguf_dir, "float32", "cpu", 2)
    assert resolve_weights("auto", gguf_dir, "bfloat16", "cpu", 1) is None
    assert resolve_weights("float32", gguf_dir, "float32", "cpu", 1) is None
    with pytest.raises(ValueError, match="weights must be one of"):
        resolve_weights("q4", gguf_dir, "float32", "cpu", 1)
    monkeypatch.setenv("RDSERVE_CPU_KERNELS", "0")
    with pytest.raises(ValueError, match="CPU kernels are unavailable"):
        resolve_weights("gguf", gguf_dir, "float32", "cpu", 1)
    assert resolve_weights("auto", gguf_dir, "float32", "cpu", 1) is None


@needs_kernel
@pytest.mark.skipif(not is_complete(default_model_dir()), reason="needs the default model pulled (`rdserve model pull`; `make test` pulls it first)")
def test_default_model_is_served_from_its_shipped_blocks():
    """SmolLM2-135M-Instruct.Q4_1.gguf: all 210 layer matrices Q4_1 (fused into 120 layers), the tied
    head Q8_0; every dequantized block equals the float32 weights `rdserve model pull` wrote."""
    model = load_model(default_model_dir())
    dense = {n: m.weight.detach().clone() for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    report = use_gguf_weights(model, find_gguf_for(default_model_dir()))
    assert sorted(set(report.quantized.values())) == ["Q4_1", "Q8_0"] and not report.float32
    assert sum(f == "Q4_1" for f in report.quantized.values()) == 120 and report.quantized["lm_head"] == "Q8_0"
    for name, w in dense.items():
        layer = model.get_submodule(name)  # (the tied head's .weight is the embedding: dequantize its blocks)
        assert torch.equal(dequantize_panels(layer.fmt, layer.panels, layer.out_features), w), name
