"""End-to-end evaluation over a small Harbor task set in real bubblewrap sandboxes."""

import json
from pathlib import Path

import pytest
from harbor_helpers import write_harbor_task

from tmax_jax.errors import ConfigError, TaskFormatError
from tmax_jax.eval.agents import NoopAgent, OracleAgent
from tmax_jax.eval.runner import EvalConfig, evaluate
from tmax_jax.eval.tasks import find_eval_tasks


@pytest.fixture(scope="module")
def task_set(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("harbor_tasks")
    write_harbor_task(
        root,
        "hello-file",
        "files",
        "Create /app/hello.txt containing exactly the line: Hello, world!",
        "FROM ubuntu:24.04\nWORKDIR /app\n",
        '[ "$(cat /app/hello.txt 2>/dev/null)" = "Hello, world!" ]',
        {"solve.sh": "echo 'Hello, world!' > /app/hello.txt\n"},
    )
    d = write_harbor_task(
        root,
        "count-lines",
        "text",
        "Write the number of lines of /app/words.txt to /app/count.txt.",
        "FROM ubuntu:24.04\nWORKDIR /app\nCOPY words.txt /app/words.txt\n",
        '[ "$(tr -d " \\n" < /app/count.txt 2>/dev/null)" = "5" ]',
        {"solve.sh": "wc -l < /app/words.txt > /app/count.txt\n"},
    )
    (d / "environment" / "words.txt").write_text("alpha\nbeta\ngamma\ndelta\nepsilon\n")
    # The oracle must ship the whole solution/ dir: solve.sh calls a helper next to it.
    write_harbor_task(
        root,
        "shout",
        "text",
        "Write /app/in.txt upper-cased to /app/out.txt.",
        "FROM ubuntu:24.04\nWORKDIR /app\nRUN echo 'quiet words' > /app/in.txt\n",
        '[ "$(cat /app/out.txt 2>/dev/null)" = "QUIET WORDS" ]',
        {
            "solve.sh": 'bash "$(dirname "$0")/upper.sh"\n',
            "upper.sh": "tr a-z A-Z < /app/in.txt > /app/out.txt\n",
        },
    )
    write_harbor_task(
        root,
        "needs-network",
        "files",
        "Use jq to pretty-print /app/data.json into /app/pretty.json.",
        "FROM ubuntu:24.04\nRUN apt-get update && \\\n    apt-get install -y jq\nWORKDIR /app\n",
        "[ -s /app/pretty.json ]",
        {"solve.sh": "jq . /app/data.json > /app/pretty.json\n"},
    )
    return root


def _quiet(_msg):
    pass


def test_task_set_discovery(task_set):
    tasks = {t.task_id: t for t in find_eval_tasks(task_set)}
    assert sorted(tasks) == ["count-lines", "hello-file", "needs-network", "shout"]
    assert tasks["shout"].category == "text" and tasks["hello-file"].category == "files"
    assert not tasks["needs-network"].environment.available
    assert "line 2 (apt-get)" in tasks["needs-network"].environment.reason
    assert all(t.environment.available for name, t in tasks.items() if name != "needs-network")
    assert find_eval_tasks(task_set, network=True)[2].environment.available


def test_oracle_scores_one_and_writes_reports(task_set, tmp_path):
    out = tmp_path / "oracle"
    s = evaluate(task_set, OracleAgent(), out, EvalConfig(k=1, concurrency=2), log=_quiet)
    o = s["overall"]
    assert o["pass_at"]["1"] == 1.0 and o["mean_reward"] == 1.0
    assert (o["evaluated"], o["env_unavailable"], o["errors"]) == (3, 1, 0)
    assert s["categories"]["text"]["pass_at"]["1"] == 1.0 and s["categories"]["text"]["evaluated"] == 2
    assert s["categories"]["files"]["evaluated"] == 1 and s["categories"]["files"]["env_unavailable"] == 1
    assert [e["task_id"] for e in s["env_unavailable"]] == ["needs-network"]

    saved = json.loads((out / "summary.json").read_text())
    assert saved["overall"] == o
    # Sandboxes came from the pool, never more alive than the concurrency.
    assert 1 <= saved["sandbox_pool"]["in_flight_max"] <= 2 and not saved["sandbox_pool"]["failures"]
    page = (out / "report.html").read_text()
    assert "<svg" in page and "needs-network" in page and "environment unavailable" in page
    adir = out / "tasks" / "shout" / "attempt-0"
    commands = [json.loads(line) for line in (adir / "commands.jsonl").read_text().splitlines()]
    assert commands[0]["command"] == "bash /solution/solve.sh" and commands[0]["exit_code"] == 0
    assert json.loads((adir / "trajectory.json").read_text())["agent"] == "oracle"
    assert (adir / "verifier.log").is_file()


def test_noop_scores_zero(task_set, tmp_path):
    out = tmp_path / "noop"
    s = evaluate(task_set, NoopAgent(), out, EvalConfig(k=2, concurrency=2), log=_quiet)
    o = s["overall"]
    assert o["pass_at"]["1"] == 0.0 and o["pass_at"]["2"] == 0.0
    assert o["evaluated"] == 3 and o["attempts"] == 6 and o["zero_pass"] == 3 and o["errors"] == 0
    records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    scored = [r for r in records if r["status"] != "env_unavailable"]
    assert len(scored) == 6 and {(r["status"], r["reason"]) for r in scored} == {
        ("failed", "verifier failed")
    }
    rows = {r["task_id"]: r for r in s["tasks"]}
    assert rows["needs-network"]["status"] == "env_unavailable" and rows["needs-network"]["attempts"] == 0


def test_resume_skips_finished_attempts(task_set, tmp_path):
    out = tmp_path / "resume"
    first = evaluate(task_set, OracleAgent(), out, EvalConfig(k=1), log=_quiet)
    assert first["attempts_run"] == 3
    # 3 attempts and the environment-unavailable record of needs-network.
    results = out / "results.jsonl"
    finished_at = {
        (r["task_id"], r["attempt"]): r["finished_at"]
        for r in map(json.loads, results.read_text().splitlines())
    }

    # Same command again: nothing to do. Raising k runs only the new attempts.
    again = evaluate(task_set, OracleAgent(), out, EvalConfig(k=1), log=_quiet)
    assert again["attempts_run"] == 0 and again["attempts_skipped"] == 3
    more = evaluate(task_set, OracleAgent(), out, EvalConfig(k=2), log=_quiet)
    assert more["attempts_run"] == 3 and more["attempts_skipped"] == 3
    assert more["overall"]["pass_at"]["2"] == 1.0 and more["overall"]["attempts"] == 6

    # A run killed mid-attempt left no record for it (and maybe a torn line): only that one re-runs.
    lines = results.read_text().splitlines()
    dropped = json.loads(lines[-1])
    results.write_text("\n".join(lines[:-1]) + '\n{"task_id": "sh')
    resumed = evaluate(task_set, OracleAgent(), out, EvalConfig(k=2), log=_quiet)
    assert resumed["attempts_run"] == 1
    latest = {(r["task_id"], r["attempt"]): r for r in map(json.loads, results.read_text().splitlines()[-1:])}
    assert list(latest) == [(dropped["task_id"], dropped["attempt"])]
    kept = {
        (r["task_id"], r["attempt"]): r["finished_at"]
        for r in map(json.loads, results.read_text().splitlines()[: len(finished_at)])
    }
    assert kept == finished_at  # the first run's attempts were never redone


def test_results_of_another_agent_are_not_mixed(task_set, tmp_path):
    out = tmp_path / "mixed"
    evaluate(task_set, NoopAgent(), out, EvalConfig(k=1), log=_quiet)
    with pytest.raises(ConfigError, match="agent: saved 'noop', now 'oracle'"):
        evaluate(task_set, OracleAgent(), out, EvalConfig(k=1), log=_quiet)


def test_crashing_agent_is_an_error_not_a_failure(task_set, tmp_path):
    class Crashing:
        name = "crashing"

        def __call__(self, task, shell):
            shell.run("echo about to crash")
            raise RuntimeError("model server went away")

    out = tmp_path / "crash"
    s = evaluate(task_set, Crashing(), out, EvalConfig(k=1), log=_quiet)
    assert s["overall"]["errors"] == 3 and s["overall"]["pass_at"]["1"] == 0.0
    records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    crashed = [r for r in records if r["status"] == "error"]
    assert len(crashed) == 3 and all("model server went away" in r["reason"] for r in crashed)
    adir = out / "tasks" / "hello-file" / "attempt-0"
    assert "about to crash" in (adir / "commands.jsonl").read_text()
    assert "RuntimeError" in (adir / "error.txt").read_text()
    # Crashed attempts count as done unless asked to retry them.
    assert evaluate(task_set, Crashing(), out, EvalConfig(k=1), log=_quiet)["attempts_run"] == 0
    assert (
        evaluate(task_set, Crashing(), out, EvalConfig(k=1, retry_errors=True), log=_quiet)["attempts_run"]
        == 3
    )


def test_task_allowing_internet_runs_offline_unless_a_script_downloads(tmp_path):
    """``allow_internet = true`` is a permission: offline the task runs (its result notes it); a
    download its verifier needs still makes it unavailable."""
    write_harbor_task(
        tmp_path, "allowed", "net", "Make /app/x.", "FROM ubuntu:24.04\n", "true", {"solve.sh": "true\n"}
    )
    d = write_harbor_task(
        tmp_path, "fetch", "net", "Download the page.", "FROM ubuntu:24.04\n", "true", {"solve.sh": "true\n"}
    )
    (d / "tests" / "test.sh").write_text("#!/bin/bash\ncurl -fsS https://example.com/page\n")
    for name in ("allowed", "fetch"):
        toml = tmp_path / name / "task.toml"
        toml.write_text(toml.read_text().replace("allow_internet = false", "allow_internet = true"))
    allowed, fetch = find_eval_tasks(tmp_path)
    assert allowed.environment.available
    assert not fetch.environment.available and "line 2 (curl)" in fetch.environment.reason
    assert all(t.environment.available for t in find_eval_tasks(tmp_path, network=True))


def test_bad_task_set_is_named(tmp_path):
    with pytest.raises(TaskFormatError, match="not found"):
        find_eval_tasks(tmp_path / "nope")
    with pytest.raises(TaskFormatError, match="no Harbor tasks"):
        find_eval_tasks(tmp_path)
    with pytest.raises(ConfigError, match="k"):
        EvalConfig(k=0)
