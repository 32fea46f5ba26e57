"""Podman backend on this machine (runc, --network none, local base image); skipped where podman
cannot run containers, with the reason."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest
from sandbox_helpers import pid_ns, procs_in_ns

from tmax_jax.sandbox import SandboxConfig, make_sandbox
from tmax_jax.sandbox.podman_images import ensure_base_image, podman_available
from tmax_jax.tasks import load_task
from tmax_jax.tasks.runner import run_task

TASKS = Path(__file__).parent / "tasks"
OK, WHY = podman_available()
pytestmark = [pytest.mark.podman, pytest.mark.skipif(not OK, reason=WHY)]


@pytest.fixture(scope="module")
def cfg():
    # The default cache dir: the base image (host-derived rootfs) is built once per machine.
    c = SandboxConfig(backend="podman", exec_timeout_s=60, pids_max=128, memory_mb=512, disk_mb=64)
    tag = ensure_base_image(c)
    r = subprocess.run(
        [
            "podman",
            "run",
            "--rm",
            "--runtime",
            "runc",
            "--network",
            "none",
            "--ulimit=nofile=20000:20000",
            "--ulimit=nproc=4096:4096",
            tag,
            "true",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    if r.returncode != 0:
        pytest.skip(f"podman cannot run containers here: {r.stderr.strip()[-300:]}")
    return c


def _containers(name: str) -> str:
    return subprocess.run(
        ["podman", "ps", "-a", "--filter", f"name={name}", "--format", "{{.Names}}"],
        capture_output=True,
        text=True,
    ).stdout.strip()


def test_podman_exec_shell_files_and_isolation(cfg, tmp_path):
    with make_sandbox(cfg) as sb:
        name = sb.name
        r = sb.exec("cat; echo $FOO; pwd", stdin="in\n", env={"FOO": "bar"}, cwd="/tmp")
        assert r.stdout == "in\nbar\n/tmp\n"
        sh = sb.shell()
        sh.run("cd /tmp; export A=7")
        assert sh.run("pwd; echo $A").stdout == "/tmp\n7\n"
        r = sh.run("sleep 60", timeout=1)
        assert r.timed_out and sh.run("echo ok").stdout == "ok\n"
        r = sb.exec("sleep 60 & sleep 60", timeout=1)
        assert r.timed_out
        alive = "ps -eo stat=,comm= | awk '$2 == \"sleep\" && $1 !~ /Z/' | wc -l"
        assert sb.exec(alive).stdout.strip() == "1"  # only the container's own ``sleep infinity``
        assert sb.exec("ps -eo stat= | grep -c Z || true").stdout.strip() == "0"  # and init reaped the rest
        r = sb.exec("head -c 1G /dev/zero", max_output_bytes=50_000)
        assert r.truncated and len(r.stdout) == 50_000
        (tmp_path / "f.txt").write_text("payload")
        sb.upload(tmp_path / "f.txt", "/app/f.txt")
        assert sb.read_file("/app/f.txt") == b"payload"
        code = "import socket\ntry:\n socket.create_connection(('1.1.1.1', 53), timeout=2); print('net')\nexcept OSError: print('nonet')"
        assert sb.exec(["python3", "-c", code]).stdout == "nonet\n"
        assert int(sb.exec("ulimit -n").stdout) == 20000
        assert _containers(name) == name
    assert _containers(name) == ""


def test_podman_fork_bomb_is_bounded_and_removed(cfg):
    with make_sandbox(cfg) as sb:
        name = sb.name
        pid = int(
            subprocess.run(
                ["podman", "inspect", "-f", "{{.State.Pid}}", name], capture_output=True, text=True
            ).stdout
        )
        ns = pid_ns(pid)
        # Detached from the command's pipes, so that no SIGPIPE stops it: it lives until close.
        sb.exec("(b() { b | b & }; b) >/dev/null 2>&1 </dev/null &", timeout=3)
        counts = []
        for _ in range(50):
            counts.append(len(procs_in_ns(ns)))
            time.sleep(0.02)
        assert 2 < max(counts) <= cfg.pids_max, counts
    assert _containers(name) == ""
    # The kernel reaps a dying PID namespace's processes asynchronously after its init has exited.
    deadline = time.monotonic() + 10
    while procs_in_ns(ns) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert procs_in_ns(ns) == []


@pytest.mark.parametrize("task", ["harbor_csv_sum", "tmax_log_errors"])
def test_podman_example_tasks(cfg, task):
    t = load_task(TASKS / task)
    good = run_task(t, "oracle", cfg)
    assert (good.reward, good.passed) == (1.0, True), good.reason + good.verifier_log
    bad = run_task(t, None, cfg)
    assert bad.reward == 0.0 and bad.reason == "verifier failed"


def _profile_in_child(cache: str) -> str:
    from tmax_jax.sandbox.podman import seccomp_profile

    return str(seccomp_profile(cache))


def test_seccomp_profile_built_once_by_concurrent_starters(tmp_path):
    import json
    import multiprocessing

    from tmax_jax.sandbox.podman import SECCOMP_DENY

    with multiprocessing.get_context("spawn").Pool(4) as pool:
        paths = pool.map(_profile_in_child, [str(tmp_path)] * 8)
    assert len(set(paths)) == 1
    prof = json.loads(Path(paths[0]).read_text())
    allowed = {
        n
        for r in prof["syscalls"]
        if r["action"] == "SCMP_ACT_ALLOW" and not r.get("args")
        for n in r["names"]
    }
    assert not allowed & (set(SECCOMP_DENY) | {"clone", "clone3"})
    assert {"mount", "ptrace", "keyctl", "io_uring_setup", "unshare", "setns"} <= set(SECCOMP_DENY)
    # Only the finished profile and the lock are left: no half-written temporary file.
    assert sorted(p.name for p in (tmp_path / "podman").iterdir()) == [".seccomp.lock", Path(paths[0]).name]
