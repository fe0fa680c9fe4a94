"""One engine replica: owns an engine, tracks its load, routes each request and streams it.

The engine runs on its own thread (:class:`workers.async_engine.AsyncEngine`) and decodes every
admitted request together (in-flight batching); tokenization runs on that thread too, so the asyncio
event loop never blocks and the tokenizer is never used from two threads at once. A client that goes
away aborts its request, which frees its KV blocks at the next iteration.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import AsyncIterator
from dataclasses import replace

from jinja2.exceptions import TemplateError, TemplateSyntaxError
from ray import serve
from ray.serve.exceptions import RayServeException

from cluster.config import RdserveConfig
from cluster.replica.build import build_engine
from cluster.ingress.messages import EngineRequest, Failed, Started
from cluster.observability.recorder import ReplicaMetrics
from cluster.replica.placement import placement_gpu_ids, uses_gpu_placement
from cluster.ingress.protocol import RequestError, check_prompt_chars, check_token_ids, fit_kv_cache, resolve_max_tokens
from cluster.replica.stats import PrefixStats, TtftWindow, engine_stats
from workers.text_prefix import routing_text
from cluster.replica.spec_mode import choose_mode
from workers.async_engine import AsyncEngine, EngineFailure
from workers.outputs import GenerationDelta
from workers.speculation.policy import policy_text
from workers.structured.errors import GrammarError

log = logging.getLogger("ray.serve")


def serve_replica_id() -> str:
    """This replica's Ray Serve id (``ReplicaID.unique_id``), or ``"local"`` outside Serve."""
    try:
        return serve.get_replica_context().replica_id.unique_id
    except RayServeException:
        return "local"


