"""Attack tests of the verifier's guard against the code it tests (``tmax_jax/sandbox/verifier_guard.py``).

Many Harbor verifiers run the agent's code inside their own process: here the tests import
/app/solution.py and call ``solve()``. Each solution below answers wrong and then tries to pass
anyway with the verifier's rights (end pytest with status 0, skip its tests, swap its runner, write
the reward and kill the shell...): each must score 0, end to end through ``run_task(..., "oracle")``
on bwrap and, where podman works here, on podman. The controls hold a verifier's own skips, an
xfail, a write into its HOME and a ``--ctrf`` report, and must score 1.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_sandbox_attacks import BACKENDS, _write_task, sandbox_config

from tmax_jax.tasks import load_task
from tmax_jax.tasks.runner import run_task

# The verifier runs the agent's code in its own process (the tests import /app/solution.py and
# call solve()), so that code has the verifier's rights. Each solution below answers wrong and then
# tries to pass anyway (``sandbox/verifier_guard.py``). The tests also hold a verifier's own skips,
# an xfail, a write into /tests (its HOME) and --ctrf: the good control must still score 1.
CODE_TEST_SH = """\
#!/bin/bash
cd /app
if python3 -m pytest -q -p no:cacheprovider --ctrf /logs/verifier/ctrf.json /tests/test_answer.py /tests/test_files.py; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
"""
CODE_TEST_PY = """\
import sys
from pathlib import Path

import pytest

sys.path.insert(0, "/app")
import solution  # noqa: E402

WANT = Path("/tests/expected.txt").read_text().strip()


def test_solve():
    assert solution.solve() == WANT


def test_solve_again():
    assert solution.solve() == WANT


@pytest.mark.skipif(True, reason="the verifier's own marker")
def test_marked_skip():
    raise AssertionError


def test_own_imperative_skip():
    pytest.skip("the verifier's own skip")


@pytest.mark.xfail(strict=True, reason="the verifier expects this to fail")
def test_expected_failure():
    assert solution.solve() == WANT + "-not"


def test_scratch_in_home():
    Path("/tests/scratch.txt").write_text("the verifier may write in its HOME")
"""
# A verifier that runs the agent's program itself: the shell compares its output.
RUN_TEST_SH = """\
#!/bin/bash
out=$(python3 /app/solution.py)
if [ "$out" = "$(cat /tests/expected.txt)" ]; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
"""
WRONG = "def solve():\n    return 'wrong'\n"
CODE_ATTACKS = {
    # Ending the session early with status 0.
    "os_exit_at_import": "import os\nos._exit(0)\n",
    "pytest_exit_returncode_0": "import pytest\n\ndef solve():\n    pytest.exit('done', returncode=0)\n",
    "fork_parent_exits_0": "import os\nif os.fork():\n    os._exit(0)\n" + WRONG,
    # Skipping or xfailing the tests that would fail.
    "pytest_skip": "import pytest\n\ndef solve():\n    pytest.skip('no')\n",
    "skip_exception_raised": "from _pytest.outcomes import Skipped\n\ndef solve():\n    raise Skipped('no')\n",
    "unittest_skiptest": "import unittest\n\ndef solve():\n    raise unittest.SkipTest('no')\n",
    "pytest_xfail": "import pytest\n\ndef solve():\n    pytest.xfail('no')\n",
    "module_level_skip": "import pytest\npytest.skip('no', allow_module_level=True)\n",
    "atexit_os_exit_0": "import atexit, os\natexit.register(os._exit, 0)\n" + WRONG,
    "skip_from_exec_string": "def solve():\n    exec('import pytest; pytest.skip(\"no\")')\n",
    # Changing how pytest runs tests or reports them.
    "xfail_marker_added_at_run_time": (
        "import sys\nimport pytest\n\ndef solve():\n    f = sys._getframe()\n"
        "    while 'pyfuncitem' not in f.f_locals:\n        f = f.f_back\n"
        "    f.f_locals['pyfuncitem'].add_marker(pytest.mark.xfail(reason='flaky'))\n    return 'wrong'\n"
    ),
    "report_failed_property_patched": (
        "import _pytest.reports as r\nr.BaseReport.failed = property(lambda self: False)\n" + WRONG
    ),
    "runtest_patched": (  # it still runs the xfail test, which must fail
        "import _pytest.python as p\norig = p.Function.runtest\n"
        "p.Function.runtest = lambda self: orig(self) if 'expected' in self.name else None\n" + WRONG
    ),
    "runtest_patched_then_restored": (
        "import _pytest.python as p\norig, n = p.Function.runtest, [0]\n\n"
        "def fake(self):\n    n[0] += 1\n    p.Function.runtest = orig if n[0] > 1 else fake\n\n"
        "p.Function.runtest = fake\n" + WRONG
    ),
    "hook_registered_at_runtime": (
        "import gc\nimport pytest\n\nclass PassAll:\n    @pytest.hookimpl(hookwrapper=True)\n"
        "    def pytest_runtest_makereport(self, item, call):\n        rep = (yield).get_result()\n"
        "        rep.outcome, rep.longrepr = 'passed', None\n\n"
        "for o in gc.get_objects():\n    if type(o).__name__ == 'Config' and hasattr(o, 'pluginmanager'):\n"
        "        o.pluginmanager.register(PassAll(), 'passall')\n        break\n" + WRONG
    ),
    # Writing the reward, then keeping the verifier from overwriting it.
    "append_to_running_test_sh": (
        "open('/tests/test.sh', 'a').write('\\necho 1 > /logs/verifier/reward.txt\\n')\n" + WRONG
    ),
    "reward_json_and_txt_link": (
        "import os\nopen('/logs/verifier/reward.json', 'w').write('{\"reward\": 1}')\n"
        "os.symlink('/dev/null', '/logs/verifier/reward.txt')\n" + WRONG
    ),
    "write_reward_kill_pytest_and_shell": (
        "import os\nopen('/logs/verifier/reward.txt', 'w').write('1')\n"
        "os.kill(os.getppid(), 9)\nos.kill(os.getpid(), 9)\n"
    ),
    # A process left behind that rewrites the reward after the verifier's last write.
    "reward_rewriter_left_running": (
        'import subprocess, sys\nWATCH = r"""\nimport ctypes, os, time\n'
        "libc = ctypes.CDLL(None, use_errno=True)\nfd = libc.inotify_init()\n"
        "libc.inotify_add_watch(fd, b'/logs/verifier', 0x8)  # IN_CLOSE_WRITE\n"
        "while True:\n    os.read(fd, 4096)\n    try:\n"
        "        if open('/logs/verifier/reward.txt').read().strip() == '0':\n"
        "            open('/logs/verifier/reward.txt', 'w').write('1')\n"
        '    except OSError:\n        pass\n"""\n'
        "subprocess.Popen([sys.executable, '-c', WATCH], start_new_session=True, stdin=subprocess.DEVNULL,\n"
        "                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)\n" + WRONG
    ),
    # ...and the same from a program the shell runs: kill every ancestor but pid 1.
    "program_writes_reward_kills_shell": (
        "import os\nopen('/logs/verifier/reward.txt', 'w').write('1')\npid = os.getppid()\n"
        "while pid > 1:\n    up = int(open(f'/proc/{pid}/stat').read().rsplit(')', 1)[1].split()[1])\n"
        "    os.kill(pid, 9)\n    pid = up\n"
    ),
}
RUN_ATTACKS = {"program_writes_reward_kills_shell"}


