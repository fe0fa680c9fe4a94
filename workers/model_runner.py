"""Executes one iteration's plan: draft, pack, one base-model forward, sample/accept, compact KV.

The scheduler decides which requests run and the speculation shape; this runner only carries the
plan out (nano-vllm's ``model_runner``; TensorRT-LLM's in-flight batching runtime):

1. Generation requests that speculate get their draft beams, all in one batched draft search
   (``draft_search``: ReDrafter's beam search, arXiv 2403.09919 Sec. 3.2, or distinct first tokens,
   :mod:`workers.redrafter.beam_search`), plus, where set, a prompt-lookup beam copied from their
   own context (:mod:`workers.redrafter.prompt_lookup`), packed into one prefix tree each.
2. Context chunks and generation tokens (root token plus draft tree, or the root alone for plain
   decoding) are packed into one :class:`ForwardBatch`: each context chunk is its own attention
   group; generation requests with a tree form one group padded to the largest tree, plain ones
   another of width 1.
3. One executor forward; logits only for the rows that need them.
4. Per request: greedy acceptance or exact speculative sampling (plain decoding is a tree of one
   node), and the accepted path's keys/values are moved to the committed positions (one
   ``copy_slots`` for the whole iteration), so rejected draft tokens leave no trace (Sec. 3.3).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from workers.block_manager import BlockManager
from workers.logits_processing import process_logits, prompt_presence
from workers.forward_batch import AttentionGroup, ForwardBatch
from workers.redrafter.acceptance import accept_greedy, accept_sampled
from workers.redrafter.beam_search import draft_beams_batch, draft_distinct_first_batch
from workers.redrafter.fused_draft import draft_distinct_first_fused
from workers.redrafter.drafter import ReDrafter
from workers.redrafter.prompt_lookup import NgramIndex, PromptLookup
from workers.redrafter.pruning import prune_beams
from workers.redrafter.tree import PrefixTree, build_prefix_tree
from workers.sampling import SamplingParams, adjusted_probs, greedy_tokens, keyed_uniform, sample_keyed
from workers.sequence import Sequence


@dataclass
class StepResult:
    """What one iteration produced for one request.

    tokens: new output tokens (accepted draft tokens + the bonus token; the first token for a
        finished context phase); empty for a context chunk that did not finish the context.
    accepted_draft_tokens: how many of ``tokens`` were drafted.
    generation_step: True for a generation-phase step (counts towards tokens per step).
    draft_depth: the draft tree's depth (its longest beam's drafted tokens); 0 for a plain step.
    num_rows: rows the base model verified for it in a generation step (the tree's nodes; 1 for a
        plain step); 1 for a context chunk (not counted).
    grammar_rejected: the request's grammar forbade every drafted child of the accepted path's last
        node (the grammar, not the base model, ended acceptance).
    token_logits: ``[len(tokens), V]`` raw logits of the rows that chose ``tokens`` (row k predicts
        ``tokens[k]``), for requests that asked for logprobs; None otherwise.
    prompt_logits: ``[n, V]`` raw logits of a context chunk's rows whose next token is a prompt token
        (row k predicts prompt token ``prompt_start + k``), for requests that asked for prompt
        logprobs, the first time their prompt is computed; None otherwise.
    """

    seq: Sequence
    tokens: list[int]
    accepted_draft_tokens: int
    generation_step: bool
    draft_depth: int = 0
    token_logits: torch.Tensor | None = None
    prompt_logits: torch.Tensor | None = None
    prompt_start: int = 0
    grammar_rejected: bool = False
    num_rows: int = 1


@dataclass
class RequestState:
    """What the runner keeps per request in ``seq.runner_state``.

    hidden: ``[hidden_size]`` base hidden state that chose the last output token (the drafter's
        context), None before the first token.
    stop_ids: token ids that end the request (EOS unless ``ignore_eos``, and ``stop_token_ids``):
        forbidden before ``params.min_tokens`` (:mod:`workers.logits_processing`).
    prompt_seen: ``[V] bool`` tokens of the prompt, for ``repetition_penalty`` (built at first use).
    grammar: the request's grammar state (:class:`workers.structured.matcher.RequestGrammar`) for
        structured output, advanced along every step's emitted tokens; None without one.
    """

    params: SamplingParams
    seed: int | None  # sampled requests: keys every draw (workers.sampling.keyed_uniform); greedy: None
    hidden: torch.Tensor | None = None
    stop_ids: frozenset[int] = frozenset()
    prompt_seen: torch.Tensor | None = None
    grammar: object | None = None


@dataclass
class _GenRow:
    seq: Sequence
    tree: PrefixTree | None  # None: plain step (the root alone)
    length: int  # committed tokens (L): the root is written at position L
    lookup: list[int] | None = None  # the prompt-lookup beam's drafted tokens, if the tree has one

    @property
    def num_nodes(self) -> int:
        return 1 if self.tree is None else self.tree.num_nodes


class ModelRunner:
    """Runs plans on an executor (:class:`workers.executor.LocalExecutor` or the TP executor)."""

    def __init__(self, executor, block_manager: BlockManager, drafter: ReDrafter | None,
                 lookup: PromptLookup | None = None, draft_search: str = "distinct_first"):
        if draft_search not in ("beam", "distinct_first"):
            raise ValueError(f"draft_search must be beam or distinct_first, got {draft_search!r}")
        self.executor = executor
        self.draft_search = draft_search
        self.blocks = block_manager
        self.drafter = drafter
        self.lookup = lookup
        self.device = executor.device
        # prompt chunks and decode rows of one iteration in two forwards (see run); the engine turns it on
        self.split_mixed = False

    def max_draft_depth(self, spec_shape: tuple[int, int]) -> int:
        """Deepest tree a step of ``spec_shape`` may draft (the prompt-lookup beam may be longer)."""
        return max(spec_shape[1], self.lookup.longest if self.lookup else 0)

    @torch.inference_mode()
    def run(self, context: list[tuple[Sequence, int, int]], generation: list[Sequence],
            spec_shape: tuple[int, int] | None, draft_limits: dict[str, int] | None = None,
            min_draft_prob: float = 0.0) -> list[StepResult]:
        """Execute one iteration.

        Args:
            context: ``(seq, start, num_tokens)`` prefill chunks: positions ``[start, start + n)``.
            generation: sequences in the generation phase (``num_computed_tokens == num_tokens - 1``).
            spec_shape: ``(num_beams, draft_len_per_beam)`` for sequences with ``seq.speculative``,
                or None for plain steps only.
            draft_limits: request id -> most draft tokens this step may add to any beam (a request
                near its token limit drafts fewer; 0 means a plain step). Missing ids: no limit.
            min_draft_prob: draft tokens whose path probability under the drafter is below this are
                not verified (:func:`workers.redrafter.pruning.prune_beams`; distinct-first drafts
                only); 0 verifies the whole shape.

        Returns:
            one :class:`StepResult` per scheduled sequence, context chunks first. Sequences'
            ``num_computed_tokens`` and ``output_token_ids`` are updated.
        """
        rows = self._draft(generation, spec_shape, draft_limits or {}, min_draft_prob)
        rows = sorted(rows, key=lambda r: -r.num_nodes)  # widest first; equal widths are adjacent (stable)
        if self.split_mixed and context and rows:
            hidden, logit_rows, last_rows, row_starts, prompt_rows = self._forward_apart(context, rows)
        else:
            batch, logit_rows, last_rows, row_starts, prompt_rows = self._pack(context, rows)
            hidden = self.executor.forward(batch.to(self.device) if self.device.type != "cpu" else batch)
        logits = self.executor.logits(hidden[logit_rows]) if logit_rows else None
        results, copies_src, copies_dst = [], [], []
        cursor = 0  # row of ``logits``
        for (seq, start, n), last, n_prompt in zip(context, last_rows, prompt_rows):
            seq.num_computed_tokens = start + n
            state: RequestState = seq.runner_state
            prompt_logits = None
            if n_prompt:  # rows predicting prompt tokens start + 1 .. start + n_prompt
                prompt_logits = logits[cursor : cursor + n_prompt]
                cursor += n_prompt
            if seq.is_prefill or seq.output_token_ids:
                if not seq.is_prefill:  # recomputed after preemption: the last output token is known
                    state.hidden = hidden[last]
                results.append(StepResult(seq, [], 0, False, prompt_logits=prompt_logits, prompt_start=start + 1))
                continue
            row_logits = logits[cursor : cursor + 1]
            token = self._choose(row_logits, state, seq)[0]
            state.hidden = hidden[last]
            cursor += 1
            seq.output_token_ids.append(token)
            if state.grammar is not None:
                state.grammar.advance([token])
            results.append(StepResult(seq, [token], 0, False, token_logits=self._kept(row_logits, state),
                                      prompt_logits=prompt_logits, prompt_start=start + 1))
        # the argmax of every decode and tree row in one call, for greedy requests without logits processors
        # (per request it was ~40 us of a batch-16 step each; the same indices, workers.sampling.greedy_tokens)
        plain_greedy = [r.seq.runner_state.params.greedy and not r.seq.runner_state.params.has_processors for r in rows]
        top = greedy_tokens(logits[cursor:]).tolist() if any(plain_greedy) else None
        gen_start = cursor
        for row, row_start, fast in zip(rows, row_starts, plain_greedy):
            seq, state = row.seq, row.seq.runner_state
            node_logits = logits[cursor : cursor + row.num_nodes]
            row_top = top[cursor - gen_start : cursor - gen_start + row.num_nodes] if fast else None
            cursor += row.num_nodes
            grammar_rows = []  # the grammar's allowed mask of this tree's nodes, if it has one
            if row.tree is None:
                path, bonus = [0], row_top[0] if fast else self._choose(node_logits, state, seq)[0]
            elif fast:
                path, bonus = accept_greedy(row.tree, row_top)
            else:
                processed = self._processed(node_logits, state, seq, row.tree, grammar_rows)
                if state.params.greedy:
                    path, bonus = accept_greedy(row.tree, greedy_tokens(processed).tolist())
                else:
                    draws = [keyed_uniform(state.seed, seq.num_tokens + d) for d in range(int(row.tree.depths[-1]) + 1)]
                    path, bonus = accept_sampled(row.tree, adjusted_probs(processed, state.params), draws)
            L = row.length
            if path != list(range(len(path))):
                copies_src.append(self.blocks.slots(seq, L, L + row.num_nodes)[path])
                copies_dst.append(self.blocks.slots(seq, L, L + len(path)))
            drafted = [] if row.tree is None else row.tree.tokens[path[1:]].tolist()
            if row.lookup:
                seq.lookup.length = self.lookup.next_length(
                    self._lookup_length(seq), drafted[: len(row.lookup)] == row.lookup)
            state.hidden = hidden[row_start + path[-1]]
            seq.num_computed_tokens = L + len(path)
            seq.output_token_ids.extend(drafted + [bonus])
            if state.grammar is not None:  # the matcher moves along the accepted path only
                state.grammar.advance(drafted + [bonus])
            depth = 0 if row.tree is None else int(row.tree.depths[-1])
            # row path[k] chose the k-th emitted token (indexed only for logprobs: a [V] row copy per token)
            kept = self._kept(node_logits[path], state) if state.params.logprobs is not None else None
            forbidden = False
            if row.tree is not None and grammar_rows and row.tree.children[path[-1]]:
                allowed = grammar_rows[0][path[-1]]
                forbidden = not any(bool(allowed[t]) for t in row.tree.tokens[row.tree.children[path[-1]]].tolist())
            results.append(StepResult(seq, drafted + [bonus], len(drafted), True, depth, token_logits=kept,
                                      grammar_rejected=forbidden, num_rows=row.num_nodes))
        if copies_src:
            self.executor.copy_slots(torch.cat(copies_src).to(self.device), torch.cat(copies_dst).to(self.device))
        return results

    def _forward_apart(self, context, rows: list[_GenRow]):
        """An iteration's prompt chunks and its decode rows (plain and trees) in two forwards, hidden
        states concatenated in :meth:`_pack`'s order; returns what ``_pack`` does, with the hidden
        states in place of the batch.

        On the CPU with a bfloat16 prefill, prompt rows take the bfloat16 GEMMs and decode rows the
        int8 kernels; together they run the decoder layer by layer from Python, while decode rows
        alone run the fused C decoder (:mod:`workers.kernels.decoder`). Each weight is still read
        once per iteration (the two paths read different copies), and every row gets the same bits
        either way: a prompt row is computed the same whatever its chunk, a decode row whatever its
        group, and no row reads another request's cache (at 16 concurrent requests of 64 tokens, a
        quarter of iterations carry a new prompt and all took the slow path)."""
        batch, logit_rows, last_rows, _, prompt_rows = self._pack(context, [])
        hidden_ctx = self.executor.forward(batch)
        gen_batch, gen_logit_rows, _, row_starts, _ = self._pack([], rows)
        hidden_gen = self.executor.forward(gen_batch)
        n = hidden_ctx.shape[0]
        return (torch.cat([hidden_ctx, hidden_gen]), logit_rows + [r + n for r in gen_logit_rows], last_rows,
                [r + n for r in row_starts], prompt_rows)

    def _draft(self, generation: list[Sequence], spec_shape, limits: dict[str, int],
               min_prob: float = 0.0) -> list[_GenRow]:
        rows = [_GenRow(seq, None, seq.num_computed_tokens) for seq in generation]
        if spec_shape is None or self.drafter is None:
            return rows
        num_beams, draft_len = spec_shape
        spec = [r for r in rows if r.seq.speculative and limits.get(r.seq.request_id, draft_len) >= 1]
        if not spec:
            return rows
        context = torch.stack([r.seq.runner_state.hidden for r in spec])
        roots = torch.tensor([r.seq.output_token_ids[-1] for r in spec], device=context.device)
        beams = probs = None
        distinct = self.draft_search == "distinct_first" or num_beams == 1 or draft_len == 1  # the same beams
        prune = min_prob > 0 and distinct  # (up to near-ties); beam search's beams carry no per-token probabilities
        if distinct:
            embed = getattr(self.executor, "embed_weight", None)
            if embed is not None:
                beams = draft_distinct_first_fused(self.drafter, embed, context, roots, num_beams, draft_len,
                                                   with_probs=prune)
        if beams is None and prune:  # the Python twin of the C draft, with probabilities
            beams = draft_distinct_first_batch(self.drafter, self.executor.embed, context, roots, num_beams,
                                               draft_len, with_probs=True)
        elif beams is None:
            search = draft_distinct_first_batch if self.draft_search == "distinct_first" else draft_beams_batch
            beams = search(self.drafter, self.executor.embed, context, roots, num_beams, draft_len)
        if prune:
            beams, probs = beams[0].cpu(), beams[1].cpu().tolist()
        else:
            beams = beams.cpu()
        for i, (r, b) in enumerate(zip(spec, beams)):
            budget = limits.get(r.seq.request_id, self.max_draft_depth(spec_shape))
            tree_beams = b[:, : min(draft_len, budget) + 1].tolist()
            root = tree_beams[0][0]
            if prune:
                tree_beams = prune_beams(tree_beams, probs[i], min_prob) or [[root]]
            if self.lookup is not None:
                r.lookup = self._lookup_beam(r.seq, min(self._lookup_length(r.seq), budget))
                if r.lookup:
                    tree_beams.append([root] + r.lookup)
            if tree_beams != [[root]]:  # every draft token cut: a plain step
                r.tree = build_prefix_tree(tree_beams)
        return rows

    def _lookup_length(self, seq: Sequence) -> int:
        """Tokens ``seq``'s next prompt-lookup beam may draft (the start length before its first beam)."""
        return self.lookup.num_tokens if seq.lookup.length is None else seq.lookup.length

    def _lookup_beam(self, seq: Sequence, num_tokens: int) -> list[int]:
        """The prompt-lookup beam's drafted tokens after ``seq``'s last token, ``[]`` without a match."""
        index = seq.lookup.index
        if index is None:
            index = seq.lookup.index = NgramIndex(self.lookup.min_n, self.lookup.max_n)
        index.sync(seq.prompt_token_ids, seq.output_token_ids)
        return index.propose(num_tokens)

    def _pack(self, context, rows: list[_GenRow]) -> tuple[ForwardBatch, list[int], list[int], list[int]]:
        """Pack context chunks and generation rows; returns the batch, the rows needing logits, each
        context chunk's last row, each generation row's first row, and each context chunk's rows
        for prompt logprobs (its first rows; they come before its last row in the logits). Rows that recompute a
        preempted request's generated tokens are not prompt rows (``ForwardBatch.prompt_rows``), so
        a prefill path gives them the same values decoding did.

        Generation rows form one attention group per tree width (plain rows: width 1), so no row is
        padded: every tree row passes through every linear layer, and a padded one would cost as
        much as a real one (a prompt-lookup beam makes widths differ between requests). ``rows``
        must list equal widths next to each other, trees before plain rows."""
        ids, pos, slots, groups, logit_rows, last_rows, prompt_rows = [], [], [], [], [], [], []
        n_rows, prompt_spans, recompute = 0, [], False
        for seq, start, n in context:
            tokens = (seq.prompt_token_ids + seq.output_token_ids)[start : start + n]
            n_prompt = min(n, max(0, len(seq.prompt_token_ids) - start))  # the rest recomputes generated tokens
            prompt_spans.append((n_rows, n_rows + n_prompt))
            recompute |= n_prompt < n
            kv = self.blocks.slots(seq, 0, start + n)
            ids.append(torch.tensor(tokens))
            pos.append(torch.arange(start, start + n))
            slots.append(kv[start:])
            mask = torch.ones(n, start + n, dtype=torch.bool)
            mask[:, start:] = torch.ones(n, n, dtype=torch.bool).tril()
            groups.append(AttentionGroup(n_rows, 1, n, kv[None], mask[None, None], self._run_start(seq, start + n)))
            # rows whose next token is a prompt token, for prompt logprobs (the first computation only)
            n_logprob = 0
            state = seq.runner_state
            if state is not None and state.params.prompt_logprobs is not None and not seq.output_token_ids:
                n_logprob = max(0, min(start + n, len(seq.prompt_token_ids) - 1) - start)
            prompt_rows.append(n_logprob)
            logit_rows.extend(range(n_rows, n_rows + n_logprob))
            n_rows += n
            last_rows.append(n_rows - 1)
            if start + n == seq.num_context_tokens and not seq.output_token_ids:
                logit_rows.append(n_rows - 1)
        row_starts = []
        for _, same_width in itertools.groupby(rows, key=lambda r: (r.tree is None, r.num_nodes)):
            group = list(same_width)
            width = group[0].num_nodes
            lengths = [r.length for r in group]
            kv_len = max(lengths) + width
            G = len(group)
            # every request's slots, trash past its own tree, in one set of tensor ops for the group
            kv_slots = self.blocks.group_slots([r.seq for r in group], [L + r.num_nodes for L, r in zip(lengths, group)],
                                               kv_len)
            L_t = torch.tensor(lengths)
            cols = torch.arange(kv_len)
            if group[0].tree is None:  # plain rows: the root at position L sees positions 0 .. L
                g_ids = torch.tensor([r.seq.output_token_ids[-1] for r in group])
                g_pos = L_t
                g_slots = kv_slots.gather(1, L_t[:, None]).reshape(-1)
                mask = (cols <= L_t[:, None])[:, None, None, :]
            else:
                g_ids = torch.zeros(G, width, dtype=torch.long)
                g_pos = torch.zeros(G, width, dtype=torch.long)
                g_slots = kv_slots.gather(1, L_t[:, None] + torch.arange(width)).reshape(-1)
                mask = (cols < L_t[:, None])[:, None, None, :].expand(G, 1, width, kv_len).clone()
                for i, r in enumerate(group):
                    L, m = r.length, r.num_nodes
                    g_ids[i, :m] = r.tree.tokens
                    g_pos[i, :m] = L + r.tree.depths
                    mask[i, 0, :m, L : L + m] = r.tree.mask
            for i, r in enumerate(group):
                row_starts.append(n_rows + i * width)
                logit_rows.extend(range(n_rows + i * width, n_rows + i * width + r.num_nodes))
            run = self._run_start(group[0].seq, group[0].length + width) if len(group) == 1 else None
            if run is not None and kv_len != group[0].length + group[0].num_nodes:
                run = None
            groups.append(AttentionGroup(n_rows, len(group), width, kv_slots, mask, run, decode=True))
            ids.append(g_ids.reshape(-1))
            pos.append(g_pos.reshape(-1))
            slots.append(g_slots.reshape(-1))
            n_rows += len(group) * width
        batch = ForwardBatch(torch.cat(ids), torch.cat(pos), torch.cat(slots), groups,
                             torch.cat([torch.arange(a, b) for a, b in prompt_spans]) if recompute else None)
        return batch, logit_rows, last_rows, row_starts, prompt_rows

    def _run_start(self, seq: Sequence, upto: int) -> int | None:
        """First slot when positions ``[0, upto)`` of ``seq`` lie in consecutive blocks, else None."""
        bs = self.blocks.block_size
        table = seq.block_table[: -(-upto // bs)]
        if all(b - a == 1 for a, b in zip(table, table[1:])):
            return table[0] * bs
        return None

    def _choose(self, logits: torch.Tensor, state: RequestState, seq: Sequence) -> list[int]:
        """The token at sequence position ``seq.num_tokens`` from its one row of ``logits`` (``[1, V]``)."""
        logits = self._processed(logits, state, seq, None)
        if state.params.greedy:
            return greedy_tokens(logits).tolist()
        return sample_keyed(adjusted_probs(logits, state.params), [keyed_uniform(state.seed, seq.num_tokens)])

    @staticmethod
    def _processed(logits: torch.Tensor, state: RequestState, seq: Sequence, tree: PrefixTree | None,
                   grammar_rows: list | None = None) -> torch.Tensor:
        """``logits`` (``[m, V]``: a tree's nodes, or one row) after the request's logits processors,
        each row with its own path's history (:func:`workers.logits_processing.process_logits`).
        ``grammar_rows``, if given, receives the grammar's ``[m, V]`` allowed mask (when there is one)."""
        params = state.params
        if not params.has_processors:
            return logits
        if params.repetition_penalty != 1.0 and state.prompt_seen is None:
            state.prompt_seen = prompt_presence(seq.prompt_token_ids, logits.shape[-1])
        allowed = None
        if state.grammar is not None:  # each node: what the grammar allows after its own path
            allowed = state.grammar.allowed()[None] if tree is None else \
                state.grammar.tree_allowed(tree.tokens.tolist(), tree.parents.tolist())
            allowed = allowed.to(logits.device)
            if grammar_rows is not None:
                grammar_rows.append(allowed)
        if tree is None:
            return process_logits(logits, params, seq.output_token_ids, state.prompt_seen, stop_ids=state.stop_ids,
                                  allowed=allowed)
        return process_logits(logits, params, seq.output_token_ids, state.prompt_seen, tree.depths,
                              tree.tokens[1:], tree.mask[:, 1:], state.stop_ids, allowed)

    @staticmethod
    def _kept(rows: torch.Tensor, state: RequestState) -> torch.Tensor | None:
        """The raw logits rows of the emitted tokens, kept only for a request that asked for logprobs."""
        return rows if state.params.logprobs is not None else None
