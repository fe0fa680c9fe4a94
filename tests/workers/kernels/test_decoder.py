"""The decoder stack in one C call (workers/kernels/decoder.c) and SwiGLU's silu * up in C: every
forward an engine runs through the fused path returns the same bits, and writes the same KV cache,
as the layer-by-layer path with the same kernels, across plain steps, draft trees, mixed
prompt-chunk + decode iterations (several attention groups), float32, GGUF-block and int8 weights."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from workers.engine_builder import load_engine
from workers.kernels import build
from workers.kernels.decoder import silu_mul
from workers.models import llama
from workers.sampling_params import SamplingParams


@pytest.mark.parametrize("rows,inter", [(1, 8), (3, 64), (5, 1536), (2, 13), (4, 100)])
def test_silu_mul_matches_torch(rows, inter, isa):
    gu = torch.randn(rows, 2 * inter) * 6
    gu[0, :3] = torch.tensor([0.0, -100.0, 100.0])
    got = silu_mul(isa, gu, inter)
    want = (F.silu(gu[:, :inter].double()) * gu[:, inter:].double()).float()
    assert torch.allclose(got, want, rtol=4e-7 * 8, atol=1e-30)
    # far below -87 silu is ~0, never x * exp(-87); NaN stays NaN
    extreme = torch.tensor([[-1e38, -1e30, -90.0, float("nan"), 1e30, 88.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]])
    out = silu_mul(isa, extreme, 8)[0]
    assert out[:3].abs().max() == 0 and out[3].isnan() and out[4] == 1e30 and out[5] == 88.0
    # a value's result does not depend on its row, its position or the width
    assert torch.equal(silu_mul(isa, gu[-1:].contiguous(), inter)[0], got[-1])
    tail = torch.cat([gu[:, :inter][:, 1:], gu[:, inter:][:, 1:]], 1).contiguous()
    assert torch.equal(silu_mul(isa, tail, inter - 1), got[:, 1:])


def test_silu_mul_refuses_bad_input(isa):
    with pytest.raises(ValueError, match=r"silu_mul takes a contiguous float32 \[rows, 8\]"):
        silu_mul(isa, torch.randn(2, 6), 4)
    with pytest.raises(ValueError, match="silu_mul takes"):
        silu_mul(isa, torch.randn(2, 8, dtype=torch.float64), 4)


class ForwardCheck:
    """Wraps LlamaModel.forward: runs each forward layer by layer on a copy of the KV cache, then
    fused on the real one, and compares outputs and caches bit for bit."""

    def __init__(self, monkeypatch):
        self.original = llama.LlamaModel.forward
        self.fused_calls: list[tuple[int, int]] = []  # (rows, groups) of each forward the fused path ran
        self.forwards = 0
        real = llama.decoder_forward

        def counting(model, layers, isa, x, rope, batch, masks):
            h = real(model, layers, isa, x, rope, batch, masks)
            if h is not None:
                self.fused_calls.append((x.shape[0], len(masks)))
            return h

        monkeypatch.setattr(llama, "decoder_forward", counting)
        monkeypatch.setattr(llama.LlamaModel, "forward", lambda model, cache, batch: self.checked(model, cache, batch))

    def checked(self, model, cache, batch):
        saved_k = [t.clone() for t in cache.k]
        saved_v = [t.clone() for t in cache.v]
        model.fused_decoder = False
        want = self.original(model, cache, batch)
        want_k = [t.clone() for t in cache.k]
        want_v = [t.clone() for t in cache.v]
        for t, s in zip(cache.k + cache.v, saved_k + saved_v):
            t.copy_(s)
        model.fused_decoder = True
        got = self.original(model, cache, batch)
        self.forwards += 1
        assert torch.equal(got, want), f"forward {self.forwards}: fused hidden states differ"
        assert all(torch.equal(a, b) for a, b in zip(cache.k + cache.v, want_k + want_v)), "KV cache differs"
        return got


@pytest.mark.parametrize("variant,activations", [("tied_gqa2", "float32"), ("untied_mqa", "float32"),
                                                 ("tied_gqa2@gguf", "float32"), ("untied_mqa@gguf", "int8")])
def test_fused_decoder_equals_layer_by_layer(tiny_model_dirs, trained_drafter_dirs, variant, activations,
                                             monkeypatch):
    if not build.available():
        pytest.skip("CPU kernels unavailable here (no C compiler or no AVX2, or RDSERVE_CPU_KERNELS=0)")
    engine = load_engine(str(tiny_model_dirs[variant]), str(trained_drafter_dirs[variant]), num_beams=2, draft_len_per_beam=3,
                    max_seq_len=256, max_batch_size=4, max_num_tokens=48, max_prefill_chunk=12, tokens_per_block=4,
                    num_kv_blocks=300, decode_activations=activations)
    lm = engine.model.model
    assert lm.kernel_isa is not None
    # The tiny models' norms are all ones: make each distinct, so a mixed-up norm shows. Drawn from a
    # seeded generator: the global one's state depends on the tests before (the session fixtures
    # build models and train drafters, reseeding it, only in the first test that asks for them).
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for layer in lm.layers:
            layer.input_layernorm.weight.uniform_(0.5, 1.5, generator=gen)
            layer.post_attention_layernorm.weight.uniform_(0.5, 1.5, generator=gen)
    check = ForwardCheck(monkeypatch)  # after the engine (and the fixtures' drafter training) exists
    rng = random.Random(7)
    vocab = len(engine.tokenizer)
    pending = [(f"r{i}", [rng.randrange(3, vocab) for _ in range(rng.randint(5, 30))], rng.choice(["spec", "plain"]))
               for i in range(6)]
    done = set()
    step = 0
    while len(done) < len(pending):
        if step % 3 == 0 and step // 3 < len(pending):  # requests arrive while others decode
            rid, prompt, mode = pending[step // 3]
            engine.add_request(rid, prompt, SamplingParams(max_tokens=rng.randint(6, 20)), mode)
        done |= {d.request_id for d in engine.step() if d.finished}
        step += 1
    # Steps of one attention group and several rows without prompt rows, whatever text the steps
    # above produced (with bfloat16 prompt rows, where the CPU has AMX, a step with prompt rows
    # takes the Python path): a draft tree alone, then two plain requests decoding together.
    assert list(engine.generate(pending[0][1], SamplingParams(max_tokens=16, ignore_eos=True), "spec", "tree"))
    for rid in ("b0", "b1"):
        engine.add_request(rid, pending[1][1], SamplingParams(max_tokens=6, ignore_eos=True), "plain")
    while engine.num_unfinished:
        engine.step()
    assert check.forwards >= 20
    assert any(groups > 1 for _, groups in check.fused_calls), "no multi-group forward took the fused path"
    assert any(rows > 1 and groups == 1 for rows, groups in check.fused_calls), "no tree/batch step was fused"
    assert len(check.fused_calls) >= check.forwards // 2


@pytest.mark.parametrize("prefill_dtype", ["float32", "bfloat16"])
def test_layer_table_is_kept_and_rebuilt_when_layers_change(tiny_model_dirs, monkeypatch, prefill_dtype):
    """The C layer table is built once and kept; switching the linears to int8 activations (new
    entry points) rebuilds it, so the C call never runs stale kernels. On each prompt-row path
    (``engine.prefill_dtype``; ``auto`` is bfloat16 where the CPU has AMX tiles, so both are forced
    here): with float32 prompt rows every step, the prompt's included, runs on the table; with
    bfloat16 prompt rows the prompt step takes the Python path (no table: oneDNN's GEMM is not in
    the C call) and every decode step runs on the one kept table."""
    if not build.available():
        pytest.skip("CPU kernels unavailable here (no C compiler or no AVX2, or RDSERVE_CPU_KERNELS=0)")
    from workers.kernels.decoder import LINEAR_KINDS, fused_layers
    from workers.models.gguf_weights import use_int8_activations

    engine = load_engine(str(tiny_model_dirs["tied_gqa2@gguf"]), None, max_seq_len=128, num_kv_blocks=64,
                    decode_activations="float32", prefill_dtype=prefill_dtype)
    assert engine.prefill_dtype == prefill_dtype
    qkv = engine.model.model.layers[0].self_attn.qkv_proj
    tables = []
    monkeypatch.setattr(llama, "fused_layers", lambda *a: tables.append(fused_layers(*a)) or tables[-1])

    def decode(rid):
        return [t for d in engine.generate(list(range(5, 25)), SamplingParams(max_tokens=6, ignore_eos=True), "plain", rid)
                for t in d.token_ids]

    def decode_tables():
        """The tables of one request's steps: the prompt step's first, then the decode steps'."""
        assert len(tables) >= 6
        prompt, steps = tables[0], tables[1:]
        assert steps[0] is not None and all(t is steps[0] for t in steps)
        assert (prompt is steps[0]) if prefill_dtype == "float32" else (prompt is None)
        return steps[0]

    assert decode("a")
    table = decode_tables()
    float32_kinds = {LINEAR_KINDS["rd_linear_q4_1"], LINEAR_KINDS["rd_linear_q8_0"]}
    assert table[0].qkv.kind == LINEAR_KINDS[qkv._entry] and table[0].qkv.kind in float32_kinds
    use_int8_activations(engine.model)
    tables.clear()
    assert decode("b")
    table = decode_tables()
    assert table[0].qkv.kind == LINEAR_KINDS[qkv._entry] and table[0].qkv.kind not in float32_kinds


