"""Greedy ReDrafter decoding is lossless: speculative output is token-identical to plain output.

Stops (EOS, stop strings, max_tokens) may fall inside a step's block of accepted draft tokens; the
engine must cut there exactly as plain decoding does. Drafters are self-distilled on the tiny
models (``make_trained_tiny_drafter_dir``), so multi-token blocks are frequent; the tests assert
that they occurred, so none passes vacuously.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from functools import lru_cache

import pytest
import torch

from tiny_gguf import weights_variant
from workers.engine import Engine
from workers.engine_builder import load_engine
from workers.outputs import GenerationDelta
from workers.kernels import build
from workers.redrafter.drafter import DrafterConfig, ReDrafter
from workers.sampling_params import SamplingParams

VARIANTS = ("tied_gqa2", "untied_mqa")


@dataclass
class Run:
    """One request's output and, per step, how many draft tokens were accepted / emitted."""

    text: str
    token_ids: list[int]
    finish_reason: str | None
    completion_tokens: int
    step_accepted: list[int]  # accepted draft tokens of each generation step
    step_emitted: list[int]  # output tokens of each generation step (after the stop cut)


def run(engine: Engine, prompt: list[int], params: SamplingParams, mode: str) -> Run:
    """Generate, checking the stream invariants of :class:`GenerationDelta`."""
    deltas: list[GenerationDelta] = list(engine.generate(prompt, params, mode))
    assert [d.finished for d in deltas].count(True) == 1 and deltas[-1].finished
    tokens = [t for d in deltas for t in d.token_ids]
    final = deltas[-1]
    assert final.completion_tokens == len(tokens)
    assert final.prompt_tokens == len(prompt)
    text = "".join(d.text for d in deltas)
    content = tokens[:-1] if final.finish_reason == "stop" and tokens[-1] in engine.eos_token_ids else tokens
    reference = engine.tokenizer.decode(content, skip_special_tokens=True)
    stop_at = min((i for i in (reference.find(s) for s in params.stop) if i >= 0), default=None)
    if stop_at is not None:
        reference = reference[:stop_at]
    # Streamed text is never taken back: it is the decoded output cut at the stop. Random models
    # emit invalid UTF-8 (lone lead bytes), whose U+FFFD is final text and may be streamed.
    assert text == reference or text == reference.rstrip("\ufffd")
    if "\ufffd" not in reference:
        assert not any("\ufffd" in d.text for d in deltas)
    accepted = [b.accepted_draft_tokens - a.accepted_draft_tokens for a, b in zip(deltas, deltas[1:])]
    if mode == "plain":
        assert final.accepted_draft_tokens == 0
    return Run(text, tokens, final.finish_reason, final.completion_tokens,
               accepted, [len(d.token_ids) for d in deltas[1:]])


def assert_same(spec: Run, plain: Run, context: str) -> None:
    got = (spec.text, spec.token_ids, spec.finish_reason, spec.completion_tokens)
    want = (plain.text, plain.token_ids, plain.finish_reason, plain.completion_tokens)
    assert got == want, context


@pytest.fixture(scope="module")
def engines(tiny_model_dirs, trained_drafter_dirs):
    """``engines(variant, num_beams, draft_len_per_beam, lookup_tokens=0, lookup_min=2, lookup_max_tokens=None,
    draft_search="beam") -> Engine``, cached."""

    @lru_cache(maxsize=None)
    def make(variant: str, num_beams: int, draft_len: int, lookup_tokens: int = 0, lookup_min: int = 2,
             lookup_max_tokens: int | None = None, draft_search: str = "beam") -> Engine:
        engine = load_engine(str(tiny_model_dirs[variant]), str(trained_drafter_dirs[variant]),
                        num_beams=num_beams, draft_len_per_beam=draft_len, max_seq_len=256,
                        prompt_lookup_num_tokens=lookup_tokens, prompt_lookup_min=lookup_min, prompt_lookup_max=3,
                        prompt_lookup_max_num_tokens=lookup_max_tokens, draft_search=draft_search)
        assert (engine.weights is not None) == variant.endswith("@gguf")  # GGUF blocks served by default
        # and then the drafter drafts on Q8_0 blocks (workers/redrafter/quantize.py)
        assert (type(engine.drafter.rnn_u).__name__ == "QuantLinear") == variant.endswith("@gguf")
        # norms, RoPE + KV write and decode attention run in C wherever the linear kernels do
        assert (engine.executor.model.model.kernel_isa is not None) == build.available()
        return engine

    return make


