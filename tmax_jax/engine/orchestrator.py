"""Continuous batching over an :class:`Engine`: a request queue, a prefill thread, a generate thread.

The prefill thread takes the queued requests (up to the engine's ``max_prefill_batch``) and turns
them into prefixes in one ``Engine.prefill_many`` call: new prompts are prefilled batched, samples of
one prompt share one prefill, and the next turn of a conversation reuses its session's cached state
so only the new tokens are prefilled. Prefixes go to the generate thread through a bounded queue;
it inserts them into free slots between decode blocks, runs a block of decode steps over all slots
in one jitted call, and streams every token with its logprob and the policy version that produced
it (weights change only between blocks). Tokens a slot produced after its stop (a stop string, a
cancel) are discarded, never emitted. A slot that finishes is refilled before the next block. Both queues are bounded, so a
producer that outruns the engine blocks (or gets :class:`EngineBusy`) instead of growing memory.
"""

from __future__ import annotations

import dataclasses
import itertools
import queue
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import numpy as np

from tmax_jax.engine.engine import Engine, PrefillRequest, Prefix, _next_pow2
from tmax_jax.engine.sampling import SamplingParams
from tmax_jax.errors import ConfigError, TmaxError


class EngineBusy(TmaxError):
    """The request queue is full (backpressure); retry later."""


class RequestCancelled(TmaxError):
    """Raised by ``RequestHandle.result`` for a cancelled request."""


@dataclasses.dataclass(frozen=True)
class Request:
    """One generation request. ``stop_token_ids=None`` uses the engine's eos tokens."""

    prompt: Sequence[int]
    max_tokens: int = 256
    sampling: SamplingParams = SamplingParams()
    stop_token_ids: Sequence[int] | None = None
    stop: Sequence[str] = ()
    session_id: str | None = None


@dataclasses.dataclass
class Completion:
    """A finished request. ``logprobs[i]`` is the sampling-distribution logprob of ``tokens[i]``;
    ``versions[i]`` the policy version (``Engine.version``) whose weights produced it."""

    tokens: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: str  # "stop" | "length" | "cancelled"
    prompt_tokens: int
    cached_tokens: int  # prompt tokens reused from the session's previous turn (not prefilled)
    stop_string: str | None = None
    ttft_s: float = 0.0
    latency_s: float = 0.0
    # Engines with record_routing (MoE): int16 [len(tokens), layers, top_k], the experts each MoE
    # layer routed ``tokens[i]`` to when the engine fed it back; -1 for the last token (never fed in
    # this turn). The first token's input (the prompt's last token) was prefilled: not recorded.
    experts: np.ndarray | None = None


@dataclasses.dataclass(frozen=True)
class TokenEvent:
    token: int
    logprob: float
    version: int


_DONE = object()


class RequestHandle:
    """Returned by :meth:`Orchestrator.submit`: iterate for streamed tokens, ``result()`` to wait."""

    def __init__(self, rid: int, request: Request, routing_shape: tuple[int, int] | None = None):
        self.id = rid
        self.request = request
        # With routing recorded: experts[i] = the ids tokens[i] was routed to when fed ([layers, top_k]).
        self.routing_shape = routing_shape
        self.experts: list[np.ndarray] | None = None if routing_shape is None else []
        self._events: queue.Queue = queue.Queue()
        self._done = threading.Event()
        self._cancel = threading.Event()
        self._completion: Completion | None = None
        self._error: BaseException | None = None
        self.submitted_at = time.perf_counter()
        self.first_token_at: float | None = None
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[int] = []
        self.cached_tokens = 0
        self.slot: int | None = None

    # Called by the orchestrator's threads.
    def _emit(self, token: int, logprob: float, version: int) -> None:
        if self.first_token_at is None:
            self.first_token_at = time.perf_counter()
        self.tokens.append(token)
        self.logprobs.append(logprob)
        self.versions.append(version)
        self._events.put(TokenEvent(token, logprob, version))

    def _finish(self, reason: str, stop_string: str | None = None) -> None:
        now = time.perf_counter()
        self._completion = Completion(
            tokens=list(self.tokens),
            logprobs=list(self.logprobs),
            versions=list(self.versions),
            finish_reason=reason,
            prompt_tokens=len(self.request.prompt),
            cached_tokens=self.cached_tokens,
            stop_string=stop_string,
            ttft_s=(self.first_token_at or now) - self.submitted_at,
            latency_s=now - self.submitted_at,
            experts=self._experts(),
        )
        self._done.set()
        self._events.put(_DONE)

    def _experts(self) -> np.ndarray | None:
        if self.experts is None:
            return None
        if self.tokens and len(self.experts) != len(self.tokens) - 1:
            raise TmaxError(
                f"request {self.id}: {len(self.experts)} routing records for {len(self.tokens)} tokens"
            )
        out = np.full((len(self.tokens), *self.routing_shape), -1, np.int16)
        if self.experts:
            out[: len(self.experts)] = np.stack(self.experts)
        return out

    def _fail(self, error: BaseException) -> None:
        self._error = error
        self._done.set()
        self._events.put(_DONE)

    # Public.
    @property
    def done(self) -> bool:
        return self._done.is_set()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    def cancel(self) -> None:
        """Stop this request; its slot is freed at the next step. Tokens so far stay in the result."""
        self._cancel.set()

    def __iter__(self) -> Iterator[TokenEvent]:
        while True:
            ev = self._events.get()
            if ev is _DONE:
                return
            yield ev

    def result(self, timeout: float | None = None) -> Completion:
        if not self._done.wait(timeout):
            raise TimeoutError(f"request {self.id} not finished after {timeout}s")
        if self._error is not None:
            raise self._error
        assert self._completion is not None
        return self._completion