@serve.deployment
class EngineReplica:
    """Ray Serve deployment; ``generate`` streams ``Started``, then engine deltas, or one ``Failed``."""

    def __init__(self, cfg: RdserveConfig):
        gpus = placement_gpu_ids(cfg.engine.tp_size) if uses_gpu_placement(cfg) else None  # rank r -> GPU
        self.async_engine = AsyncEngine(lambda: build_engine(cfg, gpus))  # built on the engine's own thread
        self.engine = self.async_engine.engine
        selected = self.engine.spec_selection
        self.per_iteration = selected.policy.live  # the goodput model decides per iteration
        self.spec_cfg = cfg.speculation if selected.spec_max_load is None else cfg.speculation.model_copy(
            update={"spec_max_load": selected.spec_max_load})  # this compute path's table reaches that far
        self.load = 0
        self.ttft = TtftWindow()
        self.replica_id = serve_replica_id()
        self.prefix = PrefixStats() if self.engine.options.enable_prefix_caching else None  # cache-aware routing
        self.metrics = ReplicaMetrics(self.async_engine, cfg.model.name,
                                      cfg.speculation.draft_len_per_beam if cfg.drafter.path else 0) \
            if cfg.observability.enabled else None
        log.info("%s", self.engine.snapshot().kv_size)
        log.info("engine ready: model %s, drafter %s, compute path %s, speculation %s (%s), spec_max_load %d",
                 cfg.model.path or "default", cfg.drafter.path, self.engine.compute_path,
                 policy_text(selected.policy), selected.source, self.spec_cfg.spec_max_load)

    def check_health(self) -> None:
        """Ray Serve's health probe: a replica whose tensor-parallel rank died is replaced.

        Raises:
            RuntimeError: the executor lost a rank (every iteration would fail), or the engine thread died.
        """
        failure = self.engine.snapshot().failure
        if failure is not None:
            raise RuntimeError(f"engine executor failed: {failure}")
        if not self.async_engine.alive:
            raise RuntimeError("the engine thread has stopped")

    def record_routing_stats(self) -> dict:
        """Ray Serve's routing-stats hook: see :mod:`cluster.replica.stats`."""
        if self.prefix:
            self.prefix.prefill_s_per_token = self.async_engine.prefill_s_per_token
        return engine_stats(self.engine.snapshot(), self.load, self.async_engine.step_s, self.ttft.p90(),
                            self.engine.options.max_batch_size, self.engine.speculative_available, self.prefix)

    def record_autoscaling_stats(self) -> dict:
        """Ray Serve's custom autoscaling metrics hook (the same numbers, see :mod:`cluster.replica.stats`)."""
        stats = self.record_routing_stats()
        return {k: v for k, v in stats.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}

    def stats(self) -> dict:
        """``load`` (requests held: decoding or queued), ``speculative_available``, the paged KV
        cache's size and free blocks, and with adaptive threads, ``threads``: per size class of step,
        each thread count's step time and steps run (:meth:`workers.thread_policy.ThreadPolicy.stats`)."""
        snap = self.engine.snapshot()
        kv = snap.kv_size
        return {"load": self.load, "speculative_available": self.engine.speculative_available,
                "compute_path": self.engine.compute_path, "speculation": policy_text(self.engine.spec_policy),
                "spec_max_load": self.spec_cfg.spec_max_load,
                "kv_cache": {"blocks": kv.num_blocks, "tokens_per_block": kv.block_size, "tokens": kv.num_tokens,
                             "mib": round(kv.mib, 1), "dtype": kv.dtype, "free_blocks": snap.free_blocks,
                             "cached_blocks": snap.cached_blocks},
                **({"threads": policy.stats()} if (policy := self.engine.thread_policy) else {}),
                **({"failure": str(failure)} if (failure := snap.failure or self.async_engine.failure)
                   else {})}

    def processes(self) -> dict:
        """OS processes of this replica, for operators and fault-injection tests: ``{"pid": int,
        "tp_pids": [rank 0, rank 1, ...]}`` (``tp_pids`` empty without tensor parallelism)."""
        comm = getattr(self.engine.executor, "comm", None)
        return {"pid": os.getpid(), "tp_pids": list(getattr(comm, "pids", []) or [])}

    def stall_engine_for_test(self, seconds: float) -> None:
        """Fault-injection hook: the engine thread sleeps ``seconds`` before its next iteration, stalling
        every request in flight (as a hung step would). Reached only through a Serve handle, never HTTP."""
        self.async_engine.call_soon(time.sleep, seconds)

    async def generate(self, req: EngineRequest) -> AsyncIterator[Started | Failed | GenerationDelta]:
        self.load += 1
        timing = self.metrics.request() if self.metrics else None
        try:
            async with contextlib.aclosing(self._generate(req)) as items:
                async for item in items:
                    if timing:
                        timing.see(item)
                    yield item
        except EngineFailure as err:  # an iteration failed: every request in it ends with 500
            yield Failed(500, str(err))
        except Exception as err:  # an engine failure must end the stream, never hang it
            log.exception("generation failed")
            yield Failed(500, f"engine error: {type(err).__name__}: {err}")
        finally:
            self.load -= 1

    def _budget(self, req: EngineRequest, prompt_tokens: int, prompt_field: str) -> int:
        """The request's completion budget within the context length and the whole KV cache.

        Raises:
            RequestError: the prompt is empty, or it (or it with ``req.max_tokens``) does not fit.
        """
        max_tokens = resolve_max_tokens(req.max_tokens, prompt_tokens, self.engine.max_seq_len,
                                        prompt_field=prompt_field, max_tokens_field=req.max_tokens_field)
        return fit_kv_cache(max_tokens, prompt_tokens, self.engine.snapshot().kv_size.num_tokens,
                            defaulted=req.max_tokens is None, prompt_field=prompt_field,
                            max_tokens_field=req.max_tokens_field)

    async def _compile_grammar(self, req: EngineRequest) -> None:
        """Raises:
            RequestError: the grammar does not compile, or no grammar engine is installed (names the
                request field that set it).
        """
        field = req.grammar_field or "response_format"
        try:
            await asyncio.to_thread(self.engine.compile_grammar, req.sampling.grammar)
        except GrammarError as err:
            raise RequestError(field, f"{field}: {err}") from None

    async def _generate(self, req: EngineRequest) -> AsyncIterator[Started | Failed | GenerationDelta]:
        prompt_field = "messages" if req.messages is not None else "prompt"
        try:
            text = req.prompt if req.messages is None else "".join(str(m.get("content", "")) for m in req.messages)
            check_prompt_chars(len(text), self.engine.max_seq_len, prompt_field)
            if req.messages is not None:
                prompt_ids = await self.async_engine.call(self.engine.encode_chat, req.messages, req.tools)
            else:
                prompt_ids = await self.async_engine.call(self.engine.encode_prompt, req.prompt)
            max_tokens = self._budget(req, len(prompt_ids), prompt_field)
            check_token_ids(replace(req.sampling, max_tokens=max_tokens), self.engine.config.vocab_size)
            if req.sampling.grammar is not None:  # compiled off the engine thread (cached by spec)
                await self._compile_grammar(req)
        except RequestError as err:
            yield Failed(400, err.message, err.param)
            return
        except TemplateSyntaxError:  # the model's chat template is broken: a server fault (500)
            raise
        except (ValueError, TemplateError) as err:  # no chat template, or its raise_exception ("roles must alternate")
            yield Failed(400, f"{prompt_field}: {err}", prompt_field)
            return
        if self.prefix:  # its prompt blocks enter the prefix cache: the router may send its followers here
            self.prefix.admitted(routing_text(req.prompt, req.messages, req.tools, req.sampling.cache_salt),
                                 len(prompt_ids))
        can_draft = self.engine.speculative_available and self.engine.forced_shape is not None
        mode, reason = choose_mode(self.load, req.mode, self.spec_cfg, can_draft, self.per_iteration,
                                   "no drafter loaded" if not self.engine.speculative_available
                                   else "speculation off (speculation.policy)")
        log.info("request: %d prompt tokens, max_tokens %d, mode %s (%s)", len(prompt_ids), max_tokens, mode, reason)
        params = replace(req.sampling, max_tokens=max_tokens)
        start, first = time.monotonic(), True
        try:
            async with contextlib.aclosing(self.async_engine.generate(
                    prompt_ids, params, mode,  # a spec requested, or the default mode, drafts every step
                    force_draft=(req.mode or self.spec_cfg.default_mode) == "spec")) as deltas:
                async for delta in deltas:
                    if first:  # Started goes out with the first token: nothing else crosses Ray during prefill,
                        self.ttft.add(time.monotonic() - start)  # and a request the engine rejects is a clean 400
                        yield Started(len(prompt_ids), mode, reason, self.replica_id)
                        first = False
                    yield delta
        except ValueError as err:  # rejected by the engine (the KV cache's capacity is checked by _budget)
            yield Failed(400, f"{prompt_field}: {err}", prompt_field)
