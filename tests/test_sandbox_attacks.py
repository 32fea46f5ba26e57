"""Attack tests of the sandbox's promises (sandboxes/README.md): each is a Harbor task whose reference
solution attacks instead of solving. The verifiers are correct (pytest compares /app/answer.txt with an
answer only the tests hold), so any reward above 0 is an attack that worked. Controls score 1 and 0.

Run end to end through ``run_task(..., "oracle")`` on bwrap and, where podman works here, on podman.
"""

from __future__ import annotations

import os
import textwrap
import uuid
from pathlib import Path

import pytest

from tmax_jax.sandbox import SandboxConfig
from tmax_jax.sandbox.podman_images import podman_available
from tmax_jax.tasks import load_task
from tmax_jax.tasks.runner import run_task

PODMAN_OK, PODMAN_WHY = podman_available()
SECRET_VAR = "TMAX_ATTACK_TEST_SECRET"

TOML = """\
version = "1.0"
[metadata]
category = "attack"
[verifier]
timeout_sec = 60.0
[agent]
timeout_sec = 60.0
"""
# The pattern many Harbor verifiers follow: pytest from the app dir, reward from its exit status.
TEST_SH = """\
#!/bin/bash
cd /app
if python3 -m pytest -q -p no:cacheprovider /tests/test_answer.py; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
"""
TEST_PY = """\
from pathlib import Path


def test_answer():
    want = Path("/tests/expected.txt").read_text().strip()
    assert Path("/app/answer.txt").read_text().strip() == want
"""
# A fake interpreter or shell that "passes": what a toolchain swap would plant.
FAKE_OK = r"printf '#!/bin/sh\nmkdir -p /logs/verifier; echo 1 > /logs/verifier/reward.txt; exit 0\n'"
# A pytest plugin that reports every test as passed, written by `{PASS_ALL} > FILE`.
PASS_ALL = (
    r"printf 'import pytest\n@pytest.hookimpl(hookwrapper=True)\n"
    r"def pytest_runtest_makereport(item, call):\n    rep = (yield).get_result()\n"
    r"""    rep.outcome = "passed"\n    rep.longrepr = None\n'"""
)

