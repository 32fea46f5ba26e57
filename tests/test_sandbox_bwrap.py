"""bwrap sandboxes on this machine: isolation, exec semantics, shell state, limits, cleanup."""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from pathlib import Path

import pytest
from sandbox_helpers import pid_ns, procs_in_ns

from tmax_jax.errors import ConfigError, SandboxError
from tmax_jax.sandbox import EpisodeTimeout, SandboxConfig, make_sandbox
from tmax_jax.sandbox import cgroup as cgroup_mod
from tmax_jax.sandbox.bwrap import bwrap_available

pytestmark = pytest.mark.skipif(
    not bwrap_available(), reason="bwrap or nsenter missing (apt install bubblewrap)"
)


@pytest.fixture
def cfg(tmp_path):
    return SandboxConfig(
        cache_dir=str(tmp_path / "cache"), exec_timeout_s=30, pids_max=128, memory_mb=512, disk_mb=64
    )


@pytest.fixture
def sb(cfg):
    with make_sandbox(cfg) as s:
        yield s


def test_exec_basics_stdin_env_cwd(sb):
    r = sb.exec("cat; echo; echo $FOO; pwd", stdin="from-stdin", env={"FOO": "bar"}, cwd="/tmp")
    assert r.exit_code == 0 and not r.timed_out and not r.truncated
    assert r.stdout == "from-stdin\nbar\n/tmp\n"
    r = sb.exec(["/bin/sh", "-c", "echo err >&2; exit 7"])
    assert (r.exit_code, r.stderr) == (7, "err\n")
    # exec does not carry cwd or variables over
    sb.exec("cd /tmp; export X=1")
    assert sb.exec("pwd; echo ${X:-unset}").stdout == "/app\nunset\n"


def test_exec_timeout_kills_the_tree(sb):
    t0 = time.monotonic()
    r = sb.exec("sleep 30 & sleep 30; echo never", timeout=1.0)
    assert r.timed_out and r.exit_code == 124 and "never" not in r.stdout
    assert time.monotonic() - t0 < 6
    assert sb.exec("ps -eo comm | grep -c '^sleep$' || true").stdout.strip() in (
        "0",
        "1",
    )  # the init's own sleep


def test_output_flood_is_capped_and_killed(sb):
    t0 = time.monotonic()
    r = sb.exec("head -c 1G /dev/zero | tr '\\0' x", max_output_bytes=100_000)
    assert r.truncated and r.exit_code == 137
    assert len(r.stdout) == 100_000 and "output truncated" in r.stderr
    assert time.monotonic() - t0 < 10


def test_upload_download_roundtrip(sb, tmp_path):
    src = tmp_path / "tree"
    (src / "sub").mkdir(parents=True)
    (src / "a.txt").write_text("alpha")
    (src / "sub" / "b.bin").write_bytes(bytes(range(256)))
    sb.upload(src, "/app/tree")
    assert sb.exec("cat /app/tree/a.txt; wc -c < /app/tree/sub/b.bin").stdout == "alpha256\n"
    sb.exec("echo changed > /app/tree/a.txt")
    out = tmp_path / "back"
    sb.download("/app/tree", out)
    assert (out / "a.txt").read_text() == "changed\n"
    assert (out / "sub" / "b.bin").read_bytes() == bytes(range(256))
    sb.write_file("/tmp/x/y.txt", "hey")
    assert sb.read_file("/tmp/x/y.txt") == b"hey"
    with pytest.raises(SandboxError, match="does not exist"):
        sb.download("/nope", tmp_path / "nope")
    with pytest.raises(SandboxError, match="absolute"):
        sb.upload(src, "relative/path")