@dataclasses.dataclass
class _Session:
    tokens: list[int]  # tokens held in ``prefix.cache``
    prefix: Prefix


@dataclasses.dataclass
class _Live:
    handle: RequestHandle
    prompt: list[int]  # full prompt of this turn
    stop_ids: frozenset[int]


class Orchestrator:
    """Drives an :class:`Engine` with continuous batching. Use as a context manager or call ``stop``.

    Args:
      engine: the engine (its current parameters are read at every step, see ``Engine.update_params``).
      max_queued: bound of the request queue; ``submit(block=False)`` raises EngineBusy past it.
      tokenizer: needed only for stop strings (anything with ``decode(list[int]) -> str``).
    """

    def __init__(self, engine: Engine, *, max_queued: int = 1024, tokenizer: Any = None):
        self.engine = engine
        self.tokenizer = tokenizer if tokenizer is not None else engine.get_tokenizer()
        self._requests: queue.Queue = queue.Queue(maxsize=max_queued)
        self._prefilled: queue.Queue = queue.Queue(maxsize=max(1, engine.max_concurrent_decodes))
        self._sessions: dict[str, _Session] = {}
        self._sessions_lock = threading.Lock()
        self._ids = itertools.count()
        self._live = True
        self._decode_state = engine.init_decode_state()
        self._slots: list[_Live | None] = [None] * engine.max_concurrent_decodes
        self._routing_shape = getattr(engine, "routing_shape", None)
        self.steps = 0
        # Decode work since take_decode_counts: slot-steps (a live slot in one model step) and the
        # tokens they emitted (a speculative step emits 1 to tokens_per_step per slot).
        self._counts_lock = threading.Lock()
        self._slot_steps = self._decode_tokens = 0
        # The same since the start: tokens per step so far sizes a speculative engine's blocks.
        self._all_slot_steps = self._all_tokens = 0
        self._prefilling = 0
        self._error: BaseException | None = None
        self._threads = [
            threading.Thread(target=self._guard(self._prefill_loop), name="tmax-prefill", daemon=True),
            threading.Thread(target=self._guard(self._generate_loop), name="tmax-generate", daemon=True),
        ]
        for t in self._threads:
            t.start()

    # ----------------------------------------------------------------- public
    def submit(self, request: Request, *, block: bool = True, timeout: float | None = None) -> RequestHandle:
        """Queue ``request``. Raises ConfigError for an invalid one, EngineBusy when the queue is full."""
        if self._error is not None:
            raise TmaxError(f"orchestrator stopped after an internal error: {self._error!r}") from self._error
        if not self._live:
            raise TmaxError("orchestrator is stopped")
        self._validate(request)
        handle = RequestHandle(next(self._ids), request, self._routing_shape)
        try:
            self._requests.put(handle, block=block, timeout=timeout)
        except queue.Full:
            raise EngineBusy(f"request queue full ({self._requests.maxsize} waiting)") from None
        if not self._live and not handle.done:
            handle._finish("cancelled")  # stop() ran between the check above and the put
        return handle

    def generate(self, requests: Sequence[Request]) -> list[Completion]:
        handles = [self.submit(r) for r in requests]
        return [h.result() for h in handles]

    def close_session(self, session_id: str) -> None:
        """Drop a session's cached state (its memory is one cache row)."""
        with self._sessions_lock:
            self._sessions.pop(session_id, None)

    @property
    def num_sessions(self) -> int:
        with self._sessions_lock:
            return len(self._sessions)

    def stop(self) -> None:
        self._live = False
        for q in (self._requests, self._prefilled):
            try:
                q.put_nowait(None)
            except queue.Full:
                pass
        for t in self._threads:
            t.join(timeout=30)
        # Anything left waiting will never run.
        for q in (self._requests, self._prefilled):
            while True:
                try:
                    item = q.get_nowait()
                except queue.Empty:
                    break
                handle = item[0] if isinstance(item, tuple) else item
                if isinstance(handle, RequestHandle) and not handle.done:
                    handle._finish("cancelled")
        for live in self._slots:
            if live is not None and not live.handle.done:
                live.handle._finish("cancelled")

    def __enter__(self) -> Orchestrator:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    # ----------------------------------------------------------------- internals
    def _guard(self, fn):
        def run():
            try:
                fn()
            except BaseException as e:  # surface engine failures to every waiter, then stop
                self._error = e
                self._live = False
                for live in self._slots:
                    if live is not None and not live.handle.done:
                        live.handle._fail(e)
                while True:
                    try:
                        item = self._requests.get_nowait()
                    except queue.Empty:
                        break
                    if isinstance(item, RequestHandle):
                        item._fail(e)
                raise

        return run

    def _validate(self, r: Request) -> None:
        eng = self.engine
        prompt = list(r.prompt)
        if not prompt:
            raise ConfigError("request prompt is empty")
        if not all(isinstance(t, (int, np.integer)) and 0 <= t < eng.vocab_size for t in prompt):
            raise ConfigError(f"prompt token ids must be integers in [0, {eng.vocab_size})")
        if len(prompt) >= eng.max_cache_length:
            raise ConfigError(
                f"prompt has {len(prompt)} tokens; max_cache_length={eng.max_cache_length} leaves no room"
            )
        if isinstance(r.max_tokens, bool) or not isinstance(r.max_tokens, int) or r.max_tokens < 1:
            raise ConfigError(f"max_tokens must be a positive integer, got {r.max_tokens!r}")
        if not isinstance(r.sampling, SamplingParams):
            raise ConfigError(f"sampling must be a SamplingParams, got {type(r.sampling).__name__}")
        if r.stop and self.tokenizer is None:
            raise ConfigError("stop strings need a tokenizer (give one to the Engine or the Orchestrator)")
        if isinstance(r.stop, str) or not all(isinstance(s, str) and s for s in r.stop):
            raise ConfigError(f"stop must be a list of non-empty strings, got {r.stop!r}")
        eng._stop_array(r.stop_token_ids)

    def _stop_ids(self, r: Request) -> frozenset[int]:
        ids = self.engine.eos_token_ids if r.stop_token_ids is None else r.stop_token_ids
        return frozenset(int(t) for t in ids)

    def _session_start(self, handle: RequestHandle) -> tuple[Prefix | None, int]:
        """The session's cached prefix and how many prompt tokens it holds (None, 0 if unusable)."""
        r = handle.request
        if r.session_id is None:
            return None, 0
        prompt = [int(t) for t in r.prompt]
        with self._sessions_lock:
            sess = self._sessions.pop(r.session_id, None)
        if sess is not None and len(sess.tokens) < len(prompt) and prompt[: len(sess.tokens)] == sess.tokens:
            return sess.prefix, len(sess.tokens)
        return None, 0

    def _prefill_batch(
        self, handles: list[RequestHandle]
    ) -> list[tuple[Prefix, int, float, int] | BaseException]:
        """Prefill ``handles`` in one engine call; per handle (prefix, first token, logprob, version)
        or the error that request raised (a bad one is retried alone so it fails alone)."""
        reqs, starts = [], []
        for h in handles:
            existing, start = self._session_start(h)
            r = h.request
            reqs.append(
                PrefillRequest(
                    tokens=[int(t) for t in r.prompt[start:]],
                    sampling_params=r.sampling,
                    max_tokens=r.max_tokens,
                    stop_token_ids=r.stop_token_ids,
                    existing_prefix=existing,
                )
            )
            starts.append(start)
        params, version = self.engine.current_params()
        try:
            prefixes = self.engine.prefill_many(params, reqs)
        except Exception as e:  # noqa: BLE001 - isolate the request that caused it
            if len(reqs) == 1:
                return [e]
            prefixes = []
            for r in reqs:
                try:
                    prefixes.extend(self.engine.prefill_many(params, [r]))
                except Exception as e1:  # noqa: BLE001
                    prefixes.append(e1)
        firsts = [None if isinstance(p, BaseException) else (p.token, p.log_prob) for p in prefixes]
        firsts = jax.device_get(firsts)
        out = []
        for h, start, p, f in zip(handles, starts, prefixes, firsts):
            if isinstance(p, BaseException):
                out.append(p)
                continue
            h.cached_tokens = start
            out.append((p, int(f[0][0]), float(f[1][0]), version))
        return out

    def _prefill_loop(self) -> None:
        while self._live:
            handle = self._requests.get()
            if handle is None:
                return
            batch, stop_after = [handle], False
            while len(batch) < self.engine.max_prefill_batch:
                try:
                    more = self._requests.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    stop_after = True
                    break
                batch.append(more)
            todo = []
            for h in batch:
                if h.cancelled:
                    h._finish("cancelled")
                else:
                    todo.append(h)
            self._prefilling += len(todo)
            try:
                results = self._prefill_batch(todo) if todo else []
            finally:
                self._prefilling -= len(todo)
            for h, res in zip(todo, results):
                if isinstance(res, BaseException):  # this request's failure (e.g. a bad session prefix)
                    h._fail(res)
                    continue
                self._hand_over(h, *res)
            if stop_after:
                return

    def _hand_over(
        self, handle: RequestHandle, prefix: Prefix, token: int, logprob: float, version: int
    ) -> None:
        handle._emit(token, logprob, version)
        live = _Live(handle, [int(t) for t in handle.request.prompt], self._stop_ids(handle.request))
        reason, stop_string = self._finish_reason(live, prefix.length)
        if reason is not None:
            self._save_session(live, prefix)
            handle._finish(reason, stop_string)
            return
        while self._live:
            try:
                self._prefilled.put((handle, prefix, live), timeout=0.1)
                return
            except queue.Full:
                continue
        # stop() came during this prefill: it drained the queues before this handle got there, so
        # nobody else will finish it (its waiter would block forever).
        handle._finish("cancelled")

    def _finish_reason(self, live: _Live, cached: int) -> tuple[str | None, str | None]:
        """Why ``live`` ends after its latest token (mirrors the device-side checks), or None."""
        h = live.handle
        r = h.request
        if h.cancelled:
            return "cancelled", None
        if h.tokens[-1] in live.stop_ids:
            return "stop", None
        if r.stop:
            text = self.tokenizer.decode(h.tokens)
            for s in r.stop:
                if s in text:
                    return "stop", s
        if len(h.tokens) >= r.max_tokens or cached >= self.engine.max_cache_length:
            return "length", None
        return None, None

    def _save_session(self, live: _Live, prefix: Prefix) -> None:
        sid = live.handle.request.session_id
        if sid is None or live.handle.cancelled:
            return
        # The cache holds the prompt and every generated token but the last (never fed back).
        tokens = live.prompt + live.handle.tokens[:-1]
        with self._sessions_lock:
            self._sessions[sid] = _Session(tokens=tokens, prefix=prefix)

    def _admit(self) -> None:
        """Fill free slots with prefilled requests. Waits for one when nothing is decoding, or when a
        prefill is pending (as JetStream's interleaved mode: a free slot is worth more than one step)."""
        eng = self.engine
        while True:
            free = [i for i, s in enumerate(self._slots) if s is None]
            if not free:
                return
            idle = len(free) == len(self._slots)
            pending = self._prefilling > 0 or not self._requests.empty()
            try:
                item = self._prefilled.get(block=idle or pending, timeout=0.05)
            except queue.Empty:
                if pending and not idle:
                    continue
                return
            if item is None:
                self._live = False
                return
            handle, prefix, live = item
            if handle.cancelled:
                handle._finish("cancelled")
                continue
            slot = free[0]
            self._decode_state = eng.insert(prefix, self._decode_state, slot)
            handle.slot = slot
            self._slots[slot] = live
            del prefix

    def _release(
        self, slot: int, live: _Live, reason: str, stop_string: str | None, device_done: bool
    ) -> None:
        eng = self.engine
        if not device_done:
            self._decode_state = eng.deactivate(self._decode_state, slot)
        if live.handle.request.session_id is not None and reason != "cancelled":
            length = len(live.prompt) + len(live.handle.tokens) - 1
            self._save_session(live, eng.extract_prefix(self._decode_state, slot, length))
        eng.free_resource(slot)
        self._slots[slot] = None
        live.handle._finish(reason, stop_string)

    def take_decode_counts(self) -> tuple[int, int]:
        """(slot-steps, tokens emitted by them) since the last call: their ratio is the mean number
        of tokens a model step gives a slot (1 without speculative decoding)."""
        with self._counts_lock:
            out = (self._slot_steps, self._decode_tokens)
            self._slot_steps = self._decode_tokens = 0
        return out

    def _block_steps(self) -> int:
        """Decode steps for the next block: the engine's ``decode_steps``, fewer (a power of two) when
        every live request ends sooner, 1 while a session request with stop strings decodes (a stop
        string found mid-block would leave tokens past it in the cache its next turn reuses). A
        speculative engine's steps give several tokens each: it counts the tokens per step its
        slots got so far."""
        eng = self.engine
        live = [s for s in self._slots if s is not None]
        if any(s.handle.request.stop and s.handle.request.session_id is not None for s in live):
            return 1
        remaining = max(s.handle.request.max_tokens - len(s.handle.tokens) for s in live)
        per_step = max(1.0, self._all_tokens / max(self._all_slot_steps, 1))
        steps = int(np.ceil(max(remaining, 1) / per_step))
        return max(1, min(eng.decode_steps, _next_pow2(max(steps, 1))))

    def _generate_loop(self) -> None:
        eng = self.engine
        while self._live:
            self._admit()
            if not self._live:
                return
            # Cancellations between blocks free their slots before spending compute on them.
            for slot, live in enumerate(self._slots):
                if live is not None and live.handle.cancelled:
                    self._release(slot, live, "cancelled", None, device_done=False)
            if all(s is None for s in self._slots):
                continue
            steps = self._block_steps()
            live_now = [s for s in self._slots if s is not None]
            longest = max(len(s.prompt) + len(s.handle.tokens) - 1 for s in self._slots if s is not None)
            params, version = eng.current_params()
            # A session request with stop strings keeps the cache of exactly the tokens up to its
            # stop, so its steps emit one token each (speculative engines keep no draft then).
            exact = any(s.handle.request.stop and s.handle.request.session_id is not None for s in live_now)
            extra = {"speculate": False} if exact and getattr(eng, "tokens_per_step", 1) > 1 else {}
            self._decode_state, block = eng.generate_block(
                params, self._decode_state, steps, longest, **extra
            )
            tokens, valid, logprobs, experts = jax.device_get(
                (block.tokens, block.valid, block.log_prob, block.experts)
            )
            self.steps += steps
            per_step = getattr(
                eng, "tokens_per_step", 1
            )  # a speculative step emits 1 to per_step tokens a slot
            rows = np.asarray(valid[: steps * per_step]).reshape(steps, per_step, -1)
            slot_steps, emitted = int(rows[:, 0].sum()), int(rows.sum())
            self._all_slot_steps += slot_steps
            self._all_tokens += emitted
            with self._counts_lock:
                self._slot_steps += slot_steps
                self._decode_tokens += emitted
            for j in range(steps * per_step):
                if all(s is None for s in self._slots):
                    break
                for slot, live in enumerate(self._slots):
                    if live is None:
                        continue
                    if not valid[j, slot]:
                        if j % per_step:  # the step emitted fewer tokens
                            continue
                        raise TmaxError(
                            f"slot {slot} was not decoding although request {live.handle.id} holds it"
                        )
                    if experts is not None:  # step j fed the slot's previous token
                        live.handle.experts.append(experts[j, slot].astype(np.int16))
                    live.handle._emit(int(tokens[j, slot]), float(logprobs[j, slot]), version)
                    cached = len(live.prompt) + len(live.handle.tokens) - 1
                    reason, stop_string = self._finish_reason(live, cached)
                    if reason is None:
                        continue
                    # The device stops a slot itself on stop tokens, max_tokens and a full cache; a
                    # slot the host stops keeps decoding to the end of the block, and those tokens
                    # are dropped here with the slot.
                    device_done = reason == "length" or (reason == "stop" and stop_string is None)
                    self._release(slot, live, reason, stop_string, device_done)
