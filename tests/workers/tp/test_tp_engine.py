"""The in-flight batching engine runs unchanged on TP2/TP4/TP8 (:func:`tp_executor_factory`): greedy
output of concurrent plain and speculative requests is token-identical to TP1's (without prefix
caching), the second time also with the prompts' blocks from the prefix cache (every rank reads the
same block ids: the block manager lives on rank 0 and sends slots).

Model: 8 query heads, 4 KV heads (TP8 replicates KV heads), vocabulary 397 (padded vocab slices),
with a ReDrafter head self-distilled on it so drafts are often accepted. Small prefill chunks make
iterations mix context chunks with draft trees. Each ``tp_size`` is spawned once.
"""

from __future__ import annotations

import pytest
import torch

from tiny_model import make_trained_tiny_drafter_dir
from tp_models import make_tp_model_dir
from workers.engine import Engine
from workers.engine_builder import load_engine
from workers.sampling_params import SamplingParams
from workers.tp.executor import tp_executor_factory

OPTIONS = dict(num_beams=2, draft_len_per_beam=3, max_seq_len=128, max_batch_size=6, max_num_tokens=48,
               max_prefill_chunk=12, tokens_per_block=4, num_kv_blocks=300)
PROMPTS = ([5, 17, 42, 99, 3, 250, 31, 8, 77, 140, 12, 6, 90, 200, 4, 66, 23], [300, 12, 7], [50, 51, 52, 53, 54])
MAX_TOKENS = 20


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp_engine")
    model = make_tp_model_dir(root / "model", heads=8, kv_heads=4)
    return model, make_trained_tiny_drafter_dir(model, root / "drafter", num_prompts=128, steps=400)


def run_all(engine: Engine) -> dict[tuple[int, str], tuple[list[int], int]]:
    """Every prompt in both modes, all requests decoding together: ``{(prompt, mode): (tokens,
    accepted draft tokens)}``."""
    for i, prompt in enumerate(PROMPTS):
        for mode in ("plain", "spec"):
            engine.add_request(f"{i}-{mode}", prompt, SamplingParams(max_tokens=MAX_TOKENS), mode)
    out: dict[tuple[int, str], tuple[list[int], int]] = {}
    tokens: dict[str, list[int]] = {}
    while engine.num_unfinished:
        for d in engine.step():
            tokens.setdefault(d.request_id, []).extend(d.token_ids)
            if d.finished:
                i, mode = d.request_id.split("-")
                out[(int(i), mode)] = (tokens[d.request_id], d.accepted_draft_tokens)
    return out


@pytest.fixture(scope="module")
def reference(dirs):
    engine = load_engine(str(dirs[0]), str(dirs[1]), enable_prefix_caching=False, **OPTIONS)
    try:
        return run_all(engine)
    finally:
        engine.close()


def test_reference_is_lossless_and_speculates(reference):
    for i in range(len(PROMPTS)):
        assert reference[(i, "spec")][0] == reference[(i, "plain")][0]
    assert sum(reference[(i, "spec")][1] for i in range(len(PROMPTS))) >= 10  # 23 of 60 tokens when written


@pytest.mark.parametrize("tp", (2, 4, 8))
def test_engine_greedy_output_is_token_identical(dirs, reference, tp):
    engine = load_engine(str(dirs[0]), str(dirs[1]), executor_factory=tp_executor_factory(str(dirs[0]), tp, 1),
                    **OPTIONS)
    try:
        assert engine.executor.tp_size == tp
        assert run_all(engine) == reference
        assert engine.blocks.num_cached_blocks > 0 and run_all(engine) == reference  # again, the prompts' blocks now from the prefix cache
    finally:
        engine.close()


@pytest.mark.parametrize("kv", ["float16", "int8"])
def test_a_float16_or_int8_kv_cache_on_tp2_gives_tp1s_tokens(dirs, kv):
    """``kv_cache_dtype: float16`` / ``int8`` reaches every rank (each holds its KV heads in that
    dtype, rounded or quantized per head the same way), so TP2 decodes TP1's tokens with that cache
    too, plain and speculative."""
    single = load_engine(str(dirs[0]), str(dirs[1]), enable_prefix_caching=False, kv_cache_dtype=kv, **OPTIONS)
    try:
        want = run_all(single)
    finally:
        single.close()
    engine = load_engine(str(dirs[0]), str(dirs[1]), executor_factory=tp_executor_factory(str(dirs[0]), 2, 1),
                         kv_cache_dtype=kv, **OPTIONS)
    try:
        assert engine.executor.worker.cache.k[0].dtype == getattr(torch, kv)
        assert run_all(engine) == want
    finally:
        engine.close()