def test_persistent_shell_state(sb):
    sh = sb.shell()
    assert sh.run("cd /tmp && export GREETING=hi && f() { echo fn-$1; }").exit_code == 0
    r = sh.run("pwd; echo $GREETING; f 3")
    assert r.stdout == "/tmp\nhi\nfn-3\n"
    assert sh.run("false").exit_code == 1
    assert sh.run("echo 'unclosed").exit_code == 2  # a syntax error cannot hang the protocol
    assert sh.run("cat").stdout == ""  # commands get /dev/null as stdin
    assert sh.run("printf abc").stdout == "abc"
    # timeout kills only that command; the shell, its cwd and older background jobs survive
    sh.run("sleep 300 &")
    r = sh.run("sleep 30", timeout=1)
    assert r.timed_out and r.exit_code == 124
    r = sh.run("pwd; jobs | grep -c Running")
    assert r.stdout == "/tmp\n1\n"
    # the shell exiting is reported and replaced by a fresh one
    assert sh.run("exit 3").exit_code == 3
    r = sh.run("pwd")
    assert "fresh shell" in r.stdout and r.stdout.endswith("/app\n")


def test_shell_flood_and_busy_builtin(sb):
    sh = sb.shell()
    r = sh.run("yes", max_output_bytes=10_000, timeout=20)
    assert r.truncated and r.exit_code == 137 and "output truncated" in r.stdout
    assert sh.run("echo alive").stdout == "alive\n"
    r = sh.run("while :; do :; done", timeout=1)  # a builtin loop: the shell itself must go
    assert r.timed_out
    assert sh.run("echo again").stdout.endswith("again\n")


def test_exec_and_shell_share_processes_and_loopback(sb):
    sh = sb.shell()
    sh.run("python3 -m http.server 8765 --bind 127.0.0.1 >/dev/null 2>&1 &")
    script = "import time,urllib.request as u\nfor _ in range(50):\n  try: print(u.urlopen('http://127.0.0.1:8765/').status); break\n  except OSError: time.sleep(0.1)"
    r = sb.exec(["python3", "-c", script], timeout=20)
    assert r.stdout.strip() == "200", r.output


def test_isolation_no_host_writes(sb):
    marker = f"tmax-test-{uuid.uuid4().hex}"
    r = sb.exec(f"touch /usr/{marker}; echo x > /etc/{marker}; touch /{marker}; echo ok > /tmp/{marker}")
    # Copy-on-write over the base as host root (a writable root, as in a container); read-only else.
    assert r.stderr.count("Read-only file system") == (0 if os.geteuid() == 0 else 2), r.stderr
    for host in (f"/usr/{marker}", f"/etc/{marker}", f"/{marker}", f"/tmp/{marker}"):
        assert not os.path.exists(host)
    # host-only places are not there at all
    assert sb.exec("ls /work 2>&1; ls /root").stdout.count("No such file") == 1
    # /var/lib is the base image's empty dir (as in a container), not the host's
    r = sb.exec("test -d /var/lib && find /var/lib /var/log /var/cache -mindepth 1 | wc -l")
    assert r.stdout.strip() == "0", r.output
    # Root inside holds Docker's default capabilities, and only in the sandbox's user namespace:
    # its uid is an unprivileged one on the host, so host-owned files stay out of reach.
    caps = int(sb.exec("grep CapEff /proc/self/status").stdout.split()[-1], 16)
    docker_default = 0xA80425FB  # CHOWN..SETFCAP, as `capsh --decode` spells Docker's set
    assert caps == docker_default
    if os.geteuid() == 0:
        assert sb.exec("cat /proc/self/uid_map").stdout.split()[:2] == ["0", "100000"]


def test_no_network(sb):
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    port = srv.getsockname()[1]
    try:
        code = textwrap.dedent(f"""
            import socket
            for addr in [("127.0.0.1", {port}), ("1.1.1.1", 53), ("10.0.0.1", 80)]:
                try:
                    socket.create_connection(addr, timeout=2); print("connected", addr)
                except OSError as e:
                    print("blocked", addr, type(e).__name__)
        """)
        r = sb.exec(["python3", "-c", code], timeout=30)
        assert r.stdout.count("blocked") == 3, r.output
        assert sb.exec("ls /sys/class/net 2>/dev/null || ip -o link | cut -d: -f2").stdout.split() in (
            [],
            ["lo"],
        )
    finally:
        srv.close()