def random_prompt(rng: random.Random, vocab: int, max_len: int = 100) -> list[int]:
    return [rng.randrange(3, vocab) for _ in range(rng.randint(1, max_len))]


def random_shape(rng: random.Random) -> dict:
    """Engine options of a random case: a tree of 1-4 x 1-4, with or without a 4-token lookup beam."""
    return dict(num_beams=rng.randint(1, 4), draft_len_per_beam=rng.randint(1, 4),
                prompt_lookup_num_tokens=rng.choice([0, 4]), prompt_lookup_min=1, max_seq_len=256)


def stop_strings(text: str) -> list[str]:
    """Substrings of length 1-3 at every offset of ``text``, without U+FFFD (random models emit
    invalid UTF-8; its replacement character is withheld text, not a stop-string candidate)."""
    subs = {text[i : i + k] for k in (1, 2, 3) for i in range(len(text) - k + 1)}
    return sorted(s for s in subs if "\ufffd" not in s)


@pytest.mark.parametrize("weights", ["float32", "gguf"])
def test_greedy_spec_matches_plain_over_random_cases(engines, weights):
    """36 random cases: beam shapes 1-8 x 1-6, beam search and distinct first tokens, prompt lengths
    1-100, max_tokens, EOS, stop strings; on float32 weights and on GGUF Q4_1/Q8_0 blocks."""
    multi_token_steps = 0
    for case in range(36):
        rng = random.Random(case)
        variant = weights_variant(VARIANTS[case % 2], weights)
        engine = engines(variant, rng.randint(1, 8), rng.randint(1, 6), draft_search=("beam", "distinct_first")[case % 4 >= 2])
        prompt = random_prompt(rng, len(engine.tokenizer))
        params = SamplingParams(max_tokens=rng.randint(1, 60))
        plain = run(engine, prompt, params, "plain")
        stops = stop_strings(plain.text)
        if case % 3 == 0 and stops:  # a stop string taken from the plain output
            params = SamplingParams(max_tokens=params.max_tokens, stop=(rng.choice(stops),))
            plain = run(engine, prompt, params, "plain")
        spec = run(engine, prompt, params, "spec")
        assert_same(spec, plain, f"case {case}: {variant} beams={engine.speculation.num_beams} "
                                 f"draft_len={engine.speculation.draft_len_per_beam} {engine.speculation.draft_search} "
                                 f"params={params}")
        multi_token_steps += sum(a >= 2 for a in spec.step_accepted)
    assert multi_token_steps >= 20, "the drafter was rarely accepted; the comparison is weak"


@pytest.mark.parametrize("weights", ["float32", "gguf"])
def test_greedy_spec_with_prompt_lookup_matches_plain(engines, weights):
    """A prompt-lookup beam longer than the ReDrafter beams joins every tree: 24 random cases whose
    prompts repeat a phrase (shapes 1-4 x 1-3, lookup beams of 2-6 tokens matched on 1- to 3-grams,
    half of them growing up to 16 tokens, max_tokens, stop strings). Steps that accept more tokens
    than ``draft_len_per_beam`` could only take the lookup beam, and steps that accept more than the
    initial lookup length only a grown one; both must occur, so the test is not vacuous."""
    lookup_steps = grown_steps = 0
    for case in range(24):
        rng = random.Random(1000 + case)
        variant = weights_variant(VARIANTS[case % 2], weights)
        draft_len = rng.randint(1, 3)
        lookup = rng.randint(draft_len + 1, 6)
        engine = engines(variant, rng.randint(1, 4), draft_len, lookup, rng.randint(1, 2), 16 if case % 2 else None)
        vocab = len(engine.tokenizer)
        phrase = random_prompt(rng, vocab, 8)
        prompt = random_prompt(rng, vocab, 30) + phrase * rng.randint(2, 4) + phrase[: rng.randint(0, len(phrase))]
        params = SamplingParams(max_tokens=rng.randint(1, 60))
        plain = run(engine, prompt, params, "plain")
        stops = stop_strings(plain.text)
        if case % 3 == 0 and stops:
            params = SamplingParams(max_tokens=params.max_tokens, stop=(rng.choice(stops),))
            plain = run(engine, prompt, params, "plain")
        spec = run(engine, prompt, params, "spec")
        assert_same(spec, plain, f"case {case}: {variant} draft_len={draft_len} lookup={engine.lookup} params={params}")
        lookup_steps += sum(a > draft_len for a in spec.step_accepted)
        grown_steps += sum(a > lookup for a in spec.step_accepted)
    assert lookup_steps >= 10, f"only {lookup_steps} steps took the lookup beam past the drafter's depth"
    assert grown_steps >= 3, f"only {grown_steps} steps took a grown lookup beam"


