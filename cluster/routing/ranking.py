"""Replica selection: rank engine replicas by a request's expected completion time.

The Ray Serve adapter (:class:`cluster.routing.request_router.GoodputRequestRouter`) calls
:func:`rank_replicas` for every request. Its inputs are measured state only: each replica's routing
stats (:mod:`cluster.replica.stats`, polled every ``request_routing_stats_period_s``) and what this
router sent each replica since those stats (:class:`SentSinceStats`), so a burst spreads even
between polls. No Ray here.

The model, for a request of at most ``m`` new tokens on one replica:

- ``n``: requests the replica holds: its ``load`` when polled, less this router's requests counted
  in it, plus this router's requests there now (:class:`SentSinceStats`).
- step cost: one deployment runs one model on one kind of accelerator, so the replicas share one
  step-cost curve, taken as proportional to the batch: ``unit_step_s * b`` seconds for a step of
  ``b`` requests (as :func:`workers.speculation.goodput.interpolate` extends a single measured point), with
  ``unit_step_s`` the candidates' median of ``step_s / running`` (1.0 when no replica is running:
  the result is then in steps rather than seconds). A replica's own ``step_s`` enters only as its
  ``speed`` against the median of the replicas measured at the same batch size (``running``):
  step times measured at different batch sizes are not comparable (a step's real cost grows far
  less than in proportion, so ``step_s / running`` would make the busiest replica look fastest).
- ``tau``: the replica's live tokens per step (accepted draft tokens + 1, ReDrafter arXiv
  2403.09919 Sec. 4; 1.0 when plain); the candidates' median for a replica without stats.
- decoding: in a batch of ``b = min(n + 1, max_batch_size)`` each step takes
  ``speed * unit_step_s * b`` and yields ``tau`` tokens: ``m / tau * speed * unit_step_s * b`` seconds.
- queueing: beyond ``max_batch_size`` the request waits for a slot. The ``n + 1 - max_batch_size``
  requests over the limit leave in waves of a full batch, each wave as long as this request's
  decoding at the full batch (its own ``m`` is the only length known here):
  ``(n + 1 - max_batch_size) * m / tau * speed * unit_step_s`` seconds.

- prefill: the prompt positions the replica has not cached, times the seconds per prefilled position
  (the candidates' median ``prefill_s_per_token``; ``PREFILL_TOKEN_UNITS`` unit steps where none is
  measured). Cached positions are estimated from the request's routing-text block hashes
  (:mod:`workers.text_prefix`) against the hashes the replica reports (``prefix_hashes``, each with
  the prompt tokens up to its block's end) and those of the requests this router sent it in the last
  ``RecentPrefixes.ttl_s`` seconds (its report lags); at least one position is always computed. The
  whole prompt's prefill is in every score, also the part all candidates share: ties are relative to
  the request's whole expected time, so a long prompt makes small load differences ties (measured
  better on two replicas than leaving the shared part out, BENCHMARKS.md section 13).

Expected completion = queueing + decoding + prefill. One more request lengthens every step of a
replica, so at low load requests spread and each decodes in a small batch, where speculation pays.
A cached prefix saves its prefill only once: a replica that holds a popular prefix wins its followers
while its extra load costs less than the prefill saved, and loses them beyond (the others then cache
the prefix too), so no prefix pins all traffic to one replica.

Admission: a replica admits the request while it holds fewer than ``max_ongoing_requests`` and its
free KV blocks, less those of the requests sent to it since its stats, hold the prompt plus ``m``
tokens. A replica without stats yet is assumed to admit.
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Hashable
from collections.abc import Mapping
from dataclasses import dataclass, field

from workers.text_prefix import DEFAULT_CHARS_PER_TOKEN, block_tokens, cached_tokens

TIE_TOLERANCE = 0.05
"""Candidates whose expected completion times are within this fraction of each other are ties."""

PREFILL_TOKEN_UNITS = 0.2
"""A prefilled prompt position's cost in unit steps (seconds of a step per request in the batch) where no
replica has measured it: on the CPU paths a prompt position costs 0.15-0.25 of a batch-1 decode step
(SmolLM2-135M, EPYC Zen 4, gguf-avx512-int8: about 1.1 ms against 6 ms)."""


@dataclass(frozen=True)
class Candidate:
    """One replica as the router sees it.

    replica: its id (any hashable). stats: its last routing stats, ``{}`` before the first poll.
    max_ongoing_requests: Ray Serve's admission limit per replica.
    sent: requests this router sent it (or is sending it) since those stats, net of completions (may
        be negative).
    sent_tokens: their prompt + max tokens, likewise.
    in_flight: requests this router sent (or is sending) it that have not completed.
    recent_hashes: routing-text hashes of the prompts this router sent it lately, each with its
        estimated prompt tokens up to its block's end (:class:`RecentPrefixes`).
    """

    replica: Hashable
    stats: dict
    max_ongoing_requests: int
    sent: int = 0
    sent_tokens: int = 0
    in_flight: int = 0
    recent_hashes: Mapping[int, int] = field(default_factory=dict)

    @property
    def held(self) -> int:
        """Requests the replica holds now (estimate)."""
        return max(self.stats.get("load", 0) + self.sent, self.in_flight, 0)


def kv_blocks(tokens: int, tokens_per_block: int) -> int:
    """Paged KV blocks that hold ``tokens`` tokens."""
    return -(-max(tokens, 0) // tokens_per_block)


def admits(c: Candidate, prompt_tokens: int, max_tokens: int) -> bool:
    """Whether ``c`` can take a request of ``prompt_tokens + max_tokens`` tokens now (see the module
    docstring); True for a replica without stats below ``max_ongoing_requests``."""
    if c.held >= c.max_ongoing_requests:
        return False
    if "free_kv_blocks" not in c.stats:  # not polled yet
        return True
    per_block = c.stats["tokens_per_block"]
    free = c.stats["free_kv_blocks"] - kv_blocks(c.sent_tokens, per_block)
    return free >= kv_blocks(prompt_tokens + max_tokens, per_block)


def unit_step_s(stats: dict) -> float | None:
    """Seconds of a generation step per request in the batch (``step_s / running``); None while the
    replica is idle or has not stepped yet."""
    running, step_s = stats.get("running", 0), stats.get("step_s", 0.0)
    return step_s / running if running > 0 and step_s > 0 else None


def speed_factors(candidates: list[Candidate]) -> dict[Hashable, float]:
    """Each replica's ``step_s`` over the median ``step_s`` of the candidates running the same number
    of requests (1.0 without such a comparison, or while idle)."""
    by_batch: dict[int, list[float]] = {}
    for c in candidates:
        if unit_step_s(c.stats) is not None:
            by_batch.setdefault(c.stats["running"], []).append(c.stats["step_s"])
    speeds = {}
    for c in candidates:
        peers = by_batch.get(c.stats.get("running", 0)) if unit_step_s(c.stats) is not None else None
        speeds[c.replica] = c.stats["step_s"] / statistics.median(peers) if peers else 1.0
    return speeds


def cached_prompt_tokens(c: Candidate, prefix_hashes: list[int] | None, prompt_tokens: int) -> int:
    """Prompt tokens of a request with routing-text hashes ``prefix_hashes`` that ``c`` likely holds in
    its prefix cache (its reported ``prefix_hashes``, or what this router sent it lately): at most
    ``prompt_tokens - 1`` (the last position is always computed)."""
    if not prefix_hashes:
        return 0
    tokens = max(cached_tokens(prefix_hashes, c.stats.get("prefix_hashes")), cached_tokens(prefix_hashes, c.recent_hashes))
    return max(min(tokens, prompt_tokens - 1), 0)


def expected_completion_s(c: Candidate, max_tokens: int, unit_s: float, speed: float = 1.0,
                          default_tau: float = 1.0) -> float:
    """Expected seconds until a request of at most ``max_tokens`` new tokens sent to ``c`` now
    completes: queueing + decoding (see the module docstring).

    unit_s: seconds of a step per request in the batch (``unit_step_s``); speed: ``c``'s step time
    relative to its peers'; default_tau: tokens per step where ``c``'s stats have none (not polled yet).
    """
    tau = c.stats.get("tau") or default_tau
    limit = c.stats.get("max_batch_size") or math.inf
    step_s = speed * unit_s * max(max_tokens, 1) / tau  # per request in the batch, for all m tokens
    arrivals = c.held + 1
    decode_s = step_s * min(arrivals, limit)
    queue_s = step_s * max(arrivals - limit, 0)
    return queue_s + decode_s


def rank_replicas(candidates: list[Candidate], prompt_tokens: int, max_tokens: int, rng: random.Random,
                  tie_tolerance: float = TIE_TOLERANCE, prefix_hashes: list[int] | None = None) -> list[Hashable]:
    """Replica ids, best first: those that admit the request by expected completion time, then
    those that do not, likewise. Candidates within ``tie_tolerance`` (relative) of the first of a
    run of ties are ties, ordered at random (``rng``). ``prefix_hashes``: the request's routing-text
    block hashes (:func:`~workers.text_prefix.text_block_hashes`); None leaves the prefix
    cache out (every replica prefills the whole prompt)."""
    units = [u for c in candidates if (u := unit_step_s(c.stats)) is not None]
    taus = [c.stats["tau"] for c in candidates if c.stats.get("tau")]
    unit = statistics.median(units) if units else 1.0
    tau = statistics.median(taus) if taus else 1.0
    speeds = speed_factors(candidates)
    prefill_s = prefill_token_s(candidates, unit if units else None)
    admitting, refusing = [], []
    for c in candidates:
        uncached = max(prompt_tokens, 1) - cached_prompt_tokens(c, prefix_hashes, prompt_tokens)
        seconds = expected_completion_s(c, max_tokens, unit, speeds[c.replica], tau) + uncached * prefill_s
        (admitting if admits(c, prompt_tokens, max_tokens) else refusing).append((seconds, c.replica))
    return _ordered(admitting, rng, tie_tolerance) + _ordered(refusing, rng, tie_tolerance)


def prefill_token_s(candidates: list[Candidate], unit_s: float | None) -> float:
    """Seconds per prefilled prompt position: the median the candidates measured when ``unit_s`` (the
    measured unit step) is known, else ``PREFILL_TOKEN_UNITS`` of it (of a unit step of 1.0 when no
    replica is running: completion times are then in steps)."""
    measured = [c.stats["prefill_s_per_token"] for c in candidates if c.stats.get("prefill_s_per_token")]
    if unit_s is not None and measured:
        return statistics.median(measured)
    return PREFILL_TOKEN_UNITS * (unit_s if unit_s is not None else 1.0)


def _ordered(scored: list[tuple[float, Hashable]], rng: random.Random, tie_tolerance: float) -> list[Hashable]:
    runs: list[list[Hashable]] = []
    first = 0.0
    for seconds, replica in sorted(scored, key=lambda s: s[0]):
        if runs and seconds <= first * (1 + tie_tolerance):
            runs[-1].append(replica)
        else:
            runs.append([replica])
            first = seconds
    for run in runs:
        rng.shuffle(run)
    return [replica for run in runs for replica in run]


class SentSinceStats:
    """What one router sent each replica, as :func:`rank_replicas` needs it between stats polls.

    A request counts against a replica from the moment the router ranks it first (:meth:`chosen`;
    Serve sends it there unless that replica is full, so requests routed concurrently see it), moves
    to the replica that accepted it (:meth:`routed`), and counts until :meth:`completed`. A choice
    neither accepted nor completed within ``choice_ttl_s`` (cancelled before it was sent) is dropped.

    Stats arrive some time after the replica measured them, and meanwhile requests of this router
    came and went. They were measured after the stats before them arrived (:meth:`observe`), so the
    requests of this router counted in them are taken as the most it had on the replica since then,
    and its KV tokens in them as the fewest (the replica's free blocks are underestimated, never
    overestimated). The rest of the replica's load is other routers'.
    """

    def __init__(self, choice_ttl_s: float = 5.0):
        self.choice_ttl_s = choice_ttl_s
        self._choices: dict[str, tuple[Hashable, int, float]] = {}  # request id -> replica, tokens, when
        self._accepted: dict[tuple[Hashable, str], int] = {}  # (replica, request id) -> tokens
        self._ours: dict[Hashable, tuple[int, int]] = {}  # replica -> requests, tokens now
        self._window: dict[Hashable, tuple[int, int]] = {}  # replica -> most requests, fewest tokens since stats
        self._in_stats: dict[Hashable, tuple[dict, int, int]] = {}  # replica -> stats, our requests, tokens in them

    def chosen(self, replica: Hashable, request_id: str, tokens: int, now: float) -> None:
        """Request ``request_id`` of ``tokens`` prompt + max tokens ranked ``replica`` first at ``now`` (s)."""
        self._drop_choice(request_id)
        self._choices[request_id] = (replica, tokens, now)
        self._add(replica, 1, tokens)

    def routed(self, replica: Hashable, request_id: str, tokens: int) -> None:
        """``replica`` accepted the request."""
        self._drop_choice(request_id)
        self._accepted[(replica, request_id)] = tokens
        self._add(replica, 1, tokens)

    def completed(self, replica: Hashable, request_id: str) -> None:
        """The request sent to ``replica`` ended, or ``replica`` rejected it (it may be chosen anew)."""
        self._drop_choice(request_id, replica)
        tokens = self._accepted.pop((replica, request_id), None)
        if tokens is not None:
            self._add(replica, -1, -tokens)

    def observe(self, replica: Hashable, stats: dict) -> None:
        """``stats`` are ``replica``'s latest (``{}``: not polled yet, nothing of ours in them)."""
        last = self._in_stats.get(replica)
        if last is not None and (last[0] is stats or last[0] == stats):  # the same poll (stats carry ~4K hashes)
            return
        ours = self._ours.get(replica, (0, 0))
        most, fewest = self._window.get(replica, ours)
        self._in_stats[replica] = (stats, most, fewest) if stats else (stats, 0, 0)
        self._window[replica] = ours

    def candidates(self, replicas: list[tuple[Hashable, dict, int]], now: float) -> list[Candidate]:
        """``(replica, latest stats, max_ongoing_requests)`` with what was sent since those stats, at
        ``now`` (s, the clock of :meth:`chosen`)."""
        for request_id in [r for r, (_, _, when) in self._choices.items() if now - when > self.choice_ttl_s]:
            self._drop_choice(request_id)
        out = []
        for replica, stats, max_ongoing in replicas:
            self.observe(replica, stats)
            _, requests_then, tokens_then = self._in_stats[replica]
            requests, tokens = self._ours.get(replica, (0, 0))
            out.append(Candidate(replica, stats, max_ongoing, sent=requests - requests_then,
                                 sent_tokens=tokens - tokens_then, in_flight=requests))
        return out

    def forget_except(self, replicas: set) -> None:
        """Drop the state of replicas that are gone."""
        for table in (self._ours, self._window, self._in_stats):
            for replica in [r for r in table if r not in replicas]:
                del table[replica]
        for key in [k for k in self._accepted if k[0] not in replicas]:
            del self._accepted[key]
        for request_id in [r for r, (replica, _, _) in self._choices.items() if replica not in replicas]:
            del self._choices[request_id]

    def _add(self, replica: Hashable, requests: int, tokens: int) -> None:
        before = self._ours.get(replica, (0, 0))
        held, total = before[0] + requests, before[1] + tokens
        self._ours[replica] = (held, total)
        most, fewest = self._window.get(replica, before)
        self._window[replica] = (max(most, held), min(fewest, total))

    def _drop_choice(self, request_id: str, replica: Hashable | None = None) -> None:
        choice = self._choices.get(request_id)
        if choice is not None and replica in (None, choice[0]):
            del self._choices[request_id]
            self._add(choice[0], -1, -choice[1])