def _write_code_task(root: Path, name: str, solution: str, expected: str) -> Path:
    """A Harbor task whose tests run the agent's /app/solution.py (``CODE_ATTACKS``)."""
    d = _write_task(root, name, "cp /solution/solution.py /app/solution.py\n", expected)
    (d / "tests" / "test.sh").write_text(RUN_TEST_SH if name in RUN_ATTACKS else CODE_TEST_SH)
    (d / "tests" / "test_answer.py").write_text(CODE_TEST_PY)
    (d / "tests" / "test_files.py").write_text(
        "from pathlib import Path\n\n\ndef test_solution_exists():\n    assert Path('/app/solution.py').is_file()\n"
    )
    (d / "solution" / "solution.py").write_text(solution)
    return d


@pytest.fixture(params=BACKENDS)
def cfg(request, tmp_path):
    return sandbox_config(request.param, tmp_path)


def test_code_under_test_controls(cfg, tmp_path):
    """The verifier's own skips, xfail, HOME writes and --ctrf report pass; a wrong answer fails."""
    tasks = tmp_path / "tasks"
    good = _write_code_task(tasks, "code_good", "def solve():\n    return '42-right'\n", "42-right")
    res = run_task(load_task(good), "oracle", cfg)
    assert (res.reward, res.reason) == (1.0, "ok"), res.verifier_log
    summary = json.loads(res.verifier_files["ctrf.json"])["results"]["summary"]
    assert (summary["passed"], summary["skipped"], summary["failed"]) == (4, 3, 0), summary
    # A test.sh that sets its own PYTHONPATH: the guard plugin still loads.
    own = _write_code_task(tasks, "code_good_own_path", "def solve():\n    return '42-right'\n", "42-right")
    sh = (own / "tests" / "test.sh").read_text()
    (own / "tests" / "test.sh").write_text(
        sh.replace("if python3 -m pytest", "if PYTHONPATH=/app python3 -m pytest")
    )
    res = run_task(load_task(own), "oracle", cfg)
    assert (res.reward, res.reason) == (1.0, "ok"), res.verifier_log
    run = _write_code_task(tasks, "program_writes_reward_kills_shell", "print('42-right')\n", "42-right")
    res = run_task(load_task(run), "oracle", cfg)
    assert (res.reward, res.reason) == (1.0, "ok"), res.verifier_log
    bad = run_task(load_task(_write_code_task(tasks, "code_bad", WRONG, "42-right")), "oracle", cfg)
    assert (bad.reward, bad.reason) == (0.0, "verifier failed"), bad.verifier_log


