"""Harbor tasks written the way Docker runs them (issue 16), end to end on real bwrap sandboxes.

Each task here uses one Dockerfile or task.toml feature a Docker build honours (heredocs, ``ENV
PATH=...:${PATH}``, ``USER`` for build steps, ``COPY --chown``, a local ``ADD`` archive, a mirror
registry's base name, a final ``USER``, ``[verifier.env]``/``[solution.env]``/``[agent.env]``, verifier files) and must
score 1 with its reference solution and 0 without. Tasks that cannot run here (a download at test
time, a build needing another Python's ABI) are listed as unavailable with the
line that needs it, and a malformed task as invalid, while the rest of the set runs.

On podman (which builds the real Dockerfile) the same set runs too, except two tasks skipped with
the reason: podman 4.3's builder does not read BuildKit heredocs, and its base image's PATH is not
Docker's (``/usr/local/sbin`` missing), so ``ENV PATH=...:${PATH}`` differs.
"""

from __future__ import annotations

import io
import json
import shutil
import sys
import tarfile
from pathlib import Path

import pytest
from harbor_helpers import write_harbor_task

from tmax_jax.errors import TaskFormatError
from tmax_jax.eval.agents import NoopAgent, OracleAgent
from tmax_jax.eval.environment import check_environment, script_fetches, task_availability
from tmax_jax.eval.runner import EvalConfig, evaluate
from tmax_jax.eval.tasks import find_eval_tasks
from tmax_jax.sandbox import SandboxConfig
from tmax_jax.sandbox.base import BASE_PATH
from tmax_jax.sandbox.bwrap import bwrap_available
from tmax_jax.sandbox.recipe import parse_dockerfile
from tmax_jax.sandbox.rootfs import is_known_base
from tmax_jax.tasks import load_task
from tmax_jax.tasks.runner import run_task

pytestmark = pytest.mark.skipif(not bwrap_available(), reason="bwrap/nsenter not installed")

OTHER_PY = f"3.{sys.version_info.minor + 2}"  # a Python the sandbox (the host's) does not provide
HOST_PY = f"3.{sys.version_info.minor}"


def _toml(d: Path, extra: str) -> None:
    (d / "task.toml").write_text((d / "task.toml").read_text() + extra)


