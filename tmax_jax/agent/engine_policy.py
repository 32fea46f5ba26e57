"""The policy side of an episode backed by our rollout engine's orchestrator.

Each episode is one orchestrator session: every turn submits the whole conversation so far, and
the orchestrator reuses the session's cached state so only the new tokens are prefilled.
"""

from __future__ import annotations

import itertools

from tmax_jax.agent.episode import Generation
from tmax_jax.engine.orchestrator import Orchestrator, Request
from tmax_jax.engine.sampling import SamplingParams

_session_ids = itertools.count()


class EnginePolicy:
    def __init__(
        self,
        orchestrator: Orchestrator,
        *,
        stop_token_ids: list[int],
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int = 0,
    ):
        self.orch = orchestrator
        self.stop_token_ids = list(stop_token_ids)
        self.session_id = f"episode-{next(_session_ids)}"
        self.context: list[int] = []
        self.turn = 0
        self._sampling = dict(temperature=temperature, top_p=top_p, top_k=top_k)
        self.seed = seed
        self.cached_tokens = 0

    def __call__(self, new_tokens: list[int], *, max_new_tokens: int) -> Generation:
        self.context.extend(new_tokens)
        # A fresh seed per turn: the same seed would replay the same random stream each turn.
        sampling = SamplingParams(**self._sampling, seed=(self.seed * 1_000_003 + self.turn) % (2**31))
        self.turn += 1
        req = Request(
            prompt=list(self.context),
            max_tokens=max_new_tokens,
            sampling=sampling,
            stop_token_ids=self.stop_token_ids,
            session_id=self.session_id,
        )
        out = self.orch.submit(req).result()
        self.cached_tokens += out.cached_tokens
        self.context.extend(out.tokens)
        return Generation(out.tokens, out.logprobs, out.versions, out.finish_reason)

    def close(self) -> None:
        self.orch.close_session(self.session_id)