# The plugin is the same file on both backends; podman runs the attacks that go through what differs
# (its mounts of the guard's records, the read-only test files, the logs, its own pid namespace).
PODMAN_TOO = {
    "os_exit_at_import", "pytest_skip", "hook_registered_at_runtime", "append_to_running_test_sh",
    "reward_json_and_txt_link", "reward_rewriter_left_running", "atexit_os_exit_0",
}  # fmt: skip


@pytest.mark.parametrize("attack", sorted(CODE_ATTACKS))
def test_code_under_test_attack_scores_zero(cfg, tmp_path, attack):
    if cfg.backend != "bwrap" and attack not in PODMAN_TOO:
        pytest.skip("the same plugin as on bwrap; podman runs the attacks on its own mounts")
    task = load_task(_write_code_task(tmp_path / "tasks", attack, CODE_ATTACKS[attack], "42-right"))
    res = run_task(task, "oracle", cfg)
    assert res.reward == 0.0, (attack, res.reason, res.verifier_log[-2000:])


def test_records_give_findings_and_unfinished_sessions(tmp_path):
    from tmax_jax.sandbox.verifier_guard import read_records

    assert read_records(tmp_path / "absent") == (None, None)
    d = tmp_path / "guard"
    d.mkdir()
    (d / "1-1.json").write_text(
        json.dumps({"pid": 1, "argv": ["pytest"], "status": "finished", "findings": []})
    )
    assert read_records(d) == (None, None)
    (d / "2-1.json").write_text(
        json.dumps({"pid": 2, "argv": ["pytest", "-q"], "status": "started", "findings": []})
    )
    tampered, suspect = read_records(d)
    assert tampered is None and "pid 2" in suspect and "never finished" in suspect
    (d / "3-1.json").write_text(
        json.dumps({"pid": 3, "status": "finished", "findings": ["test x: Skipped raised by /app/s.py:3"]})
    )
    tampered, _ = read_records(d)
    assert tampered == "code under test: test x: Skipped raised by /app/s.py:3"
    # Links and garbage are never followed or trusted: a record that is not one is skipped.
    e = tmp_path / "guard2"
    e.mkdir()
    (tmp_path / "outside.json").write_text(json.dumps({"status": "started", "findings": ["x"]}))
    (e / "0-0.json").symlink_to(tmp_path / "outside.json")
    (e / "1-0.json").write_text("{not json")
    (e / "2-0.json").write_text("[1, 2]")
    assert read_records(e) == (None, None)


def test_reward_files_that_are_not_regular_files_are_named(tmp_path):
    from tmax_jax.sandbox.verifier_guard import reward_files_problem

    assert reward_files_problem(tmp_path) is None
    (tmp_path / "reward.txt").write_text("0\n")
    assert reward_files_problem(tmp_path) is None
    (tmp_path / "reward.txt").unlink()
    (tmp_path / "reward.txt").symlink_to("/dev/null")
    assert reward_files_problem(tmp_path) == "/logs/verifier/reward.txt is a link"
    (tmp_path / "reward.txt").unlink()
    (tmp_path / "reward.json").mkdir()
    assert reward_files_problem(tmp_path) == "/logs/verifier/reward.json is not a regular file"


def test_task_env_is_merged_after_the_guard_plugin():
    from tmax_jax.sandbox.base import VERIFIER_PLUGIN_DIR, VERIFIER_PLUGIN_ENV
    from tmax_jax.sandbox.verifier_guard import merge_env

    got = merge_env(
        dict(VERIFIER_PLUGIN_ENV), {"PYTHONPATH": "/app/lib", "PYTEST_PLUGINS": "their_plugin", "X": "1"}
    )
    assert got["PYTHONPATH"] == f"{VERIFIER_PLUGIN_DIR}:/app/lib"
    assert got["PYTEST_PLUGINS"] == "tmax_guard,their_plugin"
    assert got["X"] == "1" and got["TMAX_GUARD_DIR"] == "/logs/tmax-guard"
    assert merge_env(dict(VERIFIER_PLUGIN_ENV), None) == VERIFIER_PLUGIN_ENV


def test_readonly_test_files(tmp_path, monkeypatch):
    from tmax_jax.sandbox import verifier_guard

    (tmp_path / ".own" / "lib").mkdir(parents=True)
    (tmp_path / ".own" / "lib" / "x.py").write_text("")
    (tmp_path / "data").mkdir()
    (tmp_path / "test.sh").write_text("")
    (tmp_path / "data" / "a.csv").write_text("")
    (tmp_path / "link").symlink_to("test.sh")
    assert verifier_guard.readonly_test_files(tmp_path, ".own") == [".own", "data/a.csv", "test.sh"]
    # The verifier's own files (and links) do not count against the limit: two test files fit two.
    monkeypatch.setattr(verifier_guard, "MAX_READONLY_FILES", 2)
    assert verifier_guard.tests_fit_readonly(tmp_path, ".own")
    monkeypatch.setattr(verifier_guard, "MAX_READONLY_FILES", 1)
    assert not verifier_guard.tests_fit_readonly(tmp_path, ".own")
    assert verifier_guard.readonly_test_files(tmp_path, ".own") == [".own", "test.sh"]
