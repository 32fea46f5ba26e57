"""Model agents for evaluation: a checkpoint served by our engine, or any OpenAI-compatible endpoint.

Both play the episode protocol of ``tmax_jax.agent`` (the bash tool in Qwen 3.5's XML tool-call
format, or Terminus-2 JSON keystrokes), so an eval measures the policy under the harness it was
trained with.

* ``checkpoint_agent``: loads the HF checkpoint into our JAX model, one Engine + Orchestrator for the
  whole run (each attempt is an orchestrator session, so only new tokens are prefilled per turn), and
  runs ``tmax_jax.agent.episode.run_episode``; the saved trajectory has tokens, loss mask and logprobs.
* ``endpoint_agent``: talks to ``/chat/completions`` of an OpenAI-compatible server (``tmax-jax
  serve``, vLLM, a hosted API); the saved trajectory is the message list.
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

from tmax_jax.agent.episode import AgentConfig, run_episode
from tmax_jax.agent.protocol import BASH_TOOL, FormatError, format_tool_result, is_submit, parse_tool_calls
from tmax_jax.agent.terminus import parse_terminus_reply
from tmax_jax.errors import CheckpointError, ConfigError, TmaxError


class EngineEpisodeAgent:
    """The policy in-process: one orchestrator session per attempt, closed when the attempt ends."""

    def __init__(
        self, name: str, orchestrator: Any, chat: Any, cfg: AgentConfig, *, temperature: float, seed: int = 0
    ):
        self.name = name
        self.orchestrator = orchestrator
        self.chat = chat
        self.cfg = cfg
        self.temperature = temperature
        self.seed = seed
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
        self.orchestrator.stop()


def checkpoint_agent(
    path: str | Path,
    *,
    harness: str = "bash",
    temperature: float = 1.0,
    max_turns: int = 64,
    slots: int = 1,
    max_context_tokens: int = 4096,
    max_tokens_per_turn: int = 512,
    dtype: str = "float32",
) -> EngineEpisodeAgent:
    """An eval agent for an HF checkpoint directory (weights + tokenizer with a chat template)."""
    import jax.numpy as jnp

    from tmax_jax.agent.chat import ChatFormatter
    from tmax_jax.checkpoints import load_hf
    from tmax_jax.engine import Engine, Orchestrator
    from tmax_jax.tokenizer import load_tokenizer

    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"--checkpoint {path}: not a directory")
    if max_tokens_per_turn > max_context_tokens:
        raise ConfigError(
            f"max_tokens_per_turn ({max_tokens_per_turn}) exceeds max_context_tokens ({max_context_tokens})"
        )
    model = load_hf(path, dtype)
    tokenizer = load_tokenizer(path)
    chat = ChatFormatter(
        tokenizer,
        tools=[BASH_TOOL] if harness == "bash" else None,
        template_kwargs={"enable_thinking": False},
    )
    engine = Engine(
        model,
        max_concurrent_decodes=slots,
        max_cache_length=max_context_tokens,
        max_prefill_length=min(1024, max_context_tokens),
        cache_dtype=jnp.bfloat16 if dtype == "bfloat16" else jnp.float32,
        eos_token_ids=[chat.end_id],
        tokenizer=tokenizer,
    )
    cfg = AgentConfig(
        harness=harness,
        max_turns=max_turns,
        max_tokens_per_turn=max_tokens_per_turn,
        max_context_tokens=max_context_tokens,
    )
    return EngineEpisodeAgent(f"ckpt-{path.name}", Orchestrator(engine), chat, cfg, temperature=temperature)


@dataclasses.dataclass
class ChatTrajectory:
    task_id: str
    messages: list[dict]
    num_turns: int = 0
    num_format_errors: int = 0
    finish_reason: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0


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

    def __call__(self, task: Any, shell: Any) -> ChatTrajectory:
        cfg = self.cfg
        messages: list[dict] = [
            {"role": "system", "content": cfg.system_prompt},
            {"role": "user", "content": task.instruction},
        ]
        traj = ChatTrajectory(task_id=str(task.name), messages=messages)
        for turn in range(cfg.max_turns):
            body: dict[str, Any] = {
                "model": self.model,
                "messages": messages,
                "temperature": self.temperature,
                "max_tokens": cfg.max_tokens_per_turn,
            }
            if cfg.harness == "bash":
                body["tools"] = [BASH_TOOL]
            reply = self._post(body)
            usage = reply.get("usage") or {}
            traj.prompt_tokens += int(usage.get("prompt_tokens", 0) or 0)
            traj.completion_tokens += int(usage.get("completion_tokens", 0) or 0)
            try:
                message = reply["choices"][0]["message"]
            except (KeyError, IndexError, TypeError) as e:
                raise TmaxError(f"{self.url}: reply has no choices[0].message: {str(reply)[:300]}") from e
            traj.num_turns = turn + 1
            content = message.get("content") or ""
            assistant = {"role": "assistant", "content": content}
            if message.get("tool_calls"):
                assistant["tool_calls"] = message["tool_calls"]
            messages.append(assistant)
            observation, done, call_id = self._act(message, shell, traj)
            if done:
                traj.finish_reason = "submitted"
                return traj
            if traj.num_format_errors > cfg.max_format_errors:
                traj.finish_reason = "format_errors"
                return traj
            if call_id is not None:
                messages.append({"role": "tool", "tool_call_id": call_id, "content": observation})
            else:
                messages.append({"role": "user", "content": observation})
        traj.finish_reason = "max_turns"
        return traj

    def _act(self, message: dict, shell: Any, traj: ChatTrajectory) -> tuple[str, bool, str | None]:
        cfg = self.cfg
        content = message.get("content") or ""
        try:
            if cfg.harness == "terminus":
                parsed = parse_terminus_reply(content)
                outputs = []
                for c in parsed.commands:
                    res = shell.run(c.keystrokes, timeout=max(c.duration, 1.0))
                    outputs.append(_observe(res, cfg))
                return "\n".join(outputs) or "(no commands)", parsed.task_complete, None
            calls = message.get("tool_calls") or []
            call_id = None
            if calls:
                if len(calls) > 1:
                    raise FormatError(f"one tool call per reply, got {len(calls)}")
                fn = calls[0].get("function", {})
                call_id = calls[0].get("id")
                if fn.get("name") != "bash":
                    raise FormatError(f"unknown tool {fn.get('name')!r} (only 'bash')")
                try:
                    command = json.loads(fn.get("arguments") or "{}")["command"]
                except (ValueError, KeyError, TypeError) as e:
                    raise FormatError(f"bash tool arguments need a 'command' string: {e}") from e
            else:
                parsed_calls = parse_tool_calls(content)
                if len(parsed_calls) != 1:
                    raise FormatError(f"one tool call per reply, got {len(parsed_calls)}")
                command = parsed_calls[0].command
            res = shell.run(command, timeout=cfg.command_timeout_s)
        except FormatError as e:
            traj.num_format_errors += 1
            return f"Format error: {e}", False, None
        output = getattr(res, "output", None) or getattr(res, "stdout", "") or ""
        if is_submit(output):
            return output, True, call_id
        return _observe(res, cfg), False, call_id


def _observe(res: Any, cfg: AgentConfig) -> str:
    output = getattr(res, "output", None)
    if output is None:
        output = getattr(res, "stdout", "") or ""
    return format_tool_result(
        output,
        getattr(res, "exit_code", None),
        max_chars=cfg.max_output_chars,
        timed_out=bool(getattr(res, "timed_out", False)),
    )


def endpoint_agent(
    url: str,
    model: str,
    *,
    harness: str = "bash",
    temperature: float = 1.0,
    max_turns: int = 64,
    max_tokens_per_turn: int = 2048,
) -> EndpointAgent:
    cfg = AgentConfig(harness=harness, max_turns=max_turns, max_tokens_per_turn=max_tokens_per_turn)
    return EndpointAgent(url, model, cfg, temperature=temperature)
