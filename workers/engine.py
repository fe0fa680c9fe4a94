"""The engine: one base model, an optional ReDrafter draft head, and the decoding loop.

A request's way through the engine: context phase (prefill of the prompt, which yields the first
token), then generation-phase steps. A plain step feeds the last token and yields one token. A
speculative step (ReDrafter arXiv 2403.09919 Sec. 3) drafts ``num_beams`` beams of
``draft_len_per_beam`` tokens by beam search, packs them into a prefix tree, verifies the whole
tree in one base-model forward with tree attention, keeps the longest accepted prefix plus a
bonus token, and compacts the accepted path in the KV cache.

This engine runs one request at a time; in-flight batching and the paged KV cache come with the
scheduler (see ``workers/README.md``).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace

import torch

from workers.executor import LocalExecutor
from workers.forward_batch import contiguous_batch
from workers.models.loader import load_model
from workers.models.tokenizer import apply_chat_template, load_tokenizer
from workers.redrafter.beam_search import draft_beams
from workers.redrafter.drafter import load_drafter
from workers.speculative_step import plain_step, speculative_step
from workers.sampling import SamplingParams, adjusted_probs, make_generator, sample
from workers.stopping import OutputStream

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
MODES = ("spec", "plain")


@dataclass
class GenerationDelta:
    """What one decoding step added to a request's output.

    Counters are cumulative. ``num_steps`` counts generation-phase steps (forward passes after the
    context phase); ``accepted_draft_tokens`` counts drafted tokens the base model accepted.
    """

    text: str
    token_ids: list[int]
    finished: bool
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    num_steps: int
    accepted_draft_tokens: int

    @property
    def tokens_per_step(self) -> float:
        """Mean (accepted draft tokens + 1) per generation step; 1.0 for plain decoding."""
        return (self.accepted_draft_tokens + self.num_steps) / self.num_steps if self.num_steps else 0.0


class Engine:
    """Loads a Hugging Face model directory and (optionally) a drafter directory.

    Raises:
        FileNotFoundError, ValueError: unreadable model/drafter or mismatched shapes.
    """

    def __init__(
        self,
        model_path: str,
        drafter_path: str | None,
        *,
        device: str = "cpu",
        dtype: str = "float32",
        num_beams: int = 4,
        draft_len_per_beam: int = 4,
        max_seq_len: int = 2048,
        num_threads: int | None = None,
    ):
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
        if num_threads:
            torch.set_num_threads(num_threads)
        self.device = torch.device(device)
        self.model = load_model(model_path, DTYPES[dtype], device)
        self.tokenizer = load_tokenizer(model_path)
        cfg = self.model.config
        self.max_seq_len = min(max_seq_len, cfg.max_position_embeddings)
        self.num_beams = num_beams
        self.draft_len_per_beam = draft_len_per_beam
        self.drafter = None
        if drafter_path:
            self.drafter = load_drafter(drafter_path, self.model.lm_head.weight, DTYPES[dtype], device)
        self.executor = LocalExecutor(self.model, self.max_seq_len + num_beams * draft_len_per_beam + 1)
        self.eos_token_ids = set(cfg.eos_token_id)
        if self.tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(self.tokenizer.eos_token_id)

    @property
    def speculative_available(self) -> bool:
        return self.drafter is not None

    def encode_prompt(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def encode_chat(self, messages: list[dict]) -> list[int]:
        return apply_chat_template(self.tokenizer, messages)

    @torch.inference_mode()
    def generate(self, prompt_ids: list[int], params: SamplingParams, mode: str) -> Iterator[GenerationDelta]:
        """Decode one request; yields one :class:`GenerationDelta` per step, the last one finished.

        Raises:
            ValueError: empty prompt, prompt that leaves no room in ``max_seq_len``, unknown mode,
                or ``mode="spec"`` without a drafter.
        """
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if mode == "spec" and self.drafter is None:
            raise ValueError("speculative decoding needs a drafter (drafter.path is not set)")
        n_prompt = len(prompt_ids)
        if n_prompt == 0:
            raise ValueError("prompt is empty")
        if n_prompt >= self.max_seq_len:
            raise ValueError(f"prompt has {n_prompt} tokens; the context holds {self.max_seq_len}")
        budget = min(params.max_tokens, self.max_seq_len - n_prompt)
        stream = OutputStream(self.tokenizer, replace(params, max_tokens=budget), self.eos_token_ids)
        generator = None if params.greedy else make_generator(params.seed, self.device)
        hidden = self._prefill(prompt_ids)
        length = n_prompt  # committed tokens in the KV cache (slots 0..length-1)
        root = self._choose(hidden[None], params, generator)[0]
        steps = accepted = produced = 0

        def delta(tokens: list[int]) -> GenerationDelta:
            out = stream.append(tokens)
            return GenerationDelta(
                out.text, out.token_ids, out.finished, out.finish_reason, n_prompt,
                len(stream.token_ids), steps, accepted,
            )

        produced = 1
        d = delta([root])
        yield d
        while not d.finished:
            remaining = budget - produced
            draft_len = min(self.draft_len_per_beam, remaining - 1)
            if mode == "spec" and draft_len >= 1:
                beams = draft_beams(
                    self.drafter, self.model.model.embed_tokens, hidden, root, self.num_beams, draft_len
                )
                tokens, hidden = speculative_step(self.executor, length, beams, params, generator)
            else:
                tokens, hidden = plain_step(self.executor, length, root, params, generator)
            length += len(tokens)
            steps += 1
            produced += len(tokens)
            root = tokens[-1]
            emitted = len(stream.token_ids)
            d = delta(tokens)
            # accepted draft tokens that were emitted (a stop inside the block drops the rest)
            accepted += min(len(tokens) - 1, d.completion_tokens - emitted)
            d.accepted_draft_tokens = accepted
            yield d

    def _prefill(self, prompt_ids: list[int]) -> torch.Tensor:
        """Context phase; returns the hidden state ``[H]`` of the last prompt token."""
        batch = contiguous_batch(torch.tensor(prompt_ids, device=self.device), 0)
        return self.executor.forward(batch)[-1]

    def _choose(self, hidden: torch.Tensor, params: SamplingParams, generator) -> list[int]:
        logits = self.model.logits(hidden)
        if params.greedy:
            return logits.argmax(-1).tolist()
        return sample(adjusted_probs(logits, params), generator).tolist()
