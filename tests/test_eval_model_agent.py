"""Model agents in an eval: a tiny random checkpoint through our engine, and through `tmax-jax serve`'s
OpenAI-compatible endpoint; tool-call handling against a real sandbox shell."""

import json
import shutil
from pathlib import Path

import pytest
from harbor_helpers import write_harbor_task
from helpers_hf import make_tiny_hf_checkpoint

from tmax_jax.agent.episode import AgentConfig
from tmax_jax.agent.protocol import SUBMIT_MARKER, render_tool_call
from tmax_jax.cli import main as cli_main
from tmax_jax.eval.model_agent import ChatTrajectory, EndpointAgent, checkpoint_agent, endpoint_agent
from tmax_jax.eval.runner import EvalConfig, evaluate
from tmax_jax.sandbox import SandboxConfig, make_sandbox

TASK_TOML = """\
version = "1.0"
[metadata]
category = "files"
[verifier]
timeout_sec = 30.0
[agent]
timeout_sec = 60.0
"""


@pytest.fixture(scope="module")
def one_task(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("model_tasks")
    d = root / "hello-file"
    for sub in ("environment", "tests", "solution"):
        (d / sub).mkdir(parents=True)
    (d / "instruction.md").write_text("Create /app/hello.txt containing: Hello")
    (d / "task.toml").write_text(TASK_TOML)
    (d / "environment" / "Dockerfile").write_text("FROM ubuntu:24.04\nWORKDIR /app\n")
    (d / "tests" / "test.sh").write_text(
        "mkdir -p /logs/verifier\n"
        '[ "$(cat /app/hello.txt 2>/dev/null)" = Hello ] && r=1 || r=0\necho $r > /logs/verifier/reward.txt\n'
    )
    (d / "solution" / "solve.sh").write_text("echo Hello > /app/hello.txt\n")
    return root


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory) -> Path:
    return make_tiny_hf_checkpoint(tmp_path_factory.mktemp("ckpt"), tokenizer=True, vocab_size=512)


def test_checkpoint_agent_runs_token_episodes(one_task, tiny_ckpt, tmp_path):
    agent = checkpoint_agent(tiny_ckpt, max_turns=2, slots=2, max_context_tokens=1024, max_tokens_per_turn=8)
    try:
        s = evaluate(one_task, agent, tmp_path / "ckpt", EvalConfig(k=2, concurrency=2), log=lambda m: None)
    finally:
        agent.close()
    # A random model does not solve the task, but every attempt is a complete, scored episode.
    o = s["overall"]
    assert o["attempts"] == 2 and o["errors"] == 0 and o["pass_at"]["1"] == 0.0
    traj = json.loads(
        (tmp_path / "ckpt" / "tasks" / "hello-file" / "attempt-0" / "trajectory.json").read_text()
    )
    assert traj["task_id"] == "hello-file" and 1 <= traj["num_turns"] <= 2
    assert len(traj["tokens"]) == len(traj["response_mask"]) == len(traj["rollout_logprobs"])
    generated = [lp for lp, m in zip(traj["rollout_logprobs"], traj["response_mask"]) if m]
    assert generated and all(lp <= 0.0 for lp in generated)


