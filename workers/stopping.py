"""Output text and stop conditions of one sequence when a step may emit several tokens.

With speculative decoding one generation step appends the accepted draft tokens plus a bonus token,
so a stop condition can be met in the middle of a step. ``OutputStream`` consumes the step's tokens one
by one, stops exactly at EOS, at a stop string (also one spanning several tokens and steps) or at
``max_tokens``, drops the tokens after that, and streams text deltas that are never taken back:
text that may still become a stop string, or that ends in an incomplete UTF-8 character, is withheld
until it is disambiguated. Semantics follow vLLM and the OpenAI API: the EOS token counts as an output
token but adds no text, and the stop string itself is not part of the output text.
"""

from __future__ import annotations

from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from workers.sampling_params import SamplingParams

REPLACEMENT_CHAR = "\ufffd"


@dataclass
class TokenDelta:
    """What one ``append`` (or ``flush``) adds to the output.

    ``text`` is new text safe to emit now (may be ""); ``token_ids`` are the tokens of this call that
    belong to the output (never a token after the stop); ``finish_reason`` is "stop" (EOS or stop
    string), "length" (max_tokens) or None while the sequence runs.
    """

    text: str
    token_ids: list[int]
    finished: bool
    finish_reason: str | None


class IncrementalDetokenizer:
    """Text of a growing token list, decoding a short window per token instead of the whole list.

    The window ``ids[prefix_offset:]`` keeps a few already-read tokens as left context, so tokenizers
    whose decoding of a token depends on its neighbour (leading-space handling, byte-level pieces)
    decode the new tokens as they would inside the full list; the new text is what the window adds
    beyond the decoded context ``ids[prefix_offset:read_offset]`` (vLLM's incremental
    detokenization). Offsets only advance once the window ends in a complete character.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase):
        self._tokenizer = tokenizer
        self._ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0
        self._context_text = ""
        self._read_text = ""
        self._tail = ""

    @property
    def complete_text(self) -> str:
        """Decoded text without a trailing incomplete (or not yet valid) UTF-8 sequence."""
        return self._read_text + self._tail.rstrip(REPLACEMENT_CHAR)

    @property
    def full_text(self) -> str:
        """Decoded text of all tokens, as ``tokenizer.decode`` gives it (may end in U+FFFD)."""
        return self._read_text + self._tail

    def push(self, token_id: int) -> None:
        """Append one token id."""
        self._ids.append(token_id)
        window = self._decode(self._ids[self._prefix_offset :])
        self._tail = window[len(self._context_text) :]
        if self._tail.endswith(REPLACEMENT_CHAR):
            return
        self._read_text += self._tail
        self._tail = ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self._context_text = self._decode(self._ids[self._prefix_offset : self._read_offset])

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=True)


class OutputStream:
    """Output tokens and streamed text of one sequence, cut exactly at its stop condition.

    ``eos_token_ids`` end the sequence unless ``params.ignore_eos``; ``params.stop_token_ids`` end it
    always (vLLM), their text not part of the output, as EOS's is not. With
    ``params.include_stop_str_in_output`` (vLLM) a stop string ends the text instead of being cut
    (the longest stop string starting where the earliest match starts). The final text equals
    ``tokenizer.decode(output_ids_without_eos, skip_special_tokens=True)`` cut right before the
    earliest stop string, and equals the concatenation of all delta texts.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, params: SamplingParams, eos_token_ids: set[int]):
        self._params = params
        self._stops = tuple(s for s in params.stop if s)
        self._eos_token_ids = (frozenset() if params.ignore_eos else frozenset(eos_token_ids)) \
            | frozenset(params.stop_token_ids)
        self._detokenizer = IncrementalDetokenizer(tokenizer)
        self._token_ids: list[int] = []
        self._text = ""
        self._final_text: str | None = None
        self._finish_reason: str | None = None

    @property
    def token_ids(self) -> list[int]:
        """All output token ids so far (the EOS that ended the sequence included)."""
        return list(self._token_ids)

    @property
    def text(self) -> str:
        """All text emitted so far."""
        return self._text

    @property
    def finished(self) -> bool:
        return self._finish_reason is not None

    @property
    def finish_reason(self) -> str | None:
        return self._finish_reason

    def append(self, token_ids: list[int]) -> TokenDelta:
        """Consume the tokens of one step in order; tokens after the stop condition are dropped."""
        if self.finished:
            return TokenDelta("", [], True, self._finish_reason)
        consumed: list[int] = []
        for token_id in token_ids:
            consumed.append(token_id)
            self._consume(token_id)
            if self.finished:
                break
        return self._emit(consumed)

    def flush(self) -> TokenDelta:
        """Finish now for "length" (e.g. the model's context window is full) and emit withheld text.

        Returns an empty finished delta when the sequence had already finished.
        """
        if self.finished:
            return TokenDelta("", [], True, self._finish_reason)
        self._finish("length", self._detokenizer.full_text)
        return self._emit([])

    def _consume(self, token_id: int) -> None:
        self._token_ids.append(token_id)
        if token_id in self._eos_token_ids:
            self._finish("stop", self._detokenizer.full_text)
            return
        seen = len(self._detokenizer.complete_text)
        self._detokenizer.push(token_id)
        text = self._detokenizer.complete_text
        stop_at = self._find_stop(text, seen)
        if stop_at is not None:
            if self._params.include_stop_str_in_output:  # vLLM: the stop string ends the text
                stop_at += next(len(s) for s in sorted(self._stops, key=len, reverse=True) if text.startswith(s, stop_at))
            self._finish("stop", text[:stop_at])
        elif len(self._token_ids) >= self._params.max_tokens:
            self._finish("length", self._detokenizer.full_text)

    def _find_stop(self, text: str, seen: int) -> int | None:
        """Start of the earliest stop string in ``text`` that ends beyond the first ``seen`` chars."""
        starts = [text.find(stop, max(0, seen - len(stop) + 1)) for stop in self._stops]
        starts = [start for start in starts if start >= 0]
        return min(starts) if starts else None

    def _withheld_len(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
        held = 0
        for stop in self._stops:
            for n in range(min(len(stop) - 1, len(text)), held, -1):
                if text.endswith(stop[:n]):
                    held = n
                    break
        return held

    def _finish(self, reason: str, final_text: str) -> None:
        self._finish_reason = reason
        self._final_text = final_text

    def _emit(self, consumed: list[int]) -> TokenDelta:
        if self._final_text is not None:
            text = self._final_text
        else:
            text = self._detokenizer.complete_text
            text = text[: len(text) - self._withheld_len(text)]
        delta = text[len(self._text) :]
        self._text += delta
        return TokenDelta(delta, consumed, self.finished, self._finish_reason)
