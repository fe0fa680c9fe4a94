"""Self-distillation data from the serving engine (:class:`workers.engine.Engine`).

The engine decodes the prompts plainly and greedily with in-flight batching on the compute path it
serves on (on CPU: the GGUF blocks with int8 decode activations, ``workers/kernels``), several
times faster here than the float32 PyTorch model of :func:`workers.training.distill_data.generate_batch`,
and the hidden states are those the drafter sees while serving. Each response token is kept with
the hidden state whose LM-head argmax chose it (``RequestState.hidden`` after the step that emitted
it), the record format of :mod:`workers.training.distill_data`.
"""

from __future__ import annotations

import torch

from workers.engine import Engine
from workers.sampling_params import SamplingParams


@torch.inference_mode()
def generate_batch_engine(engine: Engine, prompts: list[list[int]], max_new_tokens: int
                          ) -> list[tuple[list[int], torch.Tensor]]:
    """Greedy responses of ``engine`` for a batch of prompts, decoded together (up to the engine's
    ``max_batch_size`` at once; the rest wait in its queue).

    Returns, per prompt, ``(response_ids, hiddens)`` with ``hiddens: [len(response_ids), H] float16``;
    a response ends with the EOS token that ended it, or after ``max_new_tokens`` tokens (or where
    the context is full).

    Raises:
        RuntimeError: the engine holds other requests (their steps would mix in).
        ValueError: a prompt the engine refuses (see :meth:`Engine.add_request`).
    """
    if engine.num_unfinished:
        raise RuntimeError(f"the engine holds {engine.num_unfinished} other requests")
    params = SamplingParams(max_tokens=max_new_tokens)  # temperature 0: greedy; stops at EOS
    ids = [f"distill-{i}" for i in range(len(prompts))]
    try:
        for rid, prompt in zip(ids, prompts):
            engine.add_request(rid, prompt, params, "plain")
        by_id = {s.request_id: s for s in engine.scheduler.waiting}
        pending = {rid: by_id[rid] for rid in ids}
        tokens: dict[str, list[int]] = {rid: [] for rid in ids}
        hiddens: dict[str, list[torch.Tensor]] = {rid: [] for rid in ids}
        while pending:
            deltas = engine.step()
            for rid, seq in pending.items():
                new = seq.output_token_ids[len(tokens[rid]):]
                if not new:
                    continue
                if len(new) != 1:  # plain steps emit one token each
                    raise RuntimeError(f"{rid}: {len(new)} tokens in one plain step")
                tokens[rid].append(new[0])
                hiddens[rid].append(seq.runner_state.hidden.to(torch.float16))
            for d in deltas:
                if d.finished:
                    pending.pop(d.request_id, None)
    finally:
        for rid in ids:  # an error mid-batch leaves nothing behind in the engine
            engine.abort(rid)
    return [(tokens[rid], torch.stack(hiddens[rid])) for rid in ids]