def test_replaced_weights_and_copies_after_a_fused_step(tiny_model_dirs, trained_drafter_dirs, monkeypatch):
    """Weights replaced after the first fused step (a norm's storage swapped with ``.data =``, a
    projection's bias replaced by a new Parameter) are read from their new memory: every later
    forward still equals the layer-by-layer one. The model stays copyable and picklable."""
    import copy
    import io

    if not build.available():
        pytest.skip("CPU kernels unavailable here (no C compiler or no AVX2, or RDSERVE_CPU_KERNELS=0)")
    engine = load_engine(str(tiny_model_dirs["tied_gqa2"]), str(trained_drafter_dirs["tied_gqa2"]), num_beams=2,
                    draft_len_per_beam=2, max_seq_len=128, num_kv_blocks=64)
    lm = engine.model.model
    params = SamplingParams(max_tokens=6, ignore_eos=True)

    def decode(rid, mode):
        return [t for d in engine.generate(list(range(5, 25)), params, mode, rid) for t in d.token_ids]

    decode("warm", "spec")
    copy.deepcopy(engine.model)
    torch.save(engine.model, io.BytesIO())
    check = ForwardCheck(monkeypatch)
    hidden = lm.layers[0].input_layernorm.weight.shape[0]
    with torch.no_grad():
        lm.layers[1].post_attention_layernorm.weight.data = torch.full((hidden,), 3.0)
        qkv = lm.layers[0].self_attn.qkv_proj
        qkv.bias = torch.nn.Parameter(torch.randn(qkv.out_features))
    decode("a", "spec")
    decode("b", "plain")
    assert check.forwards >= 8 and len(check.fused_calls) >= check.forwards - 2
