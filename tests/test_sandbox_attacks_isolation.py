"""Attack tests of what the verifier shares with the agent's processes (sandboxes/README.md): its
scratch space, its network, the host paths its mounts come from, and the host disk its own files sit
on. Each is a Harbor task whose reference solution attacks (mostly through a process it leaves
running) and whose tests, correct on their own, would score 1 if the attack worked, or leave files on
the host. Run end to end through ``run_task(..., "oracle")`` as ``test_sandbox_attacks.py`` does.
"""

from __future__ import annotations

import dataclasses
import os
import uuid
from pathlib import Path

import pytest
from sandbox_helpers import sandbox_leftovers
from test_sandbox_attacks import BACKENDS, _write_task, canaries, sandbox_config  # noqa: F401

from tmax_jax.errors import ConfigError
from tmax_jax.sandbox import SandboxConfig
from tmax_jax.tasks import load_task
from tmax_jax.tasks.runner import run_task

MODES = ("strict", "harbor")
# The tests compare the agent's answer with a reference only they hold; the reward is 1 or 0.
SCORE = 'if [ -n "$want" ] && [ "$(cat /app/answer.txt)" = "$want" ]; then echo 1; else echo 0; fi'
SCORE += " > /logs/verifier/reward.txt\n"
# Waits until something answers on the port in $1.
WAIT_PORT = 'for i in $(seq 100); do (echo > "/dev/tcp/127.0.0.1/$1") 2>/dev/null && break; sleep 0.1; done\n'
FETCH = (
    "import sys, urllib.request\n"
    "print(urllib.request.urlopen(f'http://127.0.0.1:{sys.argv[1]}/answer.txt', timeout=5).read().decode().strip())"
)


@pytest.fixture(params=BACKENDS)
def backend(request):
    return request.param


def _cfg(backend: str, tmp_path: Path, mode: str) -> SandboxConfig:
    return dataclasses.replace(sandbox_config(backend, tmp_path), verifier_mode=mode)


def _run(cfg, tmp_path, name, solve, test_sh, expected=None, extra=None):
    """Run a task whose tests are ``test_sh`` (``extra``: more files of the tests) as the oracle."""
    expected = expected or f"42-{uuid.uuid4().hex[:8]}"
    d = _write_task(tmp_path / "tasks", name, solve, expected)
    (d / "tests" / "test.sh").write_text("#!/bin/bash\n" + test_sh)
    for rel, text in (extra or {}).items():
        (d / "tests" / rel).write_text(text)
    return run_task(load_task(d), "oracle", cfg)


def _own_leftovers(cfg: SandboxConfig) -> list[str]:
    """This process's sandboxes' stage and run dirs (and processes) still on the host."""
    ours = f"{os.getpid()}-"
    run = cfg.resolved_run_dir
    left = [f"run dir {p}" for p in (run.iterdir() if run.is_dir() else []) if p.name.startswith(ours)]
    return left + sandbox_leftovers(cfg.cache_dir)


# ---- 4. scratch space -----------------------------------------------------------------------------
# A process the agent left overwrites every file that appears in the scratch dirs: the reference the
# tests copied into a `mktemp` file becomes the agent's wrong answer.
SWAP_TMP = """
    echo fake > /app/answer.txt
    cat > /opt/swap.sh <<'EOF'
    end=$((SECONDS + 90))
    while [ $SECONDS -lt $end ]; do
      for f in /tmp/tmp.* /var/tmp/tmp.* /dev/shm/tmp.*; do [ -f "$f" ] && [ "$(cat "$f")" != fake ] && echo fake > "$f"; done
    done
    EOF
    (bash /opt/swap.sh >/dev/null 2>&1 </dev/null &)
"""
MKTEMP_TEST = 'ref=$(mktemp)\ncp /tests/expected.txt "$ref"\nsleep 1\nwant=$(cat "$ref")\n' + SCORE


@pytest.mark.parametrize("mode", MODES)
def test_mktemp_file_swapped_by_left_over_process(backend, tmp_path, mode):
    res = _run(_cfg(backend, tmp_path, mode), tmp_path, "swap_tmp", SWAP_TMP, MKTEMP_TEST)
    assert res.reward == 0.0, (res.reason, res.verifier_log[-2000:])


