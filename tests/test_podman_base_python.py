"""The podman base image's Python carries its distributions' metadata and console scripts, so a
verifier may call ``pytest`` or ``python3 -m pytest`` with any flags, as under Docker; skipped where
podman cannot run containers, with the reason."""

from __future__ import annotations

import importlib.metadata

import pytest

from tmax_jax.sandbox import SandboxConfig, make_sandbox
from tmax_jax.sandbox.podman_images import podman_available

OK, WHY = podman_available()
pytestmark = [pytest.mark.podman, pytest.mark.skipif(not OK, reason=WHY)]

# The first test fails, the second passes: ``-x`` must stop before the second one runs.
TEST_FILE = """\
def test_a_fails():
    assert 1 + 1 == 3

def test_b_passes():
    assert sum(range(4)) == 6
"""
PASSING_FILE = """\
import pluggy

def test_ok():
    assert pluggy.HookspecMarker("x").project_name == "x"
"""


@pytest.fixture(scope="module")
def sb():
    cfg = SandboxConfig(backend="podman", exec_timeout_s=60, memory_mb=512)
    with make_sandbox(cfg) as s:
        yield s


def test_distribution_metadata_matches_the_hosts(sb):
    # The rootfs copies these packages from the builder's interpreter: the versions must agree.
    names = ("pluggy", "pytest", "iniconfig", "packaging")
    code = "import importlib.metadata as m, sys; print(' '.join(m.version(n) for n in sys.argv[1:]))"
    r = sb.exec(["python3", "-c", code, *names])
    assert r.exit_code == 0, r.stderr
    assert r.stdout.split() == [importlib.metadata.version(n) for n in names]


def test_pytest_console_scripts(sb):
    r = sb.exec("command -v pytest py.test")
    assert r.exit_code == 0 and r.stdout.split() == ["/usr/local/bin/pytest", "/usr/local/bin/py.test"], r
    want = f"pytest {importlib.metadata.version('pytest')}"
    for cmd in ("pytest --version", "py.test --version", "python3 -m pytest --version"):
        r = sb.exec(cmd)
        assert r.exit_code == 0 and want in r.stdout + r.stderr, (cmd, r)


def test_pytest_runs_with_flags(sb):
    sb.write_file("/tmp/w/test_x.py", TEST_FILE)
    sb.write_file("/tmp/w/test_ok.py", PASSING_FILE)
    r = sb.exec("pytest -q -p no:cacheprovider -rA test_x.py", cwd="/tmp/w")
    assert r.exit_code == 1, r
    assert "FAILED test_x.py::test_a_fails" in r.stdout and "PASSED test_x.py::test_b_passes" in r.stdout, r
    assert "1 failed, 1 passed" in r.stdout, r
    r = sb.exec("python3 -m pytest -x --tb=short test_x.py", cwd="/tmp/w")
    assert r.exit_code == 1 and "1 failed" in r.stdout and "passed" not in r.stdout, r
    r = sb.exec(["pytest", "-q", "-rA", "test_ok.py"], cwd="/tmp/w")
    assert r.exit_code == 0 and "PASSED test_ok.py::test_ok" in r.stdout, r
