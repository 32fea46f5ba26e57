"""Model agents for evaluation: a checkpoint served by our engine, or any OpenAI-compatible endpoint.

Both play an episode under one of the harnesses of ``tmax_jax.agent.harness`` (TMAX's bash tool,
mini-swe, OpenHands tools, Terminus-2 keystrokes), so a policy trained under one harness can be
measured under all of them.

* ``checkpoint_agents``: loads the HF checkpoint into our JAX model, one Engine + Orchestrator for the
  whole run shared by every harness (each attempt is an orchestrator session, so only new tokens are
  prefilled per turn), and runs ``tmax_jax.agent.episode.run_episode``; the saved trajectory has
  tokens, loss mask and logprobs.
* ``endpoint_agent``: talks to ``/chat/completions`` of an OpenAI-compatible server (``tmax-jax
  serve``, vLLM, a hosted API); the saved trajectory is the message list. The conversation is re-sent
  every turn, so near the context limit older observations are elided (``tmax_jax.agent.context``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from tmax_jax.agent.context import CONTEXT_EXHAUSTED, elide_old_outputs, estimate_tokens
from tmax_jax.agent.episode import AgentConfig, make_chat, run_episode
from tmax_jax.agent.harness import Step, get_harness
from tmax_jax.agent.protocol import ToolCall
from tmax_jax.errors import CheckpointError, ConfigError, TmaxError


class EngineEpisodeAgent:
    """The policy in-process: one orchestrator session per attempt, closed when the attempt ends."""

    def __init__(
        self,
        name: str,
        orchestrator: Any,
        chat: Any,
        cfg: AgentConfig,
        *,
        temperature: float,
        seed: int = 0,
        owns_orchestrator: bool = True,
    ):
        self.name = name
        self.orchestrator = orchestrator
        self.chat = chat
        self.cfg = cfg
        self.temperature = temperature
        self.seed = seed
        self.owns_orchestrator = owns_orchestrator
        self._attempts = 0
        self._lock = threading.Lock()

    def __call__(self, task: Any, shell: Any) -> Any:
        from tmax_jax.engine.sampling import SamplingParams
        from tmax_jax.engine.session import EnginePolicy

        with self._lock:
            self._attempts += 1
            seed = self.seed * 100_003 + self._attempts
        policy = EnginePolicy(
            self.orchestrator,
            sampling=SamplingParams(temperature=self.temperature, seed=seed),
            stop_token_ids=[self.chat.end_id],
        )
        try:
            return run_episode(task.instruction, policy, shell, self.chat, self.cfg, task_id=str(task.name))
        finally:
            policy.close()

    def close(self) -> None:
        if self.owns_orchestrator:
            self.orchestrator.stop()


def checkpoint_agents(
    path: str | Path,
    harnesses: list[str] | tuple[str, ...] = ("bash",),
    *,
    temperature: float = 1.0,
    max_turns: int = 64,
    slots: int = 1,
    max_context_tokens: int = 4096,
    max_tokens_per_turn: int = 512,
    dtype: str = "float32",
    speculative_tokens: int = 0,
) -> dict[str, EngineEpisodeAgent]:
    """One eval agent per harness for an HF checkpoint directory (weights + tokenizer with a chat
    template), all on one engine; closing the first harness's agent stops it.
    ``speculative_tokens``: drafted tokens per decode step with the checkpoint's MTP module (the
    sampled tokens do not change)."""
    import jax.numpy as jnp

    from tmax_jax.checkpoints import load_hf
    from tmax_jax.engine import Engine, Orchestrator
    from tmax_jax.engine.api import speculative_settings
    from tmax_jax.tokenizer import load_tokenizer

    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"--checkpoint {path}: not a directory")
    if max_tokens_per_turn > max_context_tokens:
        raise ConfigError(
            f"max_tokens_per_turn ({max_tokens_per_turn}) exceeds max_context_tokens ({max_context_tokens})"
        )
    if not harnesses:
        raise ConfigError("checkpoint_agents: no harness given")
    cfgs = {
        h: AgentConfig(
            harness=h,
            max_turns=max_turns,
            max_tokens_per_turn=max_tokens_per_turn,
            max_context_tokens=max_context_tokens,
        )
        for h in harnesses
    }
    model = load_hf(path, dtype)
    tokenizer = load_tokenizer(path)
    chats = {h: make_chat(tokenizer, c) for h, c in cfgs.items()}
    end_id = next(iter(chats.values())).end_id
    engine = Engine(
        model,
        max_concurrent_decodes=slots,
        max_cache_length=max_context_tokens,
        max_prefill_length=min(1024, max_context_tokens),
        cache_dtype=jnp.bfloat16 if dtype == "bfloat16" else jnp.float32,
        eos_token_ids=[end_id],
        tokenizer=tokenizer,
        **speculative_settings(path, speculative_tokens, setting="--speculative-tokens", dtype=dtype),
    )
    orch = Orchestrator(engine)
    return {
        h: EngineEpisodeAgent(
            f"ckpt-{path.name}", orch, chats[h], cfgs[h], temperature=temperature, owns_orchestrator=i == 0
        )
        for i, h in enumerate(harnesses)
    }


def checkpoint_agent(path: str | Path, *, harness: str = "bash", **kw: Any) -> EngineEpisodeAgent:
    """An eval agent for an HF checkpoint directory under one harness (see ``checkpoint_agents``)."""
    return checkpoint_agents(path, (harness,), **kw)[harness]


@dataclasses.dataclass
class ChatTrajectory:
    task_id: str
    messages: list[dict]
    num_turns: int = 0
    num_format_errors: int = 0
    finish_reason: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    harness: str = "bash"
    elided_outputs: int = 0


class EndpointAgent:
    """An episode against ``{url}/chat/completions``; tool calls read from ``tool_calls`` or the text."""

    def __init__(
        self,
        url: str,
        model: str,
        cfg: AgentConfig,
        *,
        temperature: float = 1.0,
        request_timeout_s: float = 600.0,
        retries: int = 3,
        api_key: str | None = None,
    ):
        if not url.startswith(("http://", "https://")):
            raise ConfigError(f"--llm-url must be an http(s) URL, got {url!r}")
        self.url = url.rstrip("/")
        self.model = model
        self.name = f"llm-{model}"
        self.cfg = cfg
        self.harness = get_harness(cfg.harness)
        self.temperature = temperature
        self.request_timeout_s = request_timeout_s
        self.retries = retries
        # Hosted endpoints read the usual variable; local servers ignore the header.
        self.api_key = api_key if api_key is not None else os.environ.get("OPENAI_API_KEY")

    def _post(self, body: dict) -> dict:
        data = json.dumps(body).encode()
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        last: Exception | None = None
        for attempt in range(self.retries + 1):
            req = urllib.request.Request(
                f"{self.url}/chat/completions", data=data, headers=headers, method="POST"
            )
            try:
                with urllib.request.urlopen(req, timeout=self.request_timeout_s) as resp:
                    return json.loads(resp.read())
            except urllib.error.HTTPError as e:
                detail = e.read().decode(errors="replace")[:500]
                if e.code < 500 and e.code != 429:
                    raise TmaxError(f"{self.url}/chat/completions: HTTP {e.code}: {detail}") from e
                last = TmaxError(f"{self.url}/chat/completions: HTTP {e.code}: {detail}")
            except (urllib.error.URLError, TimeoutError, ConnectionError) as e:
                last = TmaxError(f"{self.url}/chat/completions unreachable: {e}")
            time.sleep(min(2.0**attempt, 30.0))
        raise last  # type: ignore[misc]

    def _fits(self, messages: list[dict], traj: ChatTrajectory, scale: float) -> bool:
        """Elide old observations when the next prompt nears the context limit (tmax_jax.agent.context)."""
        cfg = self.cfg
        limit = int(cfg.elide_at * cfg.max_context_tokens / scale)
        if estimate_tokens(messages) <= limit:
            return True
        elide_old_outputs(messages, ("tool", "user"), keep_recent=cfg.keep_recent_outputs, limit_tokens=limit)
        traj.elided_outputs = sum(str(m.get("content") or "").startswith("[output elided") for m in messages)
        return estimate_tokens(messages) * scale + cfg.reply_reserve <= cfg.max_context_tokens

    def __call__(self, task: Any, shell: Any) -> ChatTrajectory:
        cfg = self.cfg
        messages: list[dict] = [
            {"role": "system", "content": cfg.prompt(self.harness)},
            {"role": "user", "content": task.instruction},
        ]
        traj = ChatTrajectory(task_id=str(task.name), messages=messages, harness=self.harness.name)
        session = self.harness.start(shell, cfg)
        scale = 1.0  # the server's token count per estimated token, from its usage reports
        try:
            for turn in range(cfg.max_turns):
                if not self._fits(messages, traj, scale):
                    traj.finish_reason = CONTEXT_EXHAUSTED
                    return traj
                body: dict[str, Any] = {
                    "model": self.model,
                    "messages": messages,
                    "temperature": self.temperature,
                    "max_tokens": cfg.max_tokens_per_turn,
                }
                if self.harness.tools:
                    body["tools"] = self.harness.tools
                estimate = estimate_tokens(messages)
                reply = self._post(body)
                usage = reply.get("usage") or {}
                prompt_tokens = int(usage.get("prompt_tokens", 0) or 0)
                traj.prompt_tokens += prompt_tokens
                traj.completion_tokens += int(usage.get("completion_tokens", 0) or 0)
                if prompt_tokens and estimate:
                    scale = max(scale, prompt_tokens / estimate)
                try:
                    message = reply["choices"][0]["message"]
                except (KeyError, IndexError, TypeError) as e:
                    raise TmaxError(f"{self.url}: reply has no choices[0].message: {str(reply)[:300]}") from e
                traj.num_turns = turn + 1
                assistant = {"role": "assistant", "content": message.get("content") or ""}
                if message.get("tool_calls"):
                    assistant["tool_calls"] = message["tool_calls"]
                messages.append(assistant)
                step, call_ids = self._act(message, session, traj)
                if step.done:
                    traj.finish_reason = "submitted"
                    return traj
                if traj.num_format_errors > cfg.max_format_errors:
                    traj.finish_reason = "format_errors"
                    return traj
                messages.extend(self._observation_messages(step.observation, call_ids))
            traj.finish_reason = "max_turns"
            return traj
        finally:
            session.close()

    def _observation_messages(self, observation: str, call_ids: list[str]) -> list[dict]:
        if not call_ids:
            # Calls read from the text: the API has no tool_call ids to answer, so a user turn (or
            # the harness's own role when it is not "tool").
            role = self.harness.observation_role if self.harness.observation_role != "tool" else "user"
            return [{"role": role, "content": observation}]
        # Every tool_call id needs its answer; the joined observation goes with the first.
        return [
            {"role": "tool", "tool_call_id": cid, "content": observation if i == 0 else "(output above)"}
            for i, cid in enumerate(call_ids)
        ]

    def _act(self, message: dict, session: Any, traj: ChatTrajectory) -> tuple[Step, list[str]]:
        """Run one reply under the harness; (its step, the tool_call ids it answers)."""
        content = message.get("content") or ""
        raw = message.get("tool_calls") or []
        calls: list[ToolCall] | None = None
        ids: list[str] = []
        problems: list[str] = []
        if raw and self.harness.tools:
            calls = []
            for c in raw:
                fn = c.get("function") or {}
                ids.append(str(c.get("id") or f"call_{len(ids)}"))
                try:
                    args = json.loads(fn.get("arguments") or "{}")
                    if not isinstance(args, dict):
                        raise ValueError("not an object")
                except ValueError as e:
                    problems.append(f"the arguments of {fn.get('name')!r} are not a JSON object: {e}")
                    continue
                calls.append(ToolCall(str(fn.get("name")), args))
        step = session.act(content, tool_calls=calls)
        if problems:
            step = Step(f"{step.observation}\nFormat error: {'; '.join(problems)}", step.done, 1)
        traj.num_format_errors += step.format_errors
        return step, ids


def endpoint_agent(
    url: str,
    model: str,
    *,
    harness: str = "bash",
    temperature: float = 1.0,
    max_turns: int = 64,
    max_tokens_per_turn: int = 2048,
    max_context_tokens: int = 32768,
) -> EndpointAgent:
    cfg = AgentConfig(
        harness=harness,
        max_turns=max_turns,
        max_tokens_per_turn=min(max_tokens_per_turn, max_context_tokens),
        max_context_tokens=max_context_tokens,
    )
    return EndpointAgent(url, model, cfg, temperature=temperature)
