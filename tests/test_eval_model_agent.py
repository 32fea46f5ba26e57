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


def test_checkpoint_agent_speculative_episodes_are_the_plain_ones(one_task, tiny_ckpt, tmp_path):
    """``--speculative-tokens`` in an eval: the checkpoint's MTP module drafts, and every attempt's
    tokens and logprobs are those of the plain engine (attempts run one at a time, so each gets the
    same seed in both runs). A checkpoint without MTP tensors is refused by name."""
    from helpers_hf import add_mtp_to_checkpoint

    from tmax_jax.errors import ConfigError

    with pytest.raises(ConfigError, match="--speculative-tokens=2 .* holds no mtp"):
        checkpoint_agent(tiny_ckpt, speculative_tokens=2)
    ckpt = tmp_path / "with-mtp"
    shutil.copytree(tiny_ckpt, ckpt)
    add_mtp_to_checkpoint(ckpt, seed=2)
    trajs = []
    for k in (0, 2):
        agent = checkpoint_agent(
            ckpt, max_turns=2, slots=2, max_context_tokens=1024, max_tokens_per_turn=12, speculative_tokens=k
        )
        assert agent.orchestrator.engine.tokens_per_step == k + 1
        try:
            s = evaluate(
                one_task, agent, tmp_path / f"k{k}", EvalConfig(k=2, concurrency=1), log=lambda m: None
            )
        finally:
            agent.close()
        assert s["overall"]["attempts"] == 2 and s["overall"]["errors"] == 0
        attempts = tmp_path / f"k{k}" / "tasks" / "hello-file"
        trajs.append(
            [json.loads((attempts / f"attempt-{i}" / "trajectory.json").read_text()) for i in (0, 1)]
        )
    for plain, spec in zip(*trajs):
        assert spec["tokens"] == plain["tokens"] and spec["response_mask"] == plain["response_mask"]
        assert spec["rollout_logprobs"] == pytest.approx(plain["rollout_logprobs"], abs=2e-5)


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
        session = agent.harness.start(sb.shell(), agent.cfg)
        step, ids = agent._act(msg, session, traj)
        assert "hi" in step.observation and "exit_code=0" in step.observation and not step.done
        assert ids == (["c1"] if style == "tool_calls" else [])
        reply = agent._observation_messages(step.observation, ids)
        assert [m["role"] for m in reply] == (["tool"] if ids else ["user"])
        step, _ = agent._act({"content": render_tool_call(f"echo {SUBMIT_MARKER}")}, session, traj)
        assert step.done
        bad, _ = agent._act({"content": "no tool call here"}, session, traj)
        assert bad.observation.startswith("Format error") and traj.num_format_errors == 1 and not bad.done
        # Arguments that are not JSON are a counted format error, not a crash.
        junk = {"content": "", "tool_calls": [{"id": "c2", "function": {"name": "bash", "arguments": "{ls"}}]}
        step, ids = agent._act(junk, session, traj)
        assert "not a JSON object" in step.observation and traj.num_format_errors == 2 and ids == ["c2"]


def test_endpoint_agent_openhands_editor_through_tool_calls():
    agent = EndpointAgent("http://127.0.0.1:9", "m", AgentConfig(harness="openhands"))
    assert [t["function"]["name"] for t in agent.harness.tools] == [
        "execute_bash",
        "str_replace_editor",
        "finish",
    ]
    calls = [
        {"id": "a", "function": {"name": "str_replace_editor", "arguments": json.dumps(
            {"command": "create", "path": "/app/n.txt", "file_text": "one\ntwo\n"})}},
        {"id": "b", "function": {"name": "str_replace_editor", "arguments": json.dumps(
            {"command": "insert", "path": "/app/n.txt", "insert_line": 1, "new_str": "1.5"})}},
        {"id": "c", "function": {"name": "execute_bash", "arguments": json.dumps({"command": "cat -A n.txt"})}},
    ]  # fmt: skip
    traj = ChatTrajectory("t", [], harness="openhands")
    with make_sandbox(SandboxConfig()) as sb:
        session = agent.harness.start(sb.shell(), agent.cfg)
        step, ids = agent._act({"content": None, "tool_calls": calls}, session, traj)
        assert sb.read_file("/app/n.txt") == b"one\n1.5\ntwo\n"
    assert "one$\n1.5$\ntwo$" in step.observation and "[exit code 0, cwd /app]" in step.observation
    assert ids == ["a", "b", "c"] and traj.num_format_errors == 0
    msgs = agent._observation_messages(step.observation, ids)
    assert [m["tool_call_id"] for m in msgs] == ids and msgs[0]["content"] == step.observation