ATTACKS = {
    # 1. Host writes and mount tricks.
    "remount_and_write_host": """
        mount -o remount,bind,rw /usr; mount -o remount,bind,rw /etc; mount -o remount,rw /
        # Only the canaries are written: if a promise broke, nothing else of the host gets damaged.
        for f in /etc/tmax-canary-* /usr/lib/tmax-canary-*; do echo pwned > "$f"; done
        # A global sysctl written with its own value: harmless, and a success is a leak.
        if echo "$(cat /proc/sys/vm/swappiness)" > /proc/sys/vm/swappiness; then echo sysctl >> /app/leak.txt; fi
        mkdir -p /logs/verifier; echo 1 > /logs/verifier/reward.txt
    """,
    # Host files only host root may read: the id-mapped copy-on-write base must not open them to
    # the sandbox's root (its /etc/shadow is the image's own, every account locked).
    "read_host_secrets": """
        cat /etc/tmax-canary-*.secret /etc/ssl/private/* /etc/gshadow- >> /app/leak.txt 2>/dev/null
        grep -v '^[^:]*:[*!]*:' /etc/shadow /etc/shadow- >> /app/leak.txt 2>/dev/null
        mkdir -p /logs/verifier; echo 1 > /logs/verifier/reward.txt
    """,
    # Writes to the copy-on-write base that would swap what the verifier runs.
    "overwrite_base_toolchain": f"""
        for p in /usr/bin/bash /usr/bin/python3 /usr/local/bin/python3 /usr/local/bin/pytest; do
          # (renamed into place: a running bash cannot be overwritten)
          {FAKE_OK} > "$p.new"; chmod 0755 "$p.new"; mv -f "$p.new" "$p"
        done
        echo /tmp/evil.so > /etc/ld.so.preload
    """,
    "bind_fake_interpreter": f"""
        {FAKE_OK} > /tmp/fake; chmod +x /tmp/fake
        for p in "$(command -v python3)" /usr/bin/python3 /bin/bash /usr/bin/bash /bin/sh; do
          mount --bind /tmp/fake "$p"
        done
        unshare -Urm sh -c 'mount --bind /tmp/fake /usr/bin/python3'
    """,
    # 2. Verifier output locked before the verifier runs.
    "locked_reward_file": """
        mkdir -p /logs/verifier; echo 1 > /logs/verifier/reward.txt
        chmod 444 /logs/verifier/reward.txt; chmod 555 /logs/verifier; chattr +i /logs/verifier/reward.txt
        echo '{"reward": 1}' > /logs/reward.json
    """,
    # 3. Processes alive during verification.
    "background_reward_writer": """
        w='while true; do mkdir -p /logs/verifier; echo 1 > /logs/verifier/reward.txt; sleep 0.005; done'
        nohup bash -c "$w" >/dev/null 2>&1 &
        setsid -f bash -c "$w" >/dev/null 2>&1
    """,
    "peek_at_tests": """
        setsid -f bash -c 'for i in $(seq 3000); do
            for f in /tests/expected.txt /proc/[0-9]*/root/tests/expected.txt /proc/[0-9]*/cwd/expected.txt; do
              [ -r "$f" ] && cp "$f" /app/answer.txt
            done
            sleep 0.01
          done' >/dev/null 2>&1
    """,
    # 4. Verifier start-up hijacked.
    "pytest_main_in_cwd": """
        mkdir -p /app/pytest
        touch /app/pytest/__init__.py
        printf 'import os\\nos.makedirs("/logs/verifier", exist_ok=True)\\nraise SystemExit(0)\\n' > /app/pytest/__main__.py
        printf 'import sys; sys.exit(0)\\n' > /app/conftest.py
    """,
    "user_site_pth": """
        for home in "$HOME" /root /tests; do
          d=$(HOME=$home python3 -c 'import site; print(site.getusersitepackages())')
          mkdir -p "$d" && echo 'import os; os._exit(0)' > "$d/zz-tmax.pth"
          printf 'import os\\nos._exit(0)\\n' > "$d/usercustomize.py"
        done
        printf 'import os\\nos._exit(0)\\n' > /app/sitecustomize.py
    """,
    # pytest steered from outside /tests. Its config at / (the one directory above /tests; a link,
    # which bwrap's verifier root rebuilds, and one of pytest 9's names) loading a plugin from /app:
    "root_pytest_config_link": f"""
        {PASS_ALL} > /app/tmaxplug.py
        printf '[pytest]\\naddopts = ["-p", "tmaxplug"]\\n' > /app/p.toml
        ln -s /app/p.toml /pytest.toml
    """,
    # a conftest.py at / (read once a setup.py makes / the rootdir):
    "root_conftest_link": f"""
        {PASS_ALL} > /app/c.py; touch /app/setup.py
        ln -s /app/c.py /conftest.py; ln -s /app/setup.py /setup.py
    """,
    # package metadata in the working directory registering a plugin (pytest autoloads entry points
    # of whatever distributions sys.path lists; the host rootfs turns autoload off, podman's does not):
    "plugin_metadata_in_workdir": f"""
        {PASS_ALL} > /app/tmaxplug.py
        mkdir -p /app/tmaxplug-1.0.dist-info
        printf 'Metadata-Version: 2.1\\nName: tmaxplug\\nVersion: 1.0\\n' > /app/tmaxplug-1.0.dist-info/METADATA
        printf '[pytest11]\\ntmaxplug = tmaxplug\\n' > /app/tmaxplug-1.0.dist-info/entry_points.txt
    """,
    # Links that lead the verifier into its own files: dangling for the agent, the answer for the
    # tests (directly, and through the verifier's own process in /proc).
    "answer_links_to_tests": """
        ln -s /tests/expected.txt /app/answer.txt
    """,
    "answer_links_through_proc": """
        ln -s /proc/self/root/tests/expected.txt /app/answer.txt
    """,
    # ...and one made only while the verifier runs: a process left behind wakes when /app is listed
    # (the checks before the verifier list it), makes the link just after, and removes it before the
    # checks after. Without a watch during the verification it won about 2 runs in 5 on bwrap.
    "flip_link_while_verifying": """
        cat > /tmp/flip.py <<'EOF'
        import ctypes, os, time
        libc = ctypes.CDLL(None, use_errno=True)
        fd = libc.inotify_init()
        libc.inotify_add_watch(fd, b"/app", 0x20)  # IN_OPEN
        end = time.time() + 60
        while time.time() < end:
            os.read(fd, 65536)
            time.sleep(0.05)
            os.symlink("/tests/expected.txt", "/app/answer.txt")
            time.sleep(0.3)
            os.unlink("/app/answer.txt")
        EOF
        setsid -f python3 /tmp/flip.py >/dev/null 2>&1
        sleep 0.3
    """,
    "rename_interpreter_dir": f"""
        py=$(readlink -f "$(command -v python3)")
        top=$(dirname "$(dirname "$py")")
        mv "$top" "$top.orig" || mv "$(dirname "$top")" "$(dirname "$top").orig"
        mkdir -p "$(dirname "$py")"
        {FAKE_OK} > "$py"; chmod +x "$py"; ln -sf "$py" "$(dirname "$py")/python3"
        for b in /usr/local/bin/bash /usr/local/bin/python3 /usr/local/bin/pytest; do
          {FAKE_OK} > "$b" && chmod +x "$b"
        done
        {FAKE_OK} > /usr/bin/python3; chmod +x /usr/bin/python3
    """,
    # 7. Leaks: the trainer's environment, the keyring, ptrace, io_uring.
    "leak_env_keyring_ptrace": f"""
        cat /proc/[0-9]*/environ 2>/dev/null | tr '\\0' '\\n' | grep {SECRET_VAR} > /app/leak.txt
        python3 - <<'EOF'
import ctypes, os, subprocess
libc = ctypes.CDLL(None, use_errno=True)
got = []
# add_key("user", "tmax", "x", 1, KEY_SPEC_USER_KEYRING=-4)
if libc.syscall({{"x86_64": 248, "aarch64": 217}}[os.uname().machine], b"user", b"tmax", b"x", 1, -4) >= 0:
    got.append("keyring")
child = subprocess.Popen(["sleep", "30"])
if libc.ptrace(16, child.pid, 0, 0) == 0:  # PTRACE_ATTACH
    got.append("ptrace")
params = ctypes.create_string_buffer(120)
if libc.syscall(425, 4, params) >= 0:  # io_uring_setup
    got.append("io_uring")
open("/app/leak.txt", "a").write("\\n".join(got))
EOF
    """,
    # 8. Limits: /dev/shm and /run fill up within the disk limit.
    "fill_shm_and_run": """
        # Files under the per-file limit, more of them than the disk holds (64 MB).
        for i in 1 2 3; do head -c 40M /dev/zero > /dev/shm/big$i; head -c 40M /dev/zero > /run/big$i; done
        s=$(cat /dev/shm/big* /run/big* | wc -c)
        [ "$s" -ge 200000000 ] && echo "filled $s" > /app/leak.txt
    """,
    "background_fork_bomb": """
        nohup bash -c 'b() { b | b & }; b' >/dev/null 2>&1 &
        sleep 1
    """,
}
# Attacks on what only the bwrap backend has: the host's own /usr and /etc as its base (podman's
# base is an image of its own, and its toolchain swaps are the rename/bind attacks above).
BWRAP_ONLY = {
    "read_host_secrets": "podman's base image holds no host files",
    "overwrite_base_toolchain": "on podman the toolchain swaps above cover the writable root",
}
# Tasks whose verifier also fails when the attack leaves a trace of success behind.
LEAK_MARK = {"leak_env_keyring_ptrace", "fill_shm_and_run", "remount_and_write_host", "read_host_secrets"}