class RecentPrefixes:
    """The routing-text hashes of the prompts one router sent each replica in the last ``ttl_s``
    seconds, each with its prompt tokens estimated at ``DEFAULT_CHARS_PER_TOKEN``: a replica reports
    its hashes only at the next stats poll, and followers of a prompt sent meanwhile should find it
    there. At most ``max_per_replica`` hashes per replica, newest kept, and a quarter of that per
    prompt; a prompt's first blocks are its newest, so trimming drops chains' tails first."""

    def __init__(self, ttl_s: float = 10.0, max_per_replica: int = 1024):
        self.ttl_s, self.max_per_replica = ttl_s, max_per_replica
        self._sent: dict[Hashable, dict[int, tuple[int, float]]] = {}  # replica -> hash -> (tokens, when sent)
        self._views: dict[Hashable, dict[int, int]] = {}

    def sent(self, replica: Hashable, hashes: list[int], now: float) -> None:
        """A prompt with routing-text ``hashes`` went to ``replica`` at ``now`` (s)."""
        hashes = hashes[: max(self.max_per_replica // 4, 1)]
        tokens = block_tokens(hashes, 1 / DEFAULT_CHARS_PER_TOKEN)
        table = self._sent.setdefault(replica, {})
        for h in reversed(hashes):
            table.pop(h, None)
            table[h] = (tokens[h], now)
        while len(table) > self.max_per_replica:
            del table[next(iter(table))]
        self._views.pop(replica, None)

    def of(self, replica: Hashable, now: float) -> dict[int, int]:
        """``{hash: tokens}`` sent to ``replica`` within ``ttl_s`` of ``now`` (do not modify)."""
        table = self._sent.get(replica)
        if not table:
            return {}
        stale = [h for h, (_, when) in table.items() if now - when > self.ttl_s]
        for h in stale:
            del table[h]
        if stale or replica not in self._views:
            self._views[replica] = {h: tokens for h, (tokens, _) in table.items()}
        return self._views[replica]

    def forget_except(self, replicas: set) -> None:
        for replica in [r for r in self._sent if r not in replicas]:
            del self._sent[replica]
            self._views.pop(replica, None)
