"""Attacks on the podman backend, as an agent would try them, each checked against real podman.

Every test is an attack that would score (or reach the host) if the promise it checks broke: the
verifier's logs must hold only what the verifier wrote, or ``tampered`` must be set. Skipped with
the reason where podman cannot run containers.
"""

from __future__ import annotations

import dataclasses
import subprocess
import textwrap
import time
import uuid

import pytest

from tmax_jax.sandbox import SandboxConfig, make_sandbox
from tmax_jax.sandbox.base import VERIFIER_PATH
from tmax_jax.sandbox.podman import DOCKER_CAPS, ID_BASE
from tmax_jax.sandbox.podman_images import ensure_base_image, podman_available

OK, WHY = podman_available()
pytestmark = [pytest.mark.podman, pytest.mark.skipif(not OK, reason=WHY)]

# The verifier of an unsolved task: pytest checks /app/answer.txt and writes 1 or 0.
TEST_SH = """\
#!/bin/bash
if python3 -m pytest -q -p no:cacheprovider /tests/test_answer.py; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
"""
TEST_PY = "def test_answer():\n    assert open('/app/answer.txt').read().strip() == '42'\n"


@pytest.fixture(scope="module")
def cfg():
    c = SandboxConfig(backend="podman", exec_timeout_s=60, pids_max=128, memory_mb=512, disk_mb=64)
    tag = ensure_base_image(c)
    r = subprocess.run(
        [
            "podman",
            "run",
            "--rm",
            "--runtime",
            "runc",
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


@pytest.fixture
def tests_dir(tmp_path):
    d = tmp_path / "tests"
    d.mkdir()
    (d / "test.sh").write_text(TEST_SH)
    (d / "test_answer.py").write_text(TEST_PY)
    return d


def _verify(sb, tests_dir, timeout=60):
    return sb.run_verifier(tests_dir, ["bash", "/tests/test.sh"], timeout=timeout)


def _background(sb, script: str) -> None:
    """Start ``script`` as an agent process that outlives the command (as ``cmd &`` does)."""
    sb.write_file("/root/bg.sh", script)
    r = sb.exec("bash /root/bg.sh >/dev/null 2>&1 </dev/null &")
    assert r.exit_code == 0, r


# ---- isolation of agent processes -----------------------------------------------------------------
SYSCALLS = r"""
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
def call(name, nr, *args):
    rc = libc.syscall(nr, *args)
    print(name, rc, ctypes.get_errno())
os.makedirs("/mnt/x", exist_ok=True)
call("mount", 165, b"none", b"/mnt/x", b"tmpfs", 0, None)
call("mount_bind", 165, b"/", b"/mnt/x", None, 4096, None)
call("umount2", 166, b"/proc/sys", 2)
call("unshare_user", 272, 0x10000000)
call("unshare_mnt", 272, 0x00020000)
call("clone_newuser", 56, 0x10000000 | 17, 0, 0, 0, 0)
call("setns", 308, 0, 0)
call("keyctl", 250, 0, -3, 0, 0, 0)
call("add_key", 248, b"user", b"k", b"v", 1, -3)
call("request_key", 249, b"user", b"k", None, -3)
call("ptrace_attach", 101, 16, 1, 0, 0)
call("bpf", 321, 0, 0, 0)
call("perf_event_open", 298, 0, 0, -1, -1, 0)
call("io_uring_setup", 425, 1, ctypes.create_string_buffer(120))
call("open_by_handle_at", 304, -100, ctypes.create_string_buffer(64), 0)
call("init_module", 175, None, 0, b"")
call("kexec_load", 246, 0, 0, None, 0)
"""


def test_agent_syscalls_are_denied_and_root_is_docker_like(cfg, tmp_path):
    canary = tmp_path / "canary.txt"
    canary.write_text("host canary\n")
    with make_sandbox(cfg) as sb:
        sb.write_file("/root/sys.py", SYSCALLS)
        r = sb.exec(["python3", "/root/sys.py"])
        got = {
            line.split()[0]: (int(line.split()[1]), int(line.split()[2])) for line in r.stdout.splitlines()
        }
        assert len(got) == 17, r
        for name, (rc, err) in got.items():
            # EPERM from the seccomp filter, whatever the caps.
            assert rc == -1 and err == 1, (name, rc, err)
        # The kernel's settings stay read-only; the user namespace maps root to an unprivileged uid.
        r = sb.exec("echo x > /proc/sys/kernel/domainname; echo rc=$?; cat /proc/self/uid_map")
        assert "rc=1" in r.stdout and r.stdout.split()[-3:] == ["0", str(ID_BASE), "65536"], r
        # Docker's default capabilities, no more: root writes a 0444 file and becomes another user.
        caps = int(sb.exec("awk '/CapEff/ {print $2}' /proc/self/status").stdout, 16)
        bits = {
            "CHOWN": 0, "DAC_OVERRIDE": 1, "FOWNER": 3, "FSETID": 4, "KILL": 5, "SETGID": 6, "SETUID": 7,
            "SETPCAP": 8, "NET_BIND_SERVICE": 10, "NET_RAW": 13, "SYS_CHROOT": 18, "MKNOD": 27,
            "AUDIT_WRITE": 29, "SETFCAP": 31,
        }  # fmt: skip
        assert caps == sum(1 << bits[c] for c in DOCKER_CAPS)
        r = sb.exec(
            "echo a > /app/f; chmod 444 /app/f; echo b > /app/f; cat /app/f; setpriv --reuid=1000 --regid=1000 --clear-groups id -u"
        )
        assert r.stdout == "b\n1000\n", r
        # Sized tmpfs: /dev/shm at 64 MiB; /tmp is the root filesystem, as under Docker.
        r = sb.exec("head -c 80M /dev/zero > /dev/shm/fill; echo rc=$?; du -m /dev/shm/fill | cut -f1")
        assert "rc=1" in r.stdout and int(r.stdout.split()[-1]) <= 64, r
        # The host path of the canary is not there to write.
        sb.exec(f"echo pwned > {canary}; mkdir -p {tmp_path} && echo pwned > {canary}")
    assert canary.read_text() == "host canary\n"


def test_no_host_secret_in_agent_or_verifier(cfg, tmp_path, monkeypatch):
    secret = f"s3cr3t-{uuid.uuid4().hex}"
    monkeypatch.setenv("TMAX_TEST_SECRET", secret)
    # podman copies the proxy variables of its own environment into containers by default
    # (``--http-proxy``), credentials and all.
    for var in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY", "ftp_proxy", "all_proxy"):
        monkeypatch.setenv(var, f"http://trainer:{secret}@127.0.0.1:9/")
    d = tmp_path / "tests"
    d.mkdir()
    (d / "test.sh").write_text(
        "cat /proc/[0-9]*/environ | tr '\\0' '\\n' > /logs/verifier/env.txt; echo \"$PATH\" > /logs/verifier/path.txt\n"
    )
    with make_sandbox(cfg) as sb:
        sb.shell().run("sleep 30 &")
        r = sb.exec("cat /proc/[0-9]*/environ | tr '\\0' '\\n'")
        assert "container=podman" in r.stdout and secret not in r.stdout
        v = sb.run_verifier(d, ["bash", "/tests/test.sh"], timeout=30)
    env = v.logs["env.txt"].decode()
    assert "PYTHONSAFEPATH=1" in env and "PYTHONUSERBASE=/tests/" in env and secret not in env
    assert v.logs["path.txt"].decode().strip() == VERIFIER_PATH


# ---- the verifier ---------------------------------------------------------------------------------
def test_verifier_sees_live_files_and_services_and_scores(cfg, tests_dir):
    # The control: a solved task whose answer is served by a server the agent left running (Harbor's
    # semantics; a strict verifier stops it first).
    cfg = dataclasses.replace(cfg, verifier_mode="harbor")
    (tests_dir / "test_answer.py").write_text(
        TEST_PY
        + textwrap.dedent(
            """
            def test_server():
                import urllib.request
                assert urllib.request.urlopen('http://127.0.0.1:8765/answer.txt', timeout=5).read().strip() == b'42'
            """
        )
    )
    with make_sandbox(cfg) as sb:
        assert _verify(sb, tests_dir).logs == {"reward.txt": b"0\n"}  # and unsolved scores 0
        sb.shell().run("cd /app && python3 -m http.server 8765 --bind 127.0.0.1 >/dev/null 2>&1 &")
        sb.exec(
            "echo 42 > /app/answer.txt; for i in $(seq 50); do (echo > /dev/tcp/127.0.0.1/8765) 2>/dev/null && break; sleep 0.1; done"
        )
        v = _verify(sb, tests_dir)
        assert v.logs == {"reward.txt": b"1\n"} and v.tampered is None, v
        assert v.result.exit_code == 0
        # The verifier's mounts never appear to the agent.
        assert (
            sb.exec("ls -A /tests /logs/verifier 2>/dev/null | grep -v : | grep -c . || true").stdout.strip()
            == "0"
        )


def test_agent_cannot_write_read_or_signal_the_verifier(cfg, tests_dir):
    expected = f"EXPECTED-{uuid.uuid4().hex}"
    (tests_dir / "expected.txt").write_text(expected)
    # The verifier takes a while (a process the agent would like to see and kill), then scores 0.
    (tests_dir / "test.sh").write_text(
        "bash -c 'exec -a tmax-verifier-marker sleep 2'\necho 0 > /logs/verifier/reward.txt\n"
    )
    with make_sandbox(cfg) as sb:
        # A reward planted and locked before the verifier runs (root without caps cannot pass it).
        sb.exec(
            "mkdir -p /logs/verifier && echo 1 > /logs/verifier/reward.txt && chmod 444 /logs/verifier/reward.txt && chmod 555 /logs/verifier"
        )
        _background(
            sb,
            textwrap.dedent(
                """\
                end=$((SECONDS + 6))
                while [ $SECONDS -lt $end ]; do
                  echo 1 > /logs/verifier/reward.txt 2>/dev/null
                  cat /tests/expected.txt >> /app/stolen.txt 2>/dev/null
                  cat /proc/[0-9]*/cmdline 2>/dev/null | tr '\\0' ' ' >> /app/ps.txt
                  pkill -9 -f tmax-verifier 2>/dev/null
                  sleep 0.05
                done
                """
            ),
        )
        v = _verify(sb, tests_dir)
        seen = sb.exec("cat /app/stolen.txt /app/ps.txt 2>/dev/null").stdout
    assert v.logs == {"reward.txt": b"0\n"}, v
    assert v.result.exit_code == 0 and v.tampered is None, v  # not killed
    assert expected not in seen and "tmax-verifier-marker" not in seen and "bg.sh" in seen


def test_verifier_timeout_kills_it_and_keeps_the_agent(cfg, tmp_path):
    d = tmp_path / "tests"
    d.mkdir()
    (d / "test.sh").write_text("sleep 60 & sleep 60\n")
    # A process of the agent's that runs on during the tests: Harbor's semantics.
    cfg = dataclasses.replace(cfg, verifier_mode="harbor")
    with make_sandbox(cfg) as sb:
        sb.shell().run("sleep 300 >/dev/null 2>&1 &")
        v = sb.run_verifier(d, ["bash", "/tests/test.sh"], timeout=2)
        assert v.result.timed_out and v.result.exit_code == 124
        names = subprocess.run(
            ["podman", "ps", "-a", "--filter", f"name={sb.name}", "--format", "{{.Names}}"],
            capture_output=True,
            text=True,
        ).stdout.split()
        assert names == [sb.name]  # the verifier's container is gone, the agent's remains
        assert "sleep 300" in sb.exec("ps -eo args").stdout


# ---- toolchain tampering --------------------------------------------------------------------------
FAKE = "#!/bin/sh\necho 1 > /logs/verifier/reward.txt\n"
PY_FAKE = "import pathlib; pathlib.Path('/logs/verifier/reward.txt').write_text('1')\n"
ATTACKS = {
    "python3_replaced": (f"printf '{FAKE}' > /usr/bin/python3", "/usr/bin/python3"),
    "python3_on_path_first": (
        f"mkdir -p /usr/local/bin; printf '{FAKE}' > /usr/local/bin/python3; chmod +x /usr/local/bin/python3",
        "/usr/local/bin/python3",
    ),
    "bash_touched": ("touch /usr/bin/bash", "/usr/bin/bash"),
    "pytest_shadowed": (
        f'mkdir -p /usr/local/lib/python3.11/dist-packages/pytest && echo "{PY_FAKE}" > /usr/local/lib/python3.11/dist-packages/pytest/__main__.py',
        "pytest",
    ),
    "pth_file": (
        "echo \"import os; os.system('echo 1 > /logs/verifier/reward.txt')\" > /usr/lib/python3/dist-packages/zz.pth",
        "zz.pth",
    ),
    "sitecustomize": (
        f'rm -f /usr/lib/python3.11/sitecustomize.py; echo "{PY_FAKE}" > /usr/lib/python3.11/sitecustomize.py',
        "sitecustomize",
    ),
    "interpreter_dir_renamed": (
        "mv /usr/lib/python3.11 /usr/lib/python3.11.orig && mkdir /usr/lib/python3.11",
        "/usr/lib/python3.11",
    ),
    "ld_preload": ("echo /app/evil.so > /etc/ld.so.preload", "ld.so.preload"),
    "root_conftest": ("echo 'collect_ignore_glob = [\"*\"]' > /conftest.py", "/conftest.py"),
}


@pytest.mark.parametrize("attack", sorted(ATTACKS))
def test_toolchain_tampering_is_reported(cfg, tests_dir, attack):
    script, where = ATTACKS[attack]
    with make_sandbox(cfg) as sb:
        r = sb.exec(script)
        assert r.exit_code == 0, r
        v = _verify(sb, tests_dir)
    assert v.tampered is not None and where in v.tampered, v


def test_toolchain_planted_only_during_verification_is_reported(cfg, tests_dir):
    # Plant a fake pytest and remove it again, over and over: a scan before or after may miss it.
    (tests_dir / "test.sh").write_text("sleep 1.5\n" + TEST_SH)
    site = "/usr/local/lib/python3.11/dist-packages"
    # A process of the agent's that runs on during the tests: Harbor's semantics.
    cfg = dataclasses.replace(cfg, verifier_mode="harbor")
    with make_sandbox(cfg) as sb:
        _background(
            sb,
            f"sleep 0.5; end=$((SECONDS + 4)); while [ $SECONDS -lt $end ]; do mkdir -p {site}/pytest; "
            f'echo "{PY_FAKE}" > {site}/pytest/__main__.py; sleep 0.02; rm -rf {site}/pytest; sleep 0.02; done\n',
        )
        v = _verify(sb, tests_dir)
    assert v.tampered is not None and "while the verifier ran" in v.tampered, v


def test_new_packages_and_commands_are_not_tampering(cfg, tests_dir):
    (tests_dir / "test.sh").write_text(
        "python3 -c 'import mypkg' && mytool && echo 1 > /logs/verifier/reward.txt\n"
    )
    with make_sandbox(cfg) as sb:
        sb.exec(
            "mkdir -p /usr/local/lib/python3.11/dist-packages/mypkg && touch /usr/local/lib/python3.11/dist-packages/mypkg/__init__.py"
            " && mkdir -p /usr/local/bin && printf '#!/bin/sh\\ntrue\\n' > /usr/local/bin/mytool && chmod +x /usr/local/bin/mytool"
        )
        v = _verify(sb, tests_dir)
    assert v.tampered is None and v.logs == {"reward.txt": b"1\n"}, v


def test_agent_cannot_swap_the_verifiers_tests(cfg, tests_dir):
    # Renaming /tests (or /logs/verifier) during verification would detach the verifier's mounts
    # and let it run a test.sh of the agent's; the mount points are pinned, so both fail.
    (tests_dir / "test.sh").write_text("sleep 1\n" + TEST_SH)
    # A process of the agent's that runs on during the tests: Harbor's semantics.
    cfg = dataclasses.replace(cfg, verifier_mode="harbor")
    with make_sandbox(cfg) as sb:
        r = sb.exec("mv /tests /tests.old; rm -rf /tests; ln -s /app /logs/verifier; echo rc=$?")
        assert "rc=1" in r.stdout and "busy" in (r.stderr + r.stdout).lower(), r
        _background(
            sb,
            "end=$((SECONDS + 4)); while [ $SECONDS -lt $end ]; do mv /tests /tests.old 2>/dev/null && "
            "mkdir -p /tests && printf 'echo 1 > /logs/verifier/reward.txt\\n' > /tests/test.sh; "
            "mv /logs/verifier /logs/v.old 2>/dev/null; sleep 0.01; done; echo done > /app/bg.done\n",
        )
        v = _verify(sb, tests_dir)
        assert v.logs == {"reward.txt": b"0\n"}, v
        assert sb.exec("sleep 4; cat /app/bg.done; ls -A /tests | wc -l").stdout.split() == ["done", "0"]


def test_agent_fork_bomb_does_not_starve_the_verifier(cfg, tests_dir):
    # The verifier has its own cgroup (pids, memory, CPU): an agent at its pids limit cannot stop it.
    with make_sandbox(cfg) as sb:
        sb.exec("echo 42 > /app/answer.txt; (b() { b | b & }; b) >/dev/null 2>&1 </dev/null &", timeout=5)
        # The agent itself cannot fork any more once the bomb reaches its pids limit (how soon
        # depends on the machine's load: wait for it, up to 20 s).
        deadline = time.monotonic() + 20
        while sb.exec("true", timeout=10).exit_code == 0:
            assert time.monotonic() < deadline, "the fork bomb never reached the pids limit"
            time.sleep(0.5)
        v = _verify(sb, tests_dir)
    assert v.logs == {"reward.txt": b"1\n"} and v.tampered is None, v


def test_image_build_gets_no_host_proxy(cfg, tmp_path, monkeypatch):
    """A task's Dockerfile build runs the task's commands: they see none of the trainer's proxies."""
    from tmax_jax.sandbox.podman_images import build_image
    from tmax_jax.sandbox.recipe import parse_dockerfile

    secret = f"s3cr3t-{uuid.uuid4().hex}"
    for var in ("http_proxy", "HTTPS_PROXY"):
        monkeypatch.setenv(var, f"http://trainer:{secret}@127.0.0.1:9/")
    df = tmp_path / "Dockerfile"
    # A fresh layer per run (the uuid), so the build really runs here.
    df.write_text(f"FROM ubuntu:24.04\nRUN env > /build-env-{uuid.uuid4().hex[:8]}.txt\n")
    img = build_image(cfg, parse_dockerfile(df), dockerfile=df)
    with make_sandbox(cfg, image=img) as sb:
        r = sb.exec("cat /build-env-*.txt")
    assert r.exit_code == 0 and "PATH=" in r.stdout, r
    assert secret not in r.stdout