def test_verifier_scratch_and_environment_are_its_own(backend, tmp_path):
    """The control: the verifier's TMPDIR, /tmp, /var/tmp and /dev/shm are empty and its own,
    its SHELL is fixed, whatever the agent set or left there."""
    solve = "echo ok > /app/answer.txt; for d in /tmp /var/tmp /dev/shm; do touch $d/agent-file; done\n"
    test_sh = (
        'left=$(ls -A /tmp /var/tmp /dev/shm | grep -c agent-file)\nref=$(mktemp)\necho "$TMPDIR" > "$ref"\n'
        'want=$([ "$left" = 0 ] && [ "$(cat "$ref")" = /tmp ] && [ "$SHELL" = /bin/bash ] && echo ok)\n'
        + SCORE
    )
    res = _run(_cfg(backend, tmp_path, "harbor"), tmp_path, "scratch_control", solve, test_sh)
    assert (res.reward, res.reason) == (1.0, "ok"), res.verifier_log[-2000:]


# ---- 5. network -----------------------------------------------------------------------------------
# The agent squats the port of the helper server the tests start; its server answers with the
# agent's own (wrong) answer, so the helper's reference never reaches the comparison.
SQUAT = (
    "echo fake > /app/answer.txt\nmkdir -p /srv/fake && echo fake > /srv/fake/answer.txt\n"
    "cd /srv/fake && (python3 -m http.server 8765 --bind 127.0.0.1 >/dev/null 2>&1 </dev/null &)\n"
    "set -- 8765\n" + WAIT_PORT
)
HELPER_TEST = (
    'srv=$(mktemp -d)\ncp /tests/expected.txt "$srv/answer.txt"\n'
    '(cd "$srv" && exec python3 -m http.server 8765 --bind 127.0.0.1 >/dev/null 2>&1) &\n'
    "set -- 8765\n" + WAIT_PORT + 'want=$(python3 -c "$(cat /tests/fetch.py)" 8765)\n' + SCORE + "kill %1\n"
)


def test_port_of_test_helper_squatted(backend, tmp_path):
    res = _run(
        _cfg(backend, tmp_path, "strict"), tmp_path, "squat", SQUAT, HELPER_TEST, extra={"fetch.py": FETCH}
    )
    assert res.reward == 0.0, (res.reason, res.verifier_log[-2000:])


@pytest.mark.parametrize("mode", [*MODES, "declared"])
def test_agent_service_answers_the_tests_in_harbor_mode_only(backend, tmp_path, mode):
    """The control of Harbor's semantics: a server the agent left running answers the tests (1) in
    harbor mode and for a task that declares it (``[verifier] agent_services``, in a strict run);
    strict mode stops it before the tests run (0)."""
    solve = (
        "mkdir -p /srv/ans && cp /solution/answer.txt /srv/ans/answer.txt && echo yes > /app/answer.txt\n"
        "cd /srv/ans && (python3 -m http.server 8766 --bind 127.0.0.1 >/dev/null 2>&1 </dev/null &)\n"
        "set -- 8766\n" + WAIT_PORT
    )
    test_sh = (
        'got=$(python3 -c "$(cat /tests/fetch.py)" 8766)\n'
        'want=$([ -n "$got" ] && [ "$got" = "$(cat /tests/expected.txt)" ] && echo yes)\n' + SCORE
    )
    cfg = _cfg(backend, tmp_path, "strict" if mode == "declared" else mode)
    d = _write_task(tmp_path / "tasks", "service", solve, "42-service")
    if mode == "declared":
        toml = (d / "task.toml").read_text()
        (d / "task.toml").write_text(toml.replace("[verifier]\n", "[verifier]\nagent_services = true\n"))
    (d / "tests" / "test.sh").write_text("#!/bin/bash\n" + test_sh)
    (d / "tests" / "fetch.py").write_text(FETCH)
    (d / "solution" / "answer.txt").write_text("42-service\n")
    res = run_task(load_task(d), "oracle", cfg)
    assert res.reward == (0.0 if mode == "strict" else 1.0), (res.reason, res.verifier_log[-2000:])


def test_verifier_mode_is_checked():
    with pytest.raises(ConfigError, match="verifier_mode"):
        SandboxConfig(verifier_mode="docker")