def test_rm_rf_root_leaves_host_unchanged(cfg, tmp_path):
    sentinel = tmp_path / "keep.txt"
    sentinel.write_text("keep")
    before = sorted(os.listdir("/usr/bin"))[:50]
    with make_sandbox(cfg) as s:
        s.exec("echo 42 > /app/answer.txt")
        # The root is the agent's to wreck, as in a container; the base under it is read-only.
        s.exec("/usr/bin/rm -rf --no-preserve-root / 2>/dev/null", timeout=60)
        # (the agent's own /lib64 link is gone with the rest: its commands no longer start, as in a
        # container whose root was wiped)
        assert not s.exec(["/usr/bin/test", "-e", "/app/answer.txt"], cwd="/").ok
        tests = tmp_path / "tests"
        tests.mkdir()
        (tests / "test.sh").write_text(
            "ls /usr/bin | head -1 > /logs/verifier/out; echo 0 > /logs/verifier/reward.txt\n"
        )
        run = s.run_verifier(tests, ["/bin/bash", "/tests/test.sh"], timeout=30)
        if os.geteuid() == 0:
            # The verifier sees the agent's copy-on-write /usr, as under Docker: a removed toolchain
            # is tampering, never run.
            assert run.tampered and "/usr" in run.tampered and not run.logs, run
        else:
            # A verifier runs the base's own shell and tools whatever the agent removed from its root.
            assert run.result.ok and run.logs["reward.txt"] == b"0\n" and run.logs["out"].strip(), (
                run.result.output
            )
    assert sentinel.read_text() == "keep"
    assert sorted(os.listdir("/usr/bin"))[:50] == before


def test_root_is_writable_like_a_container(cfg, tmp_path):
    """Dockerfile-style writes anywhere: new top-level dirs, /var/log, /root/.ssh, and (as host root,
    copy-on-write) /usr and /etc; the host's files stay as they are, and those others may not read
    are not there."""
    with make_sandbox(cfg) as s:
        r = s.exec(
            "mkdir -p /config /var/log/app /root/.ssh /evidence && echo hi > /config/x && chmod 444 /config/x"
        )
        assert r.ok, r.output
        assert s.exec("echo again > /config/x && cat /config/x").stdout == "again\n"  # root over a 0444 file
        assert s.exec("cat /config/x; ls -d /var/log/app /root/.ssh /evidence").ok
        r = s.exec("touch /etc/tmax-x /usr/tmax-x")
        if os.geteuid() != 0:
            assert r.stderr.count("Read-only file system") == 2, r.stderr
            return
        assert r.ok, r.output
        hosts, deb_ver = Path("/etc/hosts").read_bytes(), Path("/etc/debian_version").read_bytes()
        deb_mode = os.stat("/etc/debian_version").st_mode
        r = s.exec(
            "echo 10.9.9.9 tmax-x >> /etc/hosts && printf '#!/bin/sh\\necho tool\\n' > /usr/local/bin/tmax-tool"
            " && chmod 0755 /usr/local/bin/tmax-tool && chmod 0444 /etc/debian_version && echo y >> /etc/debian_version"
            " && useradd -m tmaxuser && tmax-tool && stat -c '%U %a' /usr/bin /etc/hosts"
        )
        assert r.ok and r.stdout.split("\n")[:2] == ["tool", "root 755"], r.output
        # Host files others may not read are hidden (shadow files are the image's own, all locked).
        r = s.exec("cat /etc/shadow; ls /etc/ssl/private 2>&1")
        assert "No such file" in r.stdout and "\ntmaxuser:!:" in r.stdout, r.output
        assert all(line.split(":")[1] in "*!" for line in r.stdout.splitlines() if line.count(":") > 4)
        assert Path("/etc/hosts").read_bytes() == hosts and not os.path.exists("/usr/local/bin/tmax-tool")
        assert not os.path.exists("/etc/tmax-x") and Path("/etc/debian_version").read_bytes() == deb_ver
        assert os.stat("/etc/debian_version").st_mode == deb_mode
        # The verifier sees these changes, as under Docker.
        tests = tmp_path / "tests"
        tests.mkdir()
        (tests / "test.sh").write_text(
            "tmax-tool > /logs/verifier/out; grep -c tmax-x /etc/hosts >> /logs/verifier/out\n"
        )
        run = s.run_verifier(tests, ["/bin/bash", "/tests/test.sh"], timeout=30)
        assert run.tampered is None and run.logs["out"] == b"tool\n1\n", run