def test_endpoint_agent_elides_old_outputs_near_the_context_limit():
    cfg = AgentConfig(max_context_tokens=1000, max_tokens_per_turn=100, keep_recent_outputs=2, elide_at=0.75)
    agent = EndpointAgent("http://127.0.0.1:9", "m", cfg)
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "the task " * 10}]
    for i in range(5):
        messages += [{"role": "assistant", "content": f"call {i}"}, {"role": "user", "content": f"{i}" * 800}]
    traj = ChatTrajectory("t", messages)
    assert agent._fits(messages, traj, scale=1.0)
    # The oldest outputs went first; the task, the replies and the two newest outputs are intact.
    contents = [m["content"] for m in messages]
    assert contents[1] == "the task " * 10 and contents[2::2] == [f"call {i}" for i in range(5)]
    assert contents[3] == "[output elided to save context: 800 characters]" and traj.elided_outputs >= 1
    assert contents[-1] == "4" * 800 and contents[-3] == "3" * 800
    # When eliding cannot make room (the newest outputs alone are too long), the episode is out of room.
    messages[-1]["content"] = "x" * 5000
    assert not agent._fits(messages, traj, scale=1.0)


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
                {"keystrokes": "cd /app && echo Hello > hello.txt\n", "duration": 1},
                {"keystrokes": "cat hello.txt\n"},
            ],
            "task_complete": True,
        }
    )
    traj = ChatTrajectory("t", [], harness="terminus")
    with make_sandbox(SandboxConfig()) as sb:
        session = agent.harness.start(sb.shell(), agent.cfg)
        step, ids = agent._act({"content": "Sure.\n" + reply}, session, traj)
        assert sb.exec("cat /app/hello.txt").stdout == "Hello\n"
        # The second command ran in the first one's cwd (one terminal); completion is confirmed first.
        assert "\nHello\n" in step.observation and not step.done and ids == []
        assert agent._observation_messages(step.observation, ids)[0]["role"] == "user"
        done, _ = agent._act({"content": json.dumps({"commands": [], "task_complete": True})}, session, traj)
        assert done.done and traj.num_format_errors == 0


def test_cli_eval_one_checkpoint_under_every_harness(small_task_set, tiny_ckpt, tmp_path, capsys):
    out = tmp_path / "all"
    argv = ["eval", "--checkpoint", str(tiny_ckpt), "--tasks", str(small_task_set), "--out", str(out)]
    argv += ["--harness", "all", "--max-turns", "1", "--max-tokens-per-turn", "8", "--max-context", "2048"]
    assert cli_main(argv) == 0
    printed = capsys.readouterr().out
    assert f"report: {out / 'report.html'}" in printed and "[openhands] 2 tasks evaluated" in printed
    combined = json.loads((out / "summary.json").read_text())
    assert combined["harnesses"] == ["bash", "mini-swe", "openhands", "terminus"]
    assert combined["categories"] == ["files", "text"] and combined["agent"] == f"ckpt-{tiny_ckpt.name}"
    for h in combined["harnesses"]:
        run = json.loads((out / h / "summary.json").read_text())
        assert run["harness"] == h and run["checkpoint"] == str(tiny_ckpt.resolve())
        # The combined table holds exactly each run's own numbers.
        assert combined["by_harness"][h]["overall"] == run["overall"]
        assert combined["by_harness"][h]["categories"]["text"] == run["categories"]["text"]
        assert run["overall"]["attempts"] == 2 and run["overall"]["errors"] == 0
        traj = json.loads((out / h / "tasks" / "shout" / "attempt-0" / "trajectory.json").read_text())
        assert traj["info"]["harness"] == h and traj["num_turns"] == 1 and sum(traj["response_mask"])
        system = traj["messages"][0]["content"]
        assert system == AgentConfig(harness=h).prompt()
    page = (out / "report.html").read_text()
    assert "pass@1: harness x category" in page and all(
        f'href="{h}/report.html"' in page for h in combined["harnesses"]
    )
    assert "<th>files</th><th>text</th>" in page
    assert cli_main(["eval", "--tasks", str(small_task_set), "--agent", "oracle", "--harness", "all"]) == 2
    assert "--harness all needs a model agent" in capsys.readouterr().err