# ---- 6. bind sources swapped between planning and mounting (bwrap) ----------------------------------
# The agent's /app flips to a relative link the moment the host lists its root to plan the
# verifier's mounts (an inotify watch sees that), after /app was seen to be a directory: a bind
# that follows the link on the host binds the verifier's own tests at /app, or the host's /tmp.
# Thousands of dirs elsewhere widen the window: the host walks them for links before it mounts.
FLIP = """
    echo fake > /app/answer.txt
    mkdir -p /srv/pad && cd /srv/pad && seq 4000 | xargs mkdir && cd /app
    cat > /opt/flip.py <<'EOF'
    import ctypes, os, sys, time
    libc = ctypes.CDLL(None, use_errno=True)
    fd = libc.inotify_init()
    libc.inotify_add_watch(fd, b"/", 0x20)  # IN_OPEN of the root dir
    os.symlink(sys.argv[1], "/app.lnk")
    os.read(fd, 65536)
    time.sleep(0.002)  # the plan looks at /app just after listing the root
    os.rename("/app", "/app.dir")
    os.rename("/app.lnk", "/app")
    time.sleep(90)
    EOF
    (python3 /opt/flip.py {target} >/dev/null 2>&1 </dev/null &)
    sleep 0.5
"""
# From the agent's root dir in the stage (<stage>/disk/root): the verifier's own tests, or a dir of
# another sandbox's stage (all sandboxes' roots are the same host uid), here a canary dir.
TARGETS = {"own_tests": "../../verifier-1/tests", "other_stage": "../../../{canary}"}


@pytest.fixture
def other_stage():
    """A dir beside the sandboxes' stages that their mapped root may write, as another's stage."""
    from tmax_jax.sandbox.bwrap import STAGE_ROOT, SUBID_BASE, _make_stage_root

    _make_stage_root()
    d = STAGE_ROOT / f"canary-{uuid.uuid4().hex[:12]}"
    d.mkdir(mode=0o700)
    (d / "canary.txt").write_text("canary\n")
    for p in (d, d / "canary.txt"):
        os.chown(p, SUBID_BASE, SUBID_BASE)
    yield d
    for p in d.iterdir():
        p.unlink()
    d.rmdir()


@pytest.mark.skipif(os.geteuid() != 0, reason="the stages are host root's")
@pytest.mark.parametrize("target", sorted(TARGETS))
@pytest.mark.parametrize("mode", MODES)
def test_top_level_dir_swapped_for_link_after_planning(tmp_path, mode, target, canaries, other_stage):  # noqa: F811
    mark = f".tmax-verified-{uuid.uuid4().hex[:12]}"
    before = {p: p.read_bytes() for p in canaries}
    # The reference under the name of the agent's answer: a bind of the tests at /app compares the
    # reference with itself.
    test_sh = f"echo checked > /app/{mark}\nwant=$(cat /tests/answer.txt)\n" + SCORE
    expected = f"42-{uuid.uuid4().hex[:8]}"
    solve = FLIP.format(target=TARGETS[target].format(canary=other_stage.name))
    res = _run(
        _cfg("bwrap", tmp_path, mode),
        tmp_path,
        "flip",
        solve,
        test_sh,
        expected,
        {"answer.txt": expected + "\n"},
    )
    assert res.reward == 0.0, (res.reason, res.verifier_log[-2000:])
    assert sorted(p.name for p in other_stage.iterdir()) == ["canary.txt"]
    assert not Path("/tmp", mark).exists()
    assert {p: p.read_bytes() for p in canaries} == before


# ---- 7. host disk ---------------------------------------------------------------------------------
# A program the tests run leaves a 1,500-deep chain of directories with large files in /tests and
# /logs; the verifier scores 1 if it could write more than the task's storage (64 MB: a `fill_` task) there.
DEEP = """\
import os, sys
written = 0
for top in ("/tests", "/logs"):
    os.chdir(top)
    try:
        for _ in range(1500):
            os.mkdir("d")
            os.chdir("d")
        for i in range(10):
            with open(f"f{i}", "wb") as f:
                for _ in range(10):
                    f.write(b"x" * (1 << 20))
                    written += 1
    except OSError:
        pass
print(written)
"""
DEEP_TEST = 'want=$([ "$(python3 /tests/deep.py)" -ge 150 ] && cat /app/answer.txt)\n' + SCORE


def test_deep_tree_left_by_the_tests(backend, tmp_path):
    cfg = _cfg(backend, tmp_path, "strict")
    res = _run(
        cfg, tmp_path, "fill_deep", "echo fake > /app/answer.txt\n", DEEP_TEST, extra={"deep.py": DEEP}
    )
    # 0 whichever way: the tests' storage is full (even for their reward file), never an error of
    # the episode's clean-up.
    assert res.reward == 0.0 and "episode failed" not in res.reason, (res.reason, res.verifier_log[-2000:])
    assert _own_leftovers(cfg) == []
