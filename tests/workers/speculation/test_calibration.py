"""Step-time measurement on real text: the contexts are the given prompts, joined and cut."""

from __future__ import annotations

from workers.speculation.calibration import measure_step_s
from workers.engine_builder import load_engine


def test_step_times_on_prompt_text_use_the_joined_prompts_and_keep_the_batch(tiny_model_dirs, trained_drafter_dirs):
    engine = load_engine(str(tiny_model_dirs["tied_gqa2"]), str(trained_drafter_dirs["tied_gqa2"]), num_beams=2,
                    draft_len_per_beam=2, max_seq_len=256, prompt_lookup_num_tokens=4, prompt_lookup_min=1)
    seen, batch_sizes = [], []
    add, step = engine.add_request, engine.step

    def recording_add(rid, prompt, params, mode):
        seen.append(list(prompt))
        return add(rid, prompt, params, mode)

    def recording_step():
        out = step()
        batch_sizes.append(len(engine.scheduler.running))
        return out

    engine.add_request, engine.step = recording_add, recording_step
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12], [13, 14, 15, 16]]
    t = measure_step_s(engine, 3, (2, 2), context_len=10, repeats=3, warmup=1, prompts=prompts)
    assert t > 0
    assert seen == [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14], [10, 11, 12, 13, 14, 15, 16, 5, 6, 7],
                    [13, 14, 15, 16, 5, 6, 7, 8, 9, 10]]
    # every timed iteration ran all 3 requests: a step accepting the 4-token lookup beam does not
    # finish a request early
    assert batch_sizes[-4:] == [3, 3, 3, 3]
    assert engine.num_unfinished == 0