@pytest.fixture(scope="module")
def task_set(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("docker_compat")
    # A BuildKit heredoc RUN script and a heredoc COPY whose unquoted body expands a build ARG.
    write_harbor_task(
        root,
        "heredoc",
        "dockerfile",
        "Write the greeting from /app/conf/settings.ini and the first line of /app/made.txt to /app/out.txt.",
        f"""\
        FROM python:{HOST_PY}-slim
        ARG WHO=world
        WORKDIR /app
        RUN <<EOF
        set -e
        echo "made by heredoc for $WHO" > /app/made.txt
        echo second >> /app/made.txt
        EOF
        COPY <<EOF /app/conf/settings.ini
        [greeting]
        text=hello ${{WHO}}
        EOF
        RUN <<EOF
        #!/usr/bin/env python3
        open("/app/py.txt", "w").write("from a python heredoc\\n")
        EOF
        """,
        '[ "$(cat /app/out.txt 2>/dev/null)" = "hello world|made by heredoc for world" ] '
        '&& [ "$(cat /app/py.txt)" = "from a python heredoc" ] && ! ls /tmp/tmax-heredoc-* 2>/dev/null',
        {
            "solve.sh": 'echo "$(sed -n s/^text=//p /app/conf/settings.ini)|$(head -1 /app/made.txt)" > /app/out.txt\n'
        },
    )
    # ENV PATH=...:${PATH}: the next RUN must still find mkdir, and the agent finds the tool.
    write_harbor_task(
        root,
        "env-path",
        "dockerfile",
        "Run the `stamp` tool and save its output in /app/stamp.txt.",
        """\
        FROM public.ecr.aws/docker/library/ubuntu:24.04
        ENV PATH="/opt/tools/bin:${PATH}" TOOLS_HOME=/opt/tools
        RUN mkdir -p /opt/tools/bin && printf '#!/bin/sh\\necho stamped-$TOOLS_HOME\\n' > /opt/tools/bin/stamp \\
            && chmod +x /opt/tools/bin/stamp
        SHELL ["/bin/bash", "-o", "pipefail", "-c"]
        RUN echo "$PATH" > /opt/tools/path.txt
        WORKDIR /app
        """,
        # $PATH is the base's, after whatever this backend puts first (the host Python's bin dir).
        '[ "$(cat /app/stamp.txt 2>/dev/null)" = "stamped-/opt/tools" ] && '
        f'case "$(cat /opt/tools/path.txt)" in /opt/tools/bin:*{BASE_PATH}) true;; *) false;; esac',
        {"solve.sh": "stamp > /app/stamp.txt\n"},
    )
    # USER for build steps: a RUN after USER nobody runs as nobody; the image ends as root.
    write_harbor_task(
        root,
        "user-build",
        "dockerfile",
        "Write the owner name of /app/shared/owned to /app/owner.txt.",
        """\
        FROM ubuntu:24.04
        RUN mkdir -p /app/shared && chmod 777 /app/shared
        USER nobody
        RUN id -u > /app/shared/built_by && touch /app/shared/owned
        USER root
        COPY --chown=nobody note.txt /app/shared/note.txt
        WORKDIR /app
        """,
        '[ "$(cat /app/owner.txt 2>/dev/null)" = "nobody" ] && [ "$(cat /app/shared/built_by)" = 65534 ] '
        '&& [ "$(stat -c %U /app/shared/note.txt)" = nobody ]',
        {"solve.sh": "stat -c %U /app/shared/owned > /app/owner.txt\n"},
    )
    (root / "user-build" / "environment" / "note.txt").write_text("a note\n")
    # A local archive ADD unpacks into the destination, as Docker's ADD does.
    d = write_harbor_task(
        root,
        "add-archive",
        "dockerfile",
        "Sum the numbers in /app/data/nums/*.txt into /app/sum.txt.",
        "FROM mirror.gcr.io/library/debian:12\nADD nums.tar.gz /app/data/\nWORKDIR /app\n",
        '[ "$(cat /app/sum.txt 2>/dev/null)" = 10 ]',
        {"solve.sh": "echo $(( $(cat /app/data/nums/*.txt | paste -sd+) )) > /app/sum.txt\n"},
    )
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, body in (("nums/a.txt", b"3\n"), ("nums/b.txt", b"7\n")):
            info = tarfile.TarInfo(name)
            info.size = len(body)
            tar.addfile(info, io.BytesIO(body))
    (d / "environment" / "nums.tar.gz").write_bytes(buf.getvalue())
    # task.toml env sections: the solution and the verifier get their own variables.
    d = write_harbor_task(
        root,
        "env-sections",
        "toml",
        "Write the code you were given to /app/answer.txt.",
        "FROM ghcr.io/laude-institute/t-bench/ubuntu-24-04:20250624\nWORKDIR /app\n",
        '[ -n "$EXPECTED" ] && [ "$(cat /app/answer.txt 2>/dev/null)" = "$EXPECTED" ] && [ "$SOLUTION_CODE" = "" ]',
        {"solve.sh": 'echo "$SOLUTION_CODE" > /app/answer.txt\n'},
    )
    _toml(d, '[verifier.env]\nEXPECTED = "c0de-42"\n[solution.env]\nSOLUTION_CODE = "c0de-42"\n')
    # The verifier's own files under /logs/verifier are kept in the attempt dir.
    d = write_harbor_task(
        root,
        "verifier-files",
        "evidence",
        "Create /app/done.",
        "FROM ubuntu:24.04\nWORKDIR /app\n",
        "[ -e /app/done ]",
        {"solve.sh": "touch /app/done\n"},
    )
    test_sh = d / "tests" / "test.sh"
    test_sh.write_text(
        test_sh.read_text()
        + 'echo \'{"results": {"summary": {"tests": 1}}}\' > /logs/verifier/ctrf.json\n'
        + "ls -la /app > /logs/verifier/app-listing.log\n"
        + "mkdir -p /logs/verifier/pytest/run1 && echo nested > /logs/verifier/pytest/run1/out.log\n"
        + "ln -s /etc/hostname /logs/verifier/pytest/link\n"
    )
    # Needs the network at test time: listed as unavailable, naming tests/test.sh's line.
    d = write_harbor_task(
        root,
        "test-download",
        "net",
        "Create /app/done.",
        "FROM ubuntu:24.04\nWORKDIR /app\n",
        "[ -e /app/done ]",
        {"solve.sh": "touch /app/done\n"},
    )
    test_sh = d / "tests" / "test.sh"
    test_sh.write_text(
        "#!/bin/bash\ncurl -s http://localhost:8000/health || true\n"
        "curl -LsSf https://astral.sh/uv/0.7.13/install.sh | sh\n" + test_sh.read_text().split("\n", 1)[1]
    )
    # The image's last USER (one its build created): the agent's commands run as it, with its HOME.
    write_harbor_task(
        root,
        "final-user",
        "dockerfile",
        "Create /app/done.",
        # (the user written into /etc/passwd by hand: podman's minimal base has no useradd)
        "FROM ubuntu:24.04\nRUN echo agent:x:1234:1234::/home/agent:/bin/sh >> /etc/passwd && "
        "echo agent:x:1234: >> /etc/group && mkdir -p /app /home/agent && chown agent:agent /app /home/agent\n"
        "WORKDIR /app\nUSER agent\n",
        '[ "$(stat -c %U /app/done 2>/dev/null)" = agent ]',
        {"solve.sh": '[ "$(id -un):$HOME:$USER" = agent:/home/agent:agent ] && touch /app/done\n'},
    )
    # Multi-stage: COPY --from an earlier stage; that stage's other files (in /usr and /etc too, and
    # what it deleted there) and ENV stay out of the image, and a stage nothing refers to is not
    # built (its RUN would fail).
    write_harbor_task(
        root,
        "multi-stage",
        "dockerfile",
        "Copy the artifact's text from /app/dist/artifact.txt to /app/result.txt.",
        """\
        FROM ubuntu:24.04 AS builder
        ENV BUILD_MODE=release
        WORKDIR /srv/build
        RUN mkdir -p out && echo "built-$BUILD_MODE" > out/artifact.txt && mkdir -p /app && echo junk > /app/junk.txt
        RUN mkdir -p /src /var/log && echo junk > /src/junk.txt && echo junk > /var/log/stage.log
        RUN echo junk > /etc/stage-leak.conf && echo junk > /usr/local/stage-leak && rm -f /usr/bin/nl
        FROM ubuntu:24.04 AS unused
        RUN exit 1
        FROM docker.io/library/ubuntu:24.04
        WORKDIR /app
        COPY --from=builder /srv/build/out/ /app/dist/
        COPY --from=0 /usr/bin/env /app/bin/env-from-base
        """,
        '[ "$(cat /app/result.txt 2>/dev/null)" = "built-release" ] && [ ! -e /app/junk.txt ] '
        "&& [ ! -e /srv/build ] && [ ! -e /src/junk.txt ] && [ ! -e /var/log/stage.log ] "
        '&& [ ! -e /tmp/tmax-stage ] && [ -z "$BUILD_MODE" ] && [ -x /app/bin/env-from-base ] '
        "&& [ ! -e /etc/stage-leak.conf ] && [ ! -e /usr/local/stage-leak ] && [ -x /usr/bin/nl ]",
        {"solve.sh": '[ -z "$BUILD_MODE" ] && cat /app/dist/artifact.txt > /app/result.txt\n'},
    )
    # `python3 -m` from the app dir finds the app's package and a script its sibling modules, as under
    # Docker; but the app dir comes after the standard library, so a json.py / unittest.py planted
    # there while the tests run (here by the verifier itself, as a process the agent left could, and
    # removed again before the scan after it) does not stand in for the real module.
    write_harbor_task(
        root,
        "python-m-cwd",
        "dockerfile",
        "Write calc/core.py with add(a, b).",
        "FROM ubuntu:24.04\nWORKDIR /app\nRUN mkdir -p calc && touch calc/__init__.py && "
        "printf 'from calc.core import add\\nprint(add(2, 3))\\n' > calc/__main__.py\n",
        '[ "$(cd /app && python3 -m calc 2>/dev/null)" = 5 ] '
        '&& [ "$(cd / && python3 /app/calc/__main__.py 2>/dev/null)" = "" ] '
        "&& [ \"$(cd /app && echo 'raise SystemExit(3)' > json.py && cp json.py unittest.py && "
        "python3 -c 'import json, unittest; print(json.dumps([unittest.__name__]))' 2>/dev/null; "
        'rm -f json.py unittest.py)" = \'["unittest"]\' ] '
        "&& [ \"$(cd / && echo 'X = 7' > /app/sib.py && echo 'import sib; print(sib.X)' > /app/main_s.py && "
        'python3 /app/main_s.py 2>/dev/null; rm -f /app/sib.py /app/main_s.py)" = 7 ]',
        {"solve.sh": "printf 'def add(a, b):\\n    return a + b\\n' > /app/calc/core.py\n"},
    )
    # A command the task's own build put on PATH, which the instruction asks the agent to fix (a public
    # task's wrapper script): task content, as under Docker, not the verifier's toolchain.
    write_harbor_task(
        root,
        "task-command",
        "dockerfile",
        "Fix /usr/local/bin/greet so that it prints hello.",
        "FROM python:3.11-slim\nRUN printf '#!/bin/sh\\necho broken\\n' > /usr/local/bin/greet "
        "&& chmod 0644 /usr/local/bin/greet\nWORKDIR /app\n",
        '[ "$(greet 2>/dev/null)" = hello ]',
        {
            "solve.sh": "printf '#!/bin/sh\\necho hello\\n' > /usr/local/bin/greet && chmod 0755 /usr/local/bin/greet\n"
        },
    )
    # `pytest --ctrf /logs/verifier/ctrf.json`, as most Terminal-Bench 2 verifiers run it, with the
    # plugin their Dockerfile would pip-install absent (offline): the verifier's own --ctrf plugin
    # writes the report, and the test decides the reward.
    d = write_harbor_task(
        root,
        "ctrf",
        "evidence",
        "Write 42 into /app/answer.txt.",
        "FROM python:3.11-slim\nWORKDIR /app\n",
        "python3 -m pytest -q -p no:cacheprovider --ctrf /logs/verifier/ctrf.json /tests/test_answer.py",
        {"solve.sh": "echo 42 > /app/answer.txt\n"},
    )
    (d / "tests" / "test_answer.py").write_text(
        "import pytest\n\n\ndef test_answer():\n    assert open('/app/answer.txt').read().strip() == '42'\n\n\n"
        "def test_exists():\n    import os\n\n    assert os.path.exists('/app/answer.txt')\n\n\n"
        "@pytest.mark.skip(reason='not this one')\ndef test_skipped():\n    pass\n"
    )
    # The base image's own empty dirs outside /usr and /etc: a service logging to /var/log without
    # a mkdir (as a public task's solution does), /var/lib in a build step, /var/run -> /run; the
    # host's /var is not shown (its /var/lib has entries).
    write_harbor_task(
        root,
        "base-dirs",
        "dockerfile",
        "Start the service: log 'started' to /var/log/svc.log and its pid to /var/run/svc.pid.",
        "FROM ubuntu:24.04\nRUN echo built > /var/log/build.log && mkdir /var/lib/app\nWORKDIR /app\n",
        '[ "$(cat /var/log/svc.log 2>/dev/null)" = started ] && [ -s /run/svc.pid ] '
        '&& [ "$(cat /var/log/build.log)" = built ] && [ "$(ls /var/lib)" = app ] && [ -d /var/cache ] '
        "&& [ -d /var/spool ] && [ -d /mnt ] && [ -d /media ] && [ -d /srv ] && [ -L /var/lock ]",
        {"solve.sh": "echo started > /var/log/svc.log && echo $$ > /var/run/svc.pid\n"},
    )
    # allow_internet = true alone (the boilerplate of public task.toml files), and a verifier whose
    # download may fail (`|| true`): runs offline, noted in the result, never listed unavailable.
    d = write_harbor_task(
        root,
        "internet-allowed",
        "net",
        "Create /app/done.",
        "FROM ubuntu:24.04\nWORKDIR /app\n",
        "[ -e /app/done ]",
        {"solve.sh": "touch /app/done\n"},
    )
    test_sh = d / "tests" / "test.sh"
    test_sh.write_text(
        "#!/bin/bash\ncurl -fsS https://example.com/x -o /tmp/x 2>/dev/null || true\n"
        + test_sh.read_text().split("\n", 1)[1]
    )
    toml = d / "task.toml"
    toml.write_text(toml.read_text().replace("allow_internet = false", "allow_internet = true"))
    # A malformed task dir (task.toml is not TOML): listed as invalid, the others run.
    d = write_harbor_task(
        root, "broken-toml", "dockerfile", "x", "FROM ubuntu:24.04\n", "true", {"solve.sh": "true\n"}
    )
    (d / "task.toml").write_text("[verifier\ntimeout_sec = 3\n")
    return root


SCORED = (
    "add-archive",
    "ctrf",
    "base-dirs",
    "env-path",
    "env-sections",
    "final-user",
    "heredoc",
    "internet-allowed",
    "multi-stage",
    "python-m-cwd",
    "task-command",
    "user-build",
    "verifier-files",
)


@pytest.fixture(scope="module")
def runs(task_set, tmp_path_factory):
    cfg = SandboxConfig(cache_dir=str(tmp_path_factory.mktemp("cache")))
    out = tmp_path_factory.mktemp("runs")
    quiet = lambda _m: None  # noqa: E731
    oracle = evaluate(
        task_set, OracleAgent(), out / "oracle", EvalConfig(concurrency=2), sandbox_cfg=cfg, log=quiet
    )
    noop = evaluate(
        task_set, NoopAgent(), out / "noop", EvalConfig(concurrency=2), sandbox_cfg=cfg, log=quiet
    )
    return out, {r["task_id"]: r for r in oracle["tasks"]}, {r["task_id"]: r for r in noop["tasks"]}, oracle


def test_ctrf_report_is_written_and_kept(runs):
    out, *_ = runs
    for agent, passed, failed in (("oracle", 2, 0), ("noop", 0, 2)):
        report = out / agent / "tasks" / "ctrf" / "attempt-0" / "verifier" / "ctrf.json"
        doc = json.loads(report.read_text())["results"]
        assert doc["tool"]["name"] == "pytest"
        want = {"tests": 3, "passed": passed, "failed": failed, "skipped": 1}
        assert {k: doc["summary"][k] for k in want} == want, (agent, doc["summary"])
        status = {t["name"].rsplit("::", 1)[1]: t["status"] for t in doc["tests"]}
        assert status == {
            "test_answer": "passed" if passed else "failed",
            "test_exists": "passed" if passed else "failed",
            "test_skipped": "skipped",
        }


def test_docker_features_pass_with_solution_and_fail_without(runs):
    out, oracle, noop, _ = runs
    for name in SCORED:
        assert oracle[name]["status"] == "evaluated", (name, oracle[name])
        assert oracle[name]["passes"] == 1, (name, oracle[name])
        assert noop[name]["status"] == "evaluated" and noop[name]["passes"] == 0, (name, noop[name])
        assert noop[name]["mean_reward"] == 0.0
    for agent in ("oracle", "noop"):
        results = [json.loads(x) for x in (out / agent / "results.jsonl").read_text().splitlines()]
        reasons = {r["task_id"]: r["reason"] for r in results}
        assert "task.toml allows the internet; this run is offline" in reasons["internet-allowed"]
        assert "allows the internet" not in reasons["base-dirs"]


PODMAN_SKIPPED = {
    "heredoc": "podman 4.3's builder reads a BuildKit heredoc's body as instructions",
    "env-path": "the podman base image's PATH is not Docker's default PATH",
}


@pytest.mark.podman
def test_docker_features_on_podman(task_set, tmp_path_factory):
    from tmax_jax.sandbox.podman_images import podman_available

    ok, why = podman_available()
    if not ok:
        pytest.skip(why)
    cfg = SandboxConfig(backend="podman", cache_dir=str(tmp_path_factory.mktemp("pcache")))
    out = tmp_path_factory.mktemp("pruns")
    rows = {}
    for agent in (OracleAgent(), NoopAgent()):
        s = evaluate(
            task_set, agent, out / agent.name, EvalConfig(concurrency=2), sandbox_cfg=cfg, log=lambda _m: None
        )
        rows[agent.name] = {r["task_id"]: r for r in s["tasks"]}
    for name in (n for n in SCORED if n not in PODMAN_SKIPPED):
        row = rows["oracle"][name]
        assert row["passes"] == 1, (name, row.get("status"), row.get("reason"))
        assert rows["noop"][name]["status"] == "evaluated" and rows["noop"][name]["passes"] == 0, name
    assert rows["oracle"]["test-download"]["status"] == "env_unavailable"
    assert rows["oracle"]["broken-toml"]["status"] == "invalid"


def test_unrunnable_tasks_are_listed_not_scored(runs):
    _, oracle, noop, summary = runs
    for rows in (oracle, noop):
        assert rows["test-download"]["status"] == "env_unavailable"
        assert (
            "tests/test.sh" in rows["test-download"]["reason"]
            and "line 3 (curl)" in rows["test-download"]["reason"]
        )
        # curl to the task's own service (line 2) is not a download
        assert "line 2" not in rows["test-download"]["reason"]
        assert (
            rows["broken-toml"]["status"] == "invalid" and "not valid TOML" in rows["broken-toml"]["reason"]
        )
    o = summary["overall"]
    assert (o["evaluated"], o["env_unavailable"], o["invalid"]) == (len(SCORED), 1, 1)
    assert o["pass_at"]["1"] == 1.0  # over the evaluated tasks only
    assert [r["task_id"] for r in summary["invalid"]] == ["broken-toml"]


def test_attempt_dir_keeps_the_verifier_files(runs):
    out, *_ = runs
    vdir = out / "oracle" / "tasks" / "verifier-files" / "attempt-0" / "verifier"
    kept = sorted(str(p.relative_to(vdir)) for p in vdir.rglob("*") if p.is_file() or p.is_symlink())
    # Subdirectories too; the link the verifier made is not followed nor kept.
    assert kept == ["app-listing.log", "ctrf.json", "pytest/run1/out.log", "reward.txt"]
    assert (vdir / "pytest" / "run1" / "out.log").read_text() == "nested\n"
    assert json.loads((vdir / "ctrf.json").read_text())["results"]["summary"]["tests"] == 1
    assert (vdir / "reward.txt").read_text().strip() == "1"
    assert "done" in (vdir / "app-listing.log").read_text()
    noop_dir = out / "noop" / "tasks" / "verifier-files" / "attempt-0" / "verifier"
    assert (noop_dir / "reward.txt").read_text().strip() == "0"


def test_agent_env_reaches_the_agent_shell_only(task_set, tmp_path):
    d = task_set / "env-sections"
    (tmp_path / "t").mkdir()
    t2 = tmp_path / "t" / "env-agent"
    shutil.copytree(d, t2)
    _toml(t2, '[agent.env]\nAGENT_HINT = "from-toml"\nRETRIES = 3\n')
    task = load_task(t2)
    assert task.agent_env == {"AGENT_HINT": "from-toml", "RETRIES": "3"}
    assert task.verifier_env == {"EXPECTED": "c0de-42"} and task.solution_env == {"SOLUTION_CODE": "c0de-42"}
    seen = {}

    def agent(task, sh):
        seen["env"] = sh.run('echo "$AGENT_HINT $RETRIES [$SOLUTION_CODE] [$EXPECTED]"').stdout.strip()

    res = run_task(task, agent, SandboxConfig(cache_dir=str(tmp_path / "cache")))
    assert seen["env"] == "from-toml 3 [] []"
    assert res.reward == 0.0 and res.verifier_files["reward.txt"].strip() == b"0"
    assert res.to_json()["verifier_files"] == ["reward.txt"]


def test_bad_env_section_names_the_key(task_set, tmp_path):
    t2 = tmp_path / "bad-env"
    shutil.copytree(task_set / "heredoc", t2)
    _toml(t2, '[verifier.env]\n"BAD-NAME" = "x"\n')
    with pytest.raises(TaskFormatError, match="verifier.env: 'BAD-NAME'"):
        load_task(t2)


def test_python_tag_mismatch_is_noted_and_abi_builds_are_unavailable(tmp_path):
    cfg = SandboxConfig(cache_dir=str(tmp_path / "cache"))
    d = write_harbor_task(
        tmp_path,
        "py-note",
        "python",
        "Create /app/done.",
        f"FROM python:{OTHER_PY}-slim\nWORKDIR /app\n",
        "[ -e /app/done ]",
        {"solve.sh": "touch /app/done\n"},
    )
    res = run_task(load_task(d), "oracle", cfg)
    assert res.reward == 1.0 and f"asks for Python {OTHER_PY}" in res.reason
    py = f"cp3{sys.version_info.minor + 2}"
    d = write_harbor_task(
        tmp_path,
        "py-abi",
        "python",
        "Create /app/done.",
        f"FROM python:{OTHER_PY}\nCOPY wheels/ /app/wheels/\n"
        f"RUN pip install --no-index /app/wheels/tool-1.0-{py}-{py}-manylinux_2_17_x86_64.whl\n",
        "[ -e /app/done ]",
        {"solve.sh": "touch /app/done\n"},
    )
    (d / "environment" / "wheels").mkdir()
    res = run_task(load_task(d), "oracle", cfg)
    assert res.reward == 0.0 and res.reason.startswith("environment build failed")
    assert f"Python {OTHER_PY}'s ABI ({py})" in res.reason and "(line 3)" in res.reason


@pytest.mark.parametrize(
    "image, known",
    [
        ("docker.io/library/python:3.12-slim", True),
        ("public.ecr.aws/docker/library/debian:bookworm", True),
        ("mirror.gcr.io/library/ubuntu:24.04", True),
        ("ghcr.io/laude-institute/t-bench/python-3-13:20250620", True),
        ("python@sha256:" + "a" * 64, True),
        ("ghcr.io/someone/ubuntu:24.04", False),
        ("localhost:5000/ubuntu", False),
        ("nvidia/cuda:12.4.0-base-ubuntu22.04", False),
    ],
)
def test_mirror_registries_map_like_docker_hub(image, known):
    assert is_known_base(image) is known


def test_env_path_expands_over_the_base_image_path(tmp_path):
    p = tmp_path / "Dockerfile"
    p.write_text('FROM ubuntu:24.04\nENV PATH="/opt/x:${PATH}" H=${HOME}/h U=${UNSET:-dflt}\n')
    env = {s.args[0]: s.args[1] for s in parse_dockerfile(p).steps if s.kind == "env"}
    assert env == {"PATH": f"/opt/x:{BASE_PATH}", "H": "/root/h", "U": "dflt"}


@pytest.mark.parametrize(
    "line, what",
    [
        ("curl -LsSf https://astral.sh/uv/install.sh | sh", "curl"),
        ("wget -qO- https://example.com/x.tgz | tar xz", "wget"),
        ("uvx -p 3.13 -w pytest==8.4.1 pytest /tests/test_outputs.py", "uvx"),
        ("uv run --with pytest pytest -q", "uv"),
        ("pip3.12 install pytest==8.3", "pip install"),
        ("python3.11 -m pip install requests", "pip install"),
        ("pip download numpy -d /tmp/w", "pip download"),
        ("cargo build --release", "cargo"),
        ("mvn -q package", "maven"),
        ("./gradlew test", "gradle"),
        ("dotnet restore", "dotnet restore"),
        ("huggingface-cli download gpt2", "huggingface-cli"),
        ("npx -y prettier --check .", "npm install"),
        ("git clone https://github.com/a/b /src", "git clone"),
        ("apt-get update && apt-get install -y curl", "apt-get"),
    ],
)
def test_script_downloads_are_found(line, what):
    assert script_fetches(f"#!/bin/bash\nset -e\n{line}\n") == [(3, what)]


@pytest.mark.parametrize(
    "line",
    [
        "curl -fsS http://localhost:8000/health",
        "curl -s http://127.0.0.1:5000/api && wget -qO- http://app:8080/",
        "pip install --no-index --find-links /wheels mypkg",
        "pip install --no-deps /app/dist/pkg-1.0-py3-none-any.whl",
        "cargo build --offline --release",
        "mvn -o package",
        "git clone /srv/repo.git /tmp/r",
        "# pip install numpy (a comment)",
        "python3 -m pytest -q /tests/test_outputs.py",
        "python3 -m pip install --break-system-packages -q pytest==9.0.3 2>/dev/null || true",
        "apt-get install -y jq || :",
    ],
)
def test_offline_script_lines_are_not_flagged(line):
    assert script_fetches(f"#!/bin/bash\n{line}\n") == []


def test_solution_download_is_unavailable_offline(tmp_path):
    d = write_harbor_task(
        tmp_path, "sol-dl", "net", "x", "FROM ubuntu:24.04\n", "true", {"solve.sh": "pip install cowsay\n"}
    )
    res = check_environment(d)
    assert not res.available and "solution/solve.sh" in res.reason and "line 3 (pip install)" in res.reason
    assert check_environment(d, network=True).available
    (t,) = find_eval_tasks(tmp_path)
    assert not t.environment.available


def test_run_task_and_train_list_network_tasks_as_unavailable(task_set, tmp_path, capsys):
    """Offline, ``run-task``/``run-tasks`` report a task whose tests download as unavailable (exit
    3, the line named) without running it, and ``train``'s tasks.dir never trains on it."""
    import argparse

    from tmax_jax.commands.run_task import run, run_many
    from tmax_jax.train.config import load_train_config
    from tmax_jax.train.setup import load_task_sets

    common = dict(oracle=True, backend="bwrap", rootfs="host", json=True, cache_dir=str(tmp_path / "c"))
    assert run(argparse.Namespace(task_dir=task_set / "test-download", network=False, **common)) == 3
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert line["status"] == "env_unavailable" and "line 3 (curl)" in line["reason"], line
    d = tmp_path / "set"
    for name in ("test-download", "env-path", "heredoc", "user-build", "add-archive"):
        shutil.copytree(task_set / name, d / name)
    # Only the unavailable one listed (the others' runs are covered above): run-tasks on a set of one.
    only = tmp_path / "only"
    shutil.copytree(task_set / "test-download", only / "test-download")
    assert run_many(argparse.Namespace(dir=only, concurrency=1, network=False, **common)) == 0
    out = [json.loads(x) for x in capsys.readouterr().out.strip().splitlines()]
    assert out[0]["status"] == "env_unavailable" and out[-1]["summary"]["tasks"] == 0
    assert out[-1]["summary"]["env_unavailable"] == 1
    cfg = load_train_config(
        None, {"run_dir": str(tmp_path / "run"), "tasks": {"dir": str(d), "num_heldout": 1}}
    )
    train, held = load_task_sets(cfg, tmp_path / "run")
    names = {t.path.name for t in train + held}
    assert names == {"env-path", "heredoc", "user-build", "add-archive"}
    assert "skipping unavailable task" in capsys.readouterr().err


@pytest.mark.podman
def test_podman_uses_a_local_docker_image_without_building(tmp_path):
    """``[environment] docker_image`` on podman, offline: a local image of that name is run as is
    (the task's Dockerfile, which downloads and would fail to build, is not built), so the task is
    available there; on bwrap, which builds the Dockerfile, it is unavailable offline."""
    import subprocess
    import uuid

    from tmax_jax.sandbox.podman_images import ensure_base_image, podman_available

    ok, why = podman_available()
    if not ok:
        pytest.skip(why)
    cfg = SandboxConfig(backend="podman", cache_dir=str(tmp_path / "cache"))
    name = f"localhost/tmax-test-prebuilt:{uuid.uuid4().hex[:8]}"
    subprocess.run(["podman", "tag", ensure_base_image(SandboxConfig(backend="podman")), name], check=True)
    try:
        d = write_harbor_task(
            tmp_path,
            "prebuilt",
            "dockerfile",
            "Create /app/done.",
            "FROM ubuntu:24.04\nRUN apt-get update && apt-get install -y curl && exit 1\n",
            "[ -e /app/done ]",
            {"solve.sh": "mkdir -p /app && touch /app/done\n"},
        )
        (d / "task.toml").write_text(
            (d / "task.toml").read_text() + f'docker_image = "{name}"\n'
        )  # in [environment]
        task = load_task(d)
        assert task.environment.image == name
        assert task_availability(task, backend="podman").available
        assert "apt-get" in task_availability(task, backend="bwrap").reason
        (t,) = [t for t in find_eval_tasks(tmp_path, backend="podman") if t.task_id == "prebuilt"]
        assert t.environment.available
        good, bad = run_task(task, "oracle", cfg), run_task(task, None, cfg)
        assert (good.reward, bad.reward) == (1.0, 0.0), (good.reason, good.verifier_log[-500:])
    finally:
        subprocess.run(["podman", "rmi", name], capture_output=True)