@pytest.fixture(scope="module")
def small_task_set(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("cli_tasks")
    write_harbor_task(
        root,
        "hello-file",
        "files",
        "Create /app/hello.txt containing: Hello",
        "FROM ubuntu:24.04\nWORKDIR /app\n",
        '[ "$(cat /app/hello.txt 2>/dev/null)" = Hello ]',
        {"solve.sh": "echo Hello > /app/hello.txt\n"},
    )
    write_harbor_task(
        root,
        "shout",
        "text",
        "Write /app/in.txt upper-cased to /app/out.txt.",
        "FROM ubuntu:24.04\nWORKDIR /app\nRUN echo 'quiet words' > /app/in.txt\n",
        '[ "$(cat /app/out.txt 2>/dev/null)" = "QUIET WORDS" ]',
        {"solve.sh": "tr a-z A-Z < /app/in.txt > /app/out.txt\n"},
    )
    write_harbor_task(
        root,
        "needs-network",
        "files",
        "Use jq to pretty-print /app/data.json into /app/pretty.json.",
        "FROM ubuntu:24.04\nRUN apt-get update && apt-get install -y jq\n",
        "[ -s /app/pretty.json ]",
        {"solve.sh": "jq . /app/data.json > /app/pretty.json\n"},
    )
    return root


def test_cli_eval_checkpoint_writes_reports_and_resumes(small_task_set, tiny_ckpt, tmp_path, capsys):
    out = tmp_path / "ckpt"
    argv = ["eval", "--checkpoint", str(tiny_ckpt), "--tasks", str(small_task_set), "--out", str(out)]
    argv += ["-k", "2", "--concurrency", "2", "--max-turns", "2", "--max-tokens-per-turn", "8"]
    argv += ["--max-context", "1024"]
    assert cli_main(argv) == 0
    printed = capsys.readouterr().out
    assert f"report: {out / 'report.html'}  summary: {out / 'summary.json'}" in printed

    s = json.loads((out / "summary.json").read_text())
    assert s["agent"] == f"ckpt-{tiny_ckpt.name}" and s["checkpoint"] == str(tiny_ckpt.resolve())
    assert s["attempts_run"] == 4 and s["attempts_skipped"] == 0
    rows = {r["task_id"]: r for r in s["tasks"]}
    assert sorted(rows) == ["hello-file", "needs-network", "shout"]
    assert rows["needs-network"]["status"] == "env_unavailable"
    for task in ("hello-file", "shout"):
        # Every attempt is a complete, scored episode of the model.
        assert (rows[task]["status"], rows[task]["attempts"], rows[task]["errors"]) == ("evaluated", 2, 0)
        for a in range(2):
            traj = json.loads((out / "tasks" / task / f"attempt-{a}" / "trajectory.json").read_text())
            assert traj["task_id"] == task and 1 <= traj["num_turns"] <= 2 and sum(traj["response_mask"])
    page = (out / "report.html").read_text()
    assert all(t in page for t in rows)

    # The same command again runs nothing; one more attempt each (-k 3) runs just those.
    results = (out / "results.jsonl").read_text()
    assert cli_main(argv) == 0
    again = json.loads((out / "summary.json").read_text())
    assert again["attempts_run"] == 0 and again["attempts_skipped"] == 4
    assert (out / "results.jsonl").read_text() == results and again["overall"] == s["overall"]
    assert cli_main([*argv, "-k", "3"]) == 0
    more = json.loads((out / "summary.json").read_text())
    assert more["attempts_run"] == 2 and more["overall"]["attempts"] == 6
    assert (out / "results.jsonl").read_text().startswith(results)
    # Results of another checkpoint, or sampled otherwise, are not mixed in.
    other = tmp_path / "other"
    shutil.copytree(tiny_ckpt, other)
    capsys.readouterr()
    assert cli_main([*argv, "--checkpoint", str(other)]) == 2
    assert f"checkpoint: saved '{tiny_ckpt.resolve()}', now '{other.resolve()}'" in capsys.readouterr().err
    assert cli_main([*argv, "--temperature", "0.5"]) == 2
    assert "temperature: saved 1.0, now 0.5" in capsys.readouterr().err


def test_endpoint_agent_against_tmax_jax_serve(one_task, tiny_ckpt, tmp_path):
    from tmax_jax.checkpoints import load_hf
    from tmax_jax.engine import Engine, Orchestrator
    from tmax_jax.engine.server import OpenAIServer
    from tmax_jax.tokenizer import load_tokenizer

    tok = load_tokenizer(tiny_ckpt)
    engine = Engine(load_hf(tiny_ckpt), max_concurrent_decodes=2, max_cache_length=1024, tokenizer=tok)
    with Orchestrator(engine) as orch:
        server = OpenAIServer(orch, tok, model_name="tiny", port=0)
        server.start()
        try:
            agent = endpoint_agent(f"{server.url}/v1", "tiny", max_turns=2, max_tokens_per_turn=8)
            s = evaluate(one_task, agent, tmp_path / "llm", EvalConfig(k=1), log=lambda m: None)
        finally:
            server.shutdown()
    assert s["overall"]["attempts"] == 1 and s["overall"]["errors"] == 0 and s["agent"] == "llm-tiny"
    traj = json.loads(
        (tmp_path / "llm" / "tasks" / "hello-file" / "attempt-0" / "trajectory.json").read_text()
    )
    roles = [m["role"] for m in traj["messages"]]
    assert roles[:3] == ["system", "user", "assistant"] and traj["num_turns"] >= 1


class _Res:
    def __init__(self, output):
        self.output, self.exit_code, self.timed_out = output, 0, False


@pytest.mark.parametrize("style", ["tool_calls", "xml"])
def test_endpoint_agent_executes_tool_calls_in_a_real_shell(style):
    agent = EndpointAgent("http://127.0.0.1:9", "m", AgentConfig())
    cmd = "echo hi > /app/x.txt && cat /app/x.txt"
    if style == "tool_calls":
        msg = {
            "content": "",
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "bash", "arguments": json.dumps({"command": cmd})},
                }
            ],
        }
    else:
        msg = {"content": "Let me do it.\n" + render_tool_call(cmd)}
    traj = ChatTrajectory("t", [])
    with make_sandbox(SandboxConfig()) as sb:
        sh = sb.shell()
        obs, done, call_id = agent._act(msg, sh, traj)
        assert "hi" in obs and "exit_code=0" in obs and not done
        assert call_id == ("c1" if style == "tool_calls" else None)
        obs, done, _ = agent._act({"content": render_tool_call(f"echo {SUBMIT_MARKER}")}, sh, traj)
        assert done
    bad, done, _ = agent._act({"content": "no tool call here"}, None, traj)
    assert bad.startswith("Format error") and traj.num_format_errors == 1 and not done


