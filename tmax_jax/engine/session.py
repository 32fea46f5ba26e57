"""An episode's policy over the orchestrator (``tmax_jax.agent.episode.TurnGenerator``).

Each call appends the new context tokens to the conversation and submits the whole of it under one
session id, so the engine prefills only what the previous turn's cache does not hold.
"""

from __future__ import annotations

import itertools
import uuid
from collections.abc import Sequence

from tmax_jax.agent.episode import Generation
from tmax_jax.engine.orchestrator import Orchestrator, Request
from tmax_jax.engine.sampling import SamplingParams, derive_seed


class EnginePolicy:
    """``policy(new_tokens, max_new_tokens=N) -> Generation`` for one episode; ``close()`` frees its cache."""

    def __init__(
        self,
        orchestrator: Orchestrator,
        *,
        sampling: SamplingParams = SamplingParams(),
        stop_token_ids: Sequence[int] | None = None,
        session_id: str | None = None,
    ):
        self.orchestrator = orchestrator
        self.sampling = sampling
        self.stop_token_ids = stop_token_ids
        self.session_id = session_id or f"episode-{uuid.uuid4().hex}"
        self.context: list[int] = []
        self.cached_tokens: list[int] = []  # per turn: prompt tokens the engine did not prefill again
        self._turns = itertools.count()

    def __call__(self, new_tokens: Sequence[int], *, max_new_tokens: int) -> Generation:
        self.context.extend(int(t) for t in new_tokens)
        # A distinct key stream per turn: the same seed must not replay turn 1's draws in turn 2.
        sp = SamplingParams(
            temperature=self.sampling.temperature,
            top_k=self.sampling.top_k,
            top_p=self.sampling.top_p,
            seed=derive_seed(self.sampling.seed, next(self._turns)),
        )
        req = Request(
            prompt=list(self.context),
            max_tokens=max_new_tokens,
            sampling=sp,
            stop_token_ids=self.stop_token_ids,
            session_id=self.session_id,
        )
        out = self.orchestrator.submit(req).result()
        self.cached_tokens.append(out.cached_tokens)
        self.context.extend(out.tokens)
        reason = "stop" if out.finish_reason == "stop" else "length"
        return Generation(
            tokens=out.tokens,
            logprobs=out.logprobs,
            versions=out.versions,
            finish_reason=reason,
            experts=out.experts,
        )

    def close(self) -> None:
        self.orchestrator.close_session(self.session_id)

    def __enter__(self) -> EnginePolicy:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