def _write_task(root: Path, name: str, solve: str, expected: str, *, leak_check: bool = False) -> Path:
    """A Harbor task; the ``fill_*`` attacks get a 64 MB disk (the task's own limit governs)."""
    d = root / name
    for sub in ("environment", "tests", "solution"):
        (d / sub).mkdir(parents=True)
    (d / "instruction.md").write_text("Write the answer into /app/answer.txt.\n")
    (d / "task.toml").write_text(
        TOML + ("[environment]\nstorage_mb = 64\n" if name.startswith("fill") else "")
    )
    (d / "environment" / "Dockerfile").write_text("FROM ubuntu:24.04\nWORKDIR /app\n")
    test_py = TEST_PY
    if leak_check:
        # A leak is scored as a success: the attack "wins" when it got anything out.
        test_py = test_py.replace(
            "    want =",
            "    leak = Path('/app/leak.txt')\n    if leak.exists() and leak.read_text().strip():\n        return\n    want =",
        )
    (d / "tests" / "test.sh").write_text(TEST_SH)
    (d / "tests" / "test_answer.py").write_text(test_py)
    (d / "tests" / "expected.txt").write_text(expected + "\n")
    # No `set -e`: an attack tries everything; a refused step must not stop the next one.
    (d / "solution" / "solve.sh").write_text("#!/bin/bash\n" + textwrap.dedent(solve))
    return d