@pytest.mark.skipif(not cgroup_mod.available(), reason="no writable cgroup hierarchy (pids/memory/cpu) here")
def test_fork_bomb_is_contained_and_cleaned(cfg):
    s = make_sandbox(dataclasses.replace(cfg, pids_max=64))
    ns = pid_ns(s.child_pid)
    sh = s.shell()
    sh.run(":(){ :|:& };:", timeout=3)
    time.sleep(1.0)
    assert len(s.cg.pids()) <= 64
    assert len(procs_in_ns(ns)) <= 64
    t0 = time.monotonic()
    s.close()
    assert time.monotonic() - t0 < 15
    assert procs_in_ns(ns) == []
    assert not s.run_dir.exists()
    assert not any(d.exists() for d in s.cg.dirs)


@pytest.mark.skipif(not cgroup_mod.available(), reason="no writable cgroup hierarchy (memory) here")
def test_memory_limit(cfg):
    with make_sandbox(dataclasses.replace(cfg, memory_mb=64)) as s:
        r = s.exec(
            [
                "python3",
                "-c",
                "b = bytearray(300 << 20); b[::4096] = b'x' * len(b[::4096]); print('survived')",
            ]
        )
        assert "survived" not in r.stdout and r.exit_code != 0


def test_disk_limit(cfg):
    with make_sandbox(cfg) as s:  # disk_mb=64
        r = s.exec(
            "head -c 200M /dev/zero > /app/big; echo rc=$?; head -c 200M /dev/zero > /tmp/big; echo rc=$?"
        )
        assert r.stdout.count("rc=0") == 0, r.output
        assert s.exec("du -sm /app | cut -f1").stdout.strip() <= "64"


def test_episode_timeout(cfg):
    with make_sandbox(dataclasses.replace(cfg, episode_timeout_s=1.0)) as s:
        r = s.exec("sleep 10", timeout=10)
        assert r.timed_out and r.duration_s < 3
        with pytest.raises(EpisodeTimeout):
            s.exec("true")


def test_close_kills_everything_and_removes_dirs(cfg):
    s = make_sandbox(cfg)
    ns = pid_ns(s.child_pid)
    sh = s.shell()
    sh.run("setsid sleep 300 & nohup sleep 301 >/dev/null 2>&1 &")
    s.exec("setsid sleep 302 &")
    assert len(procs_in_ns(ns)) >= 4
    run_dir, stage = s.run_dir, s.stage
    s.close()
    s.close()  # idempotent
    assert procs_in_ns(ns) == []
    assert not run_dir.exists() and not stage.exists()
    assert str(stage) not in Path("/proc/self/mountinfo").read_text()  # its host mounts are gone too
    with pytest.raises(SandboxError):
        s.exec("true")


CHILD = """
import sys, time, json
from tmax_jax.sandbox import SandboxConfig, make_sandbox
sb = make_sandbox(SandboxConfig(cache_dir=sys.argv[1]))
sb.shell().run("sleep 300 &")
print(json.dumps({"child_pid": sb.child_pid, "run_dir": str(sb.run_dir), "stage": str(sb.stage), "cg": sb.cg.name if sb.cg else None}), flush=True)
if sys.argv[2] == "raise":
    sys.stdin.readline()  # the test counts the sandbox's processes first
    raise RuntimeError("boom")
time.sleep(300)
"""