def test_greedy_spec_stops_at_eos(engines, tiny_model_dirs):
    """EOS ends spec and plain output at the same token, also inside an accepted block.

    The tiny models rarely choose an EOS id, so the EOS set is widened to a token the plain output
    emits mid-way (an engine attribute; the stopping code reads it per request).
    """
    engine = engines("tied_gqa2", 4, 4)
    rng = random.Random(7)
    checked = 0
    for _ in range(6):
        prompt = random_prompt(rng, len(engine.tokenizer), 30)
        free = run(engine, prompt, SamplingParams(max_tokens=40, ignore_eos=True), "plain")
        eos = free.token_ids[len(free.token_ids) // 2]
        original = engine.eos_token_ids
        engine.eos_token_ids = original | {eos}
        try:
            plain = run(engine, prompt, SamplingParams(max_tokens=40), "plain")
            spec = run(engine, prompt, SamplingParams(max_tokens=40), "spec")
        finally:
            engine.eos_token_ids = original
        assert plain.finish_reason == "stop" and plain.token_ids[-1] == eos
        assert plain.token_ids == free.token_ids[: len(plain.token_ids)]
        assert_same(spec, plain, f"eos={eos} prompt={prompt}")
        checked += 1
    assert checked == 6


@pytest.mark.parametrize("variant", [*VARIANTS, "tied_gqa2@gguf"])
def test_stops_inside_accepted_blocks(engines, variant):
    """Stop strings at every offset of the plain text (lengths 1-3, also across token boundaries)
    and max_tokens at every value 1..N give identical spec and plain results."""
    engine = engines(variant, 4, 5)
    rng = random.Random(11)
    n = 40
    cut_blocks = 0  # spec runs whose last step accepted >= 2 drafts and was cut by the stop
    accepted = 0
    used = 0
    for _ in range(12):
        prompt = random_prompt(rng, len(engine.tokenizer), 40)
        full = run(engine, prompt, SamplingParams(max_tokens=n, ignore_eos=True), "plain")
        stops = stop_strings(full.text)
        if used == 3 or len(stops) < 5:  # text that is all special tokens or invalid UTF-8
            continue
        used += 1
        cases = [SamplingParams(max_tokens=n, ignore_eos=True, stop=(s,)) for s in stops]
        cases += [SamplingParams(max_tokens=m, ignore_eos=True) for m in range(1, n + 1)]
        for params in cases:
            plain = run(engine, prompt, params, "plain")
            spec = run(engine, prompt, params, "spec")
            assert_same(spec, plain, f"{variant}: {params}")
            assert plain.token_ids == full.token_ids[: len(plain.token_ids)]
            last_accepted = spec.step_accepted[-1] if spec.step_accepted else 0
            accepted += sum(spec.step_accepted)
            if last_accepted >= 2 and spec.step_emitted[-1] <= last_accepted:
                cut_blocks += 1
    assert used == 3
    assert accepted >= 50
    # The untied model's varied text is harder to draft; the tied one must cut accepted blocks.
    assert cut_blocks >= (2 if variant.startswith("tied_gqa2") else 0), f"only {cut_blocks} stops fell inside a multi-token accepted block"


def test_trained_drafter_accepts_several_tokens_per_step(engines):
    """Held-out random prompts: the self-distilled drafter gives clearly more than 1.5 tokens/step."""
    engine = engines("tied_gqa2", 4, 4)
    rng = random.Random(1234)
    steps = accepted = 0
    for _ in range(12):
        prompt = random_prompt(rng, len(engine.tokenizer), 30)
        *_, last = engine.generate(prompt, SamplingParams(max_tokens=40, ignore_eos=True), "spec")
        steps += last.num_steps
        accepted += last.accepted_draft_tokens
    assert (steps + accepted) / steps > 1.8


@pytest.mark.slow
@pytest.mark.parametrize("weights", ["gguf", "float32"])
def test_greedy_spec_matches_plain_on_default_model(tmp_path, weights):
    """SmolLM2-135M-Instruct (its shipped Q4_1 blocks, and dequantized) with the committed drafter
    (else a random ``shared`` one): 3 chat prompts x 48 tokens."""
    from pathlib import Path

    import torch

    from workers.models.loader import load_model
    from workers.models.pull import pull_default

    model_dir = pull_default()
    drafter_dir = Path(__file__).resolve().parents[2] / "workers" / "drafters" / "smollm2-135m-instruct"
    if not drafter_dir.is_dir():
        base = load_model(model_dir)
        cfg = base.config
        torch.manual_seed(0)
        drafter = ReDrafter(DrafterConfig(cfg.vocab_size, cfg.hidden_size, 2, "shared"),
                            base.lm_head.weight.detach().clone())
        drafter_dir = tmp_path / "drafter"
        drafter.save(drafter_dir)
    engine = load_engine(str(model_dir), str(drafter_dir), num_beams=4, draft_len_per_beam=4, weights=weights)
    assert (engine.weights is not None) == (weights == "gguf")
    questions = ("What is the capital of France?", "Write a haiku about the sea.",
                 "List three prime numbers and explain why they are prime.")
    for question in questions:
        prompt = engine.encode_chat([{"role": "user", "content": question}])
        params = SamplingParams(max_tokens=48)
        plain = run(engine, prompt, params, "plain")
        spec = run(engine, prompt, params, "spec")
        assert_same(spec, plain, question)
        assert plain.completion_tokens >= 5


def test_greedy_spec_matches_plain_on_int8_activations(tiny_model_dirs, trained_drafter_dirs, isa):
    """Decode rows and tree rows on the int8-activation kernel (llama.cpp's Q8_1 activations), on
    every kernel build this CPU runs (``RDSERVE_CPU_ISA``): the AVX-512 build takes the AMX kernel
    where the CPU has AMX (tree rows of 8-10 or more on the tiles), else AVX512-VNNI, the AVX2 build the AVX2 kernel (so an AVX-512 machine runs the AVX2
    path end to end too), and the engine names the path that runs. Each row still depends on itself
    alone, so spec output equals plain output; 16 random cases, with and without a prompt-lookup
    beam. The output differs from the float32 kernel's somewhere, so the setting was really in effect."""
    from workers.kernels.quant_linear import QuantLinear, best_int8_kernel

    int8_kernel = best_int8_kernel()  # amx, vnni or avx2: follows the build (RDSERVE_CPU_ISA) and the CPU
    path = "gguf-amx-int8" if int8_kernel == "amx" else f"gguf-{isa}-int8"
    multi, differs = 0, 0
    for case in range(16):
        rng = random.Random(2000 + case)
        variant = weights_variant(VARIANTS[case % 2], "gguf")
        shape = random_shape(rng)
        engine = load_engine(str(tiny_model_dirs[variant]), str(trained_drafter_dirs[variant]),
                        decode_activations="int8", **shape)
        assert engine.decode_activations == "int8" and engine.compute_path == path
        linears = [m for m in [*engine.model.modules(), *engine.drafter.modules()] if isinstance(m, QuantLinear)]
        assert {(m.isa, m.int8_kernel) for m in linears} == {(isa, int8_kernel)}
        prompt = random_prompt(rng, len(engine.tokenizer))
        params = SamplingParams(max_tokens=rng.randint(8, 48))
        plain = run(engine, prompt, params, "plain")
        spec = run(engine, prompt, params, "spec")
        assert_same(spec, plain, f"case {case}: {variant} {shape}")
        multi += sum(a >= 2 for a in spec.step_accepted)
        if case < 4:
            reference = load_engine(str(tiny_model_dirs[variant]), None, max_seq_len=256, decode_activations="float32")
            differs += run(reference, prompt, params, "plain").token_ids != plain.token_ids
    assert multi >= 10, "the drafter was rarely accepted; the comparison is weak"
    assert differs >= 1, "int8 activations gave the float32 kernel's output on every prompt: not in effect?"


def test_amx_and_vnni_engines_decode_the_same_tokens(tiny_model_dirs, trained_drafter_dirs, monkeypatch):
    """End to end on the AMX int8 kernel: 4x4 draft trees (17+ rows per step: the tiles) and plain
    steps decode exactly the tokens the AVX512-VNNI kernel decodes (``RDSERVE_AMX=0``), spec and
    plain, on both tiny variants."""
    from workers.kernels.quant_linear import QuantLinear, amx_unavailable

    if not build.available() or "avx512" not in build.supported_isas():
        pytest.skip("needs AVX-512 kernels (this CPU cannot run the avx512 build)")
    if amx_unavailable():
        pytest.skip(f"needs AMX-INT8 ({amx_unavailable()})")
    rng = random.Random(77)
    runs, multi = {}, 0
    for amx in ("1", "0"):
        monkeypatch.setenv("RDSERVE_AMX", amx)
        for variant in VARIANTS:
            engine = load_engine(str(tiny_model_dirs[weights_variant(variant, "gguf")]),
                                 str(trained_drafter_dirs[weights_variant(variant, "gguf")]), decode_activations="int8",
                                 num_beams=4, draft_len_per_beam=4, prompt_lookup_num_tokens=4, prompt_lookup_min=1,
                                 max_seq_len=256)
            kernels = {m.int8_kernel for m in engine.model.modules() if isinstance(m, QuantLinear)}
            assert kernels == {"amx" if amx == "1" else "vnni"}
            assert engine.compute_path == ("gguf-amx-int8" if amx == "1" else "gguf-avx512-int8")
            rng.seed(5)
            for case in range(4):
                prompt = random_prompt(rng, len(engine.tokenizer))
                params = SamplingParams(max_tokens=32)
                for mode in ("spec", "plain"):
                    out = run(engine, prompt, params, mode)
                    runs[amx, variant, case, mode] = out.token_ids
                    multi += mode == "spec" and sum(a >= 2 for a in out.step_accepted)
    for (amx, variant, case, mode), tokens in runs.items():
        if amx == "1":
            assert tokens == runs["0", variant, case, mode], (variant, case, mode)
            assert tokens == runs["1", variant, case, "plain"], (variant, case, "spec != plain")
    assert multi >= 4, "the drafter was rarely accepted; the trees were hardly used"


@pytest.mark.parametrize("kv,activations", [("float16", "float32"), ("float16", "int8"), ("int8", "float32"),
                                            ("int8", "int8")])
def test_greedy_spec_matches_plain_on_a_float16_or_int8_kv_cache(tiny_model_dirs, trained_drafter_dirs, kv,
                                                                  activations):
    """``kv_cache_dtype: float16`` (keys and values rounded when written, widened exactly when read)
    and ``int8`` (each token's key/value head quantized to int8 with one scale when written): every
    row still depends only on its own query and visible keys, so spec output equals plain output,
    with and without a prompt-lookup beam, on GGUF blocks with float32 and int8 activations; the
    cache really stores that dtype and holds 2x (float16) or 4 D / (D + 4)x (int8) the tokens of a
    float32 one in the same bytes."""
    multi = 0
    for case in range(8):
        rng = random.Random(3000 + case)
        variant = weights_variant(VARIANTS[case % 2], "gguf")
        shape = random_shape(rng)
        engine = load_engine(str(tiny_model_dirs[variant]), str(trained_drafter_dirs[variant]),
                             decode_activations=activations, kv_cache_dtype=kv, **shape)
        assert {t.dtype for t in engine.executor.cache.k + engine.executor.cache.v} == {getattr(torch, kv)}
        if case < 2:
            wide = load_engine(str(tiny_model_dirs[variant]), None, max_seq_len=256, kv_cache_dtype="float32")
            D = engine.config.head_size
            ratio = 2 if kv == "float16" else 4 * D / (D + 4)
            assert engine.kv_size.bytes_per_token * ratio == wide.kv_size.bytes_per_token
        prompt = random_prompt(rng, len(engine.tokenizer))
        params = SamplingParams(max_tokens=rng.randint(8, 48))
        plain = run(engine, prompt, params, "plain")
        spec = run(engine, prompt, params, "spec")
        assert_same(spec, plain, f"case {case}: {variant} {shape} {activations}")
        multi += sum(a >= 2 for a in spec.step_accepted)
    assert multi >= 5, "the drafter was rarely accepted; the comparison is weak"