def test_cli_eval_oracle_and_bad_options(one_task, tmp_path, capsys):
    assert (
        cli_main(["eval", "--tasks", str(one_task), "--agent", "oracle", "--out", str(tmp_path / "o")]) == 0
    )
    assert "pass@1 1.000" in capsys.readouterr().out
    assert json.loads((tmp_path / "o" / "summary.json").read_text())["overall"]["pass_at"]["1"] == 1.0
    assert cli_main(["eval", "--tasks", str(one_task), "--llm-url", "http://x/v1"]) == 2
    assert "--model" in capsys.readouterr().err
    assert cli_main(["eval", "--tasks", str(one_task)]) == 2
    assert "choose what to evaluate" in capsys.readouterr().err


def test_endpoint_agent_terminus_keystrokes_in_a_real_shell():
    agent = EndpointAgent("http://127.0.0.1:9", "m", AgentConfig(harness="terminus"))
    reply = json.dumps(
        {
            "analysis": "need the file",
            "plan": "write it, then show it",
            "commands": [
                {"keystrokes": "cd /app && echo Hello > hello.txt", "duration": 1},
                {"keystrokes": "cat hello.txt"},
            ],
            "task_complete": True,
        }
    )
    traj = ChatTrajectory("t", [])
    with make_sandbox(SandboxConfig()) as sb:
        obs, done, call_id = agent._act({"content": "Sure.\n" + reply}, sb.shell(), traj)
        assert sb.exec("cat /app/hello.txt").stdout == "Hello\n"
    # The second command ran in the first one's cwd (one persistent shell), and the episode ends.
    assert "Hello" in obs and done and call_id is None and traj.num_format_errors == 0