@pytest.mark.parametrize("how", ["sigkill", "sigterm", "sigint", "raise"])
def test_cleanup_when_the_parent_dies(cfg, how):
    import json

    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    p = subprocess.Popen(
        [sys.executable, "-c", CHILD, cfg.cache_dir, how],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    )
    info = json.loads(p.stdout.readline())
    ns = pid_ns(info["child_pid"])
    assert ns and len(procs_in_ns(ns)) >= 2
    if how == "raise":  # raising had raced the count above: the child now waits for this line
        p.stdin.write(b"\n")
        p.stdin.flush()
    else:
        p.send_signal({"sigkill": signal.SIGKILL, "sigterm": signal.SIGTERM, "sigint": signal.SIGINT}[how])
    p.stdin.close()
    p.wait(timeout=30)
    deadline = time.monotonic() + 10
    while procs_in_ns(ns) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert procs_in_ns(ns) == []  # --die-with-parent, or our handlers
    run_dir = Path(info["run_dir"])
    if how == "sigkill":
        # nothing could clean up; the next pool start sweeps what the dead owner left
        from tmax_jax.sandbox import SandboxPool

        assert run_dir.exists()
        with SandboxPool(cfg, size=1) as pool:
            assert pool.swept >= 1
    assert not run_dir.exists()
    assert not Path(info["stage"]).exists() and info["stage"] not in Path("/proc/self/mountinfo").read_text()
    if info["cg"]:
        assert info["cg"] not in cgroup_mod.stale_groups()


def test_many_sandboxes_in_threads_do_not_leak(cfg):
    errors = []
    nss = []

    def work(i):
        try:
            with make_sandbox(cfg) as s:
                nss.append(pid_ns(s.child_pid))
                assert s.exec(f"echo {i}").stdout == f"{i}\n"
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    ts = [threading.Thread(target=work, args=(i,)) for i in range(6)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors
    assert all(procs_in_ns(ns) == [] for ns in nss)
    assert list((Path(cfg.cache_dir) / "run").iterdir()) == []


def test_config_errors():
    with pytest.raises(ConfigError, match="backend"):
        SandboxConfig(backend="docker")
    with pytest.raises(ConfigError, match="pids_max"):
        SandboxConfig(pids_max=0)
    with pytest.raises(ConfigError, match="writable_paths"):
        SandboxConfig(writable_paths=("/usr",))
    with pytest.raises(SandboxError, match="rootfs"):
        make_sandbox(SandboxConfig(rootfs="no-such-image:1"))


def test_runner_file_transfers_ignore_tools_the_agent_planted(cfg):
    """A fake ``tar`` first on the image's PATH (a writable dir) must not feed the runner's transfers."""
    from tmax_jax.sandbox.base import BASE_PATH
    from tmax_jax.sandbox.bwrap import BwrapImage

    image = BwrapImage(env={"PATH": "/app/bin:" + BASE_PATH})
    with make_sandbox(cfg, image=image) as sb:
        sb.exec(
            "mkdir -p /app/bin; printf '#!/bin/sh\\necho not-a-tar\\n' > /app/bin/tar; chmod +x /app/bin/tar"
        )
        assert sb.exec("tar --version").stdout.strip() == "not-a-tar"  # the agent's own PATH sees it
        sb.write_file("/app/data.txt", "payload\n")
        assert sb.read_file("/app/data.txt") == b"payload\n"
        sb.exec("rm /app/bin/tar; printf '#!/bin/sh\\nexit 0\\n' > /tmp/x; ln -s /tmp/x /app/bin/tar")
        with pytest.raises(SandboxError):  # the agent broke the file itself: an error, never a crash
            sb.exec("rm /app/data.txt; mkfifo /app/data.txt")
            sb.read_file("/app/data.txt", timeout=5)


def test_link_checks_see_the_top_level_links_the_verifier_root_was_built_with(sb, tmp_path):
    """bwrap's verifier root remakes the agent's top-level links as they are when it is planned. A
    link removed right after (a process of the agent's seeing the state listed) must still be
    checked with the target the verifier will have, not found missing in the agent's state."""
    sb.exec(["bash", "-c", "ln -s /tests /t && ln -s /t/expected.txt /app/answer.txt"])
    assert sb._link_scan() is not None  # both present: found
    vdir = tmp_path / "v"
    vdir.mkdir()
    args, fds, _ = sb._verifier_tree(vdir / "tests", vdir / "logs", vdir / "links")
    for fd in fds:
        os.close(fd)
    assert "/t" in args and os.readlink(vdir / "links" / "t") == "/tests"
    sb.exec(["rm", "/t"])
    assert sb._link_scan() is None  # the agent's state alone no longer shows it...
    reason = sb._link_scan(vdir / "links")  # ...the verifier's root does
    assert reason is not None and "(/tests)" in reason, reason
