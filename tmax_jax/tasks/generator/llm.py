"""The LLM generator: any OpenAI-compatible chat endpoint (``tmax-jax serve``, vLLM, a hosted API)
writes a TMAX task in four stages, each parsed and validated before the next:

1. template: JSON ``{"prompt": ..., "truth": ...}`` for the sampled signature;
2. initial-state test: a pytest file (compiles, defines test functions);
3. final-state verifier: a pytest file (compiles, defines test functions);
4. environment: ``setup.sh`` (passes ``bash -n``).

A malformed answer is retried with the error fed back; after ``retries`` the task is dropped with
the stage and error recorded. A task dir is only written (atomically) when every stage validated,
so a broken task is never left on disk; the executability filter then checks it in a sandbox.
"""

from __future__ import annotations

import json
import random
import re
import shutil
import subprocess
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from tmax_jax.tasks.axes import AxisSampler, Signature

SYSTEM = (
    "You write tasks for training terminal agents. Each task runs in a Linux sandbox with bash and "
    "python3; files the agent works on live under /home/user. Answer with exactly what is asked."
)
STAGES = ("template", "initial_test", "final_test", "setup")
_FENCE = re.compile(r"```(?:[a-zA-Z0-9_+-]*)\n(.*?)```", re.S)


class EndpointError(RuntimeError):
    """The endpoint did not answer with a chat completion (network, HTTP or protocol error)."""


@dataclass
class Drop:
    index: int
    stage: str
    reason: str


@dataclass
class Written:
    index: int
    path: Path
    signature: dict[str, str]


def _code_block(text: str) -> str:
    m = _FENCE.search(text)
    if not m:
        raise ValueError("no fenced code block (```...```) in the answer")
    return m.group(1)


def _validate_pytest(code: str, what: str) -> str:
    try:
        compile(code, what, "exec")
    except SyntaxError as e:
        raise ValueError(f"{what} does not compile: {e.msg} (line {e.lineno})") from None
    if not re.search(r"^def test_\w+\(", code, re.M):
        raise ValueError(f"{what} defines no pytest test function (def test_...)")
    return code


def _validate_bash(code: str) -> str:
    r = subprocess.run(["bash", "-n"], input=code, capture_output=True, text=True, timeout=30)
    if r.returncode != 0:
        raise ValueError(f"setup.sh has a bash syntax error: {r.stderr.strip()[:300]}")
    return code


def _validate_template(text: str) -> dict:
    m = re.search(r"\{.*\}", text, re.S)
    if not m:
        raise ValueError("no JSON object in the answer")
    try:
        data = json.loads(m.group(0))
    except ValueError as e:
        raise ValueError(f"not valid JSON: {e}") from None
    if (
        not isinstance(data, dict)
        or not isinstance(data.get("prompt"), str)
        or len(data["prompt"].split()) < 8
    ):
        raise ValueError("JSON needs a 'prompt' string of at least 8 words")
    if not isinstance(data.get("truth", ""), str):
        raise ValueError("'truth' must be a string")
    return data


class LLMGenerator:
    def __init__(
        self,
        url: str,
        model: str,
        sampler: AxisSampler | None = None,
        retries: int = 2,
        max_tokens: int = 1024,
        temperature: float = 0.7,
        timeout_s: float = 300.0,
    ):
        self.url = url.rstrip("/")
        self.model = model
        self.sampler = sampler or AxisSampler.from_yaml()
        self.retries = retries
        self.max_tokens = max_tokens
        self.temperature = temperature
        self.timeout_s = timeout_s

    def _chat(self, messages: list[dict]) -> str:
        body = {
            "model": self.model,
            "messages": messages,
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
        }
        req = urllib.request.Request(
            f"{self.url}/chat/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as r:
                data = json.loads(r.read())
            return data["choices"][0]["message"]["content"] or ""
        except (urllib.error.URLError, OSError, ValueError, KeyError, IndexError, TypeError) as e:
            raise EndpointError(f"{type(e).__name__}: {e}") from e

    def _stage(self, history: list[dict], ask: str, validate):
        history.append({"role": "user", "content": ask})
        last = ""
        for _ in range(self.retries + 1):
            answer = self._chat(history)
            history.append({"role": "assistant", "content": answer})
            try:
                return validate(answer)
            except ValueError as e:
                last = str(e)
                history.append(
                    {
                        "role": "user",
                        "content": f"That answer is invalid: {last}. Answer again, in the requested format.",
                    }
                )
        raise ValueError(last)

    def generate_one(self, out_root: Path, seed: int, index: int) -> Written | Drop:
        rng = random.Random(f"tmax-jax-llm:{seed}:{index}")
        sig: Signature = self.sampler.sample(rng)
        s = sig.to_dict()
        history = [{"role": "system", "content": SYSTEM}]
        asks = {
            "template": (
                f"Write a task with these properties: {json.dumps(s)}. Reply with one JSON object with keys "
                '"prompt" (the instruction shown to the agent) and "truth" (the expected answer, if any).',
                _validate_template,
            ),
            "initial_test": (
                "Write test_initial_state.py: pytest tests that pass before the agent starts (inputs exist, "
                "outputs do not). Reply with one ```python code block.",
                lambda a: _validate_pytest(_code_block(a), "test_initial_state.py"),
            ),
            "final_test": (
                "Write test_final_state.py: pytest tests that pass only when the task is solved. Reply with "
                "one ```python code block.",
                lambda a: _validate_pytest(_code_block(a), "test_final_state.py"),
            ),
            "setup": (
                "Write setup.sh, the bash script that creates the task's input files under /home/user. Reply "
                "with one ```bash code block.",
                lambda a: _validate_bash(_code_block(a)),
            ),
        }
        got = {}
        for stage in STAGES:
            ask, validate = asks[stage]
            try:
                got[stage] = self._stage(history, ask, validate)
            except ValueError as e:
                return Drop(index, stage, f"{stage}: {e}")
            except EndpointError as e:
                return Drop(index, stage, f"{stage}: endpoint error: {e}")
        name = f"{index:05d}-llm"
        final = Path(out_root) / name
        tmp = Path(out_root) / f".{name}.partial"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        meta = {
            "name": name,
            "prompt": got["template"]["prompt"],
            "truth": got["template"].get("truth", ""),
            "axes": s,
        }
        meta.update({"generator": "llm", "model": self.model, "seed": seed})
        (tmp / "task.json").write_text(json.dumps(meta, indent=2) + "\n")
        (tmp / "test_initial_state.py").write_text(got["initial_test"])
        (tmp / "test_final_state.py").write_text(got["final_test"])
        (tmp / "setup.sh").write_text(got["setup"])
        (tmp / "container.def").write_text(
            "Bootstrap: docker\nFrom: ubuntu:24.04\n\n%post\n    mkdir -p /home/user\n"
        )
        tmp.rename(final)
        return Written(index, final, s)