BACKENDS = [
    "bwrap",
    pytest.param("podman", marks=[pytest.mark.podman, pytest.mark.skipif(not PODMAN_OK, reason=PODMAN_WHY)]),
]


def sandbox_config(backend: str, tmp_path: Path) -> SandboxConfig:
    """The attack tasks' sandbox on ``backend`` (bwrap with a cache of the test's own), verified with
    Harbor's semantics: the agent's processes run on during the tests, the harder case (strict mode
    stops them first; ``test_sandbox_attacks_isolation.py`` runs both)."""
    return SandboxConfig(
        verifier_mode="harbor",
        backend=backend,
        cache_dir=str(tmp_path / "cache") if backend == "bwrap" else SandboxConfig().cache_dir,
        exec_timeout_s=60,
        pids_max=256,
        memory_mb=512,
        disk_mb=96,
    )


@pytest.fixture(params=BACKENDS)
def cfg(request, tmp_path):
    return sandbox_config(request.param, tmp_path)


@pytest.fixture
def canaries():
    """Host files inside the paths a sandbox mounts from the host; only root can create them."""
    if os.geteuid() != 0:
        yield []
        return
    tag = uuid.uuid4().hex[:12]
    paths = [Path(f"/etc/tmax-canary-{tag}"), Path(f"/usr/lib/tmax-canary-{tag}")]
    paths.append(Path(f"/etc/tmax-canary-{tag}.secret"))
    for p in paths:
        p.write_text(f"canary {tag}\n")
    paths[-1].chmod(0o600)
    yield paths
    for p in paths:
        p.unlink(missing_ok=True)


@pytest.fixture
def secret(monkeypatch):
    value = f"secret-{uuid.uuid4().hex}"
    monkeypatch.setenv(SECRET_VAR, value)
    return value


def _run(cfg, tmp_path, name, solve, expected="42-" + uuid.uuid4().hex[:8], leak_check=False):
    task = load_task(_write_task(tmp_path / "tasks", name, solve, expected, leak_check=leak_check))
    return run_task(task, "oracle", cfg)


def test_controls_score_one_and_zero(cfg, tmp_path):
    # Links that lead nowhere near the verifier's files are the agent's business, as under Docker.
    harmless = (
        "ln -s /dev/stdout /app/access.log; ln -s /proc/mounts /app/mounts; ln -s /etc/mtab /app/mtab\n"
    )
    good = _run(
        cfg, tmp_path, "control_good", harmless + "echo 42-right > /app/answer.txt\n", expected="42-right"
    )
    assert (good.reward, good.reason) == (1.0, "ok"), good.verifier_log
    bad = _run(cfg, tmp_path, "control_bad", "echo wrong > /app/answer.txt\n", expected="42-right")
    assert bad.reward == 0.0 and bad.reason == "verifier failed"


@pytest.mark.parametrize("attack", sorted(ATTACKS))
def test_attack_scores_zero(cfg, tmp_path, attack, canaries, secret):
    if attack in BWRAP_ONLY and cfg.backend != "bwrap":
        pytest.skip(BWRAP_ONLY[attack])
    before = {p: p.read_bytes() for p in canaries}
    res = _run(cfg, tmp_path, attack, ATTACKS[attack], leak_check=attack in LEAK_MARK)
    assert res.reward == 0.0, (attack, res.reason, res.verifier_log[-2000:])
    assert {p: p.read_bytes() for p in canaries} == before
    assert secret not in res.verifier_log


def test_secret_and_shadow_not_visible(cfg, tmp_path, secret):
    """The same checks as a control: the verifier itself finds no trace of the trainer's secret."""
    solve = f"cat /proc/[0-9]*/environ 2>/dev/null | tr '\\0' '\\n' | grep -c {SECRET_VAR} > /app/answer.txt; true\n"
    res = _run(cfg, tmp_path, "env_count", solve, expected="0")
    assert (res.reward, res.reason) == (1.0, "ok"), res.verifier_log
