"""Two-pool mode: a speculative pool and a plain pool of the same model; the ingress picks per request.

Some engines cannot switch speculation off per request (TensorRT-LLM builds ReDrafter's
``num_beams`` and ``draft_len_per_beam`` into the engine). ``serve.pools`` then runs two
deployments: ``spec`` (every request drafts with one fixed shape) and ``plain`` (no drafter). The
ingress sends each request to the pool where the goodput model (:mod:`workers.speculation.goodput`) expects it
to decode fastest, given how many requests each pool holds per replica: at low load the speculative
pool wins (a tree costs little next to one request), under load its per-request rate falls faster
than plain decoding's and requests move to the plain pool.

:func:`choose_pool` is the pure decision; :class:`PoolLoad` is the ingress's count of what it has
in flight on each pool (the ingress is the only sender, so its counts are exact for one ingress
replica and proportional for several).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from workers.speculation.goodput import Shape, StepCosts, plain_rate, spec_rate

POOLS = ("spec", "plain")


def choose_pool(costs: StepCosts, shape: Shape, tau: float, spec_load: int, spec_replicas: int,
                plain_load: int, plain_replicas: int) -> tuple[str, str]:
    """``("spec" | "plain", reason)`` for one new request.

    spec_load, plain_load: requests each pool holds now (without the new one).
    spec_replicas, plain_replicas: running replicas of each pool (at least 1 is assumed).
    tau: live tokens per step of the speculative pool (its shape ``shape``).
    The request joins the pool whose expected tokens/s per request, at its batch size with the new
    request (load per replica + 1), is higher; ties go to the speculative pool.
    """
    b_spec = spec_load / max(spec_replicas, 1) + 1
    b_plain = plain_load / max(plain_replicas, 1) + 1
    per_spec = spec_rate(costs, b_spec, shape, tau) / b_spec
    per_plain = plain_rate(costs, b_plain) / b_plain
    pool = "spec" if per_spec >= per_plain else "plain"
    reason = (f"pool {pool}: expected {per_spec:.1f} tok/s per request speculating ({shape[0]}x{shape[1]}, "
              f"tau {tau:.2f}, batch {b_spec:.1f}) vs {per_plain:.1f} plain (batch {b_plain:.1f})")
    return pool, reason


@dataclass
class PoolLoad:
    """Requests the ingress has in flight on each pool, and each pool's replicas and live tau."""

    costs: StepCosts
    shape: Shape
    in_flight: dict[str, int] = field(default_factory=lambda: {p: 0 for p in POOLS})
    replicas: dict[str, int] = field(default_factory=lambda: {p: 1 for p in POOLS})
    tau: float | None = None

    def choose(self) -> tuple[str, str]:
        tau = self.tau if self.tau is not None else self.costs.tokens_per_step[self.shape]
        return choose_pool(self.costs, self.shape, tau, self.in_flight["spec"], self.replicas["spec"],
                           self.in_flight["plain"], self.replicas["plain"])

    def started(self, pool: str) -> None:
        self.in_flight[pool] += 1

    def finished(self, pool: str) -> None:
        self.in_flight[pool] -= 1


class TrackedStream:
    """Wraps a response stream (``DeploymentResponseGenerator``): ``on_done()`` runs exactly once,
    when the stream ends, fails, is cancelled or is dropped, so :class:`PoolLoad` counts stay exact."""

    def __init__(self, stream, on_done):
        self._stream = stream
        self._on_done = on_done

    def _done(self) -> None:
        on_done, self._on_done = self._on_done, None
        if on_done is not None:
            on_done()

    def __aiter__(self):
        return self

    async def __anext__(self):
        try:
            return await self._stream.__anext__()
        except BaseException:  # StopAsyncIteration included: the stream is over
            self._done()
            raise

    def cancel(self) -> None:
        self._stream.cancel()
        self._done()

    def __del__(self):
        self._done()
