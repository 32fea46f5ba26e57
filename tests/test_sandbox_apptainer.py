"""Apptainer driver: only where the binary exists (it is not installable on the development
machines, so these tests skip there with that reason)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tmax_jax.sandbox import SandboxConfig, make_sandbox
from tmax_jax.sandbox.apptainer import ApptainerSandbox, apptainer_available, definition_text
from tmax_jax.sandbox.recipe import parse_apptainer_def

OK, WHY = apptainer_available()
pytestmark = pytest.mark.skipif(not OK, reason=WHY)
TASKS = Path(__file__).parent / "tasks"


def test_instance_and_exec_flags(tmp_path):
    cfg = SandboxConfig(backend="apptainer", cache_dir=str(tmp_path), pids_max=99)
    sb = ApptainerSandbox(cfg, tmp_path / "x.sif")
    argv = sb.start_argv(tmp_path / "x.sif")
    assert argv[:3] == ["apptainer", "instance", "start"]
    assert "--containall" in argv and argv[argv.index("--net") + 1 : argv.index("--net") + 3] == [
        "--network",
        "none",
    ]
    assert "--pids-limit=99" in argv and argv[-1] == sb.name
    ex = sb._exec_argv(["bash", "-c", "true"], {"A": "1"}, "/app", False)
    assert ex[:2] == ["apptainer", "exec"] and "--cleanenv" in ex and f"instance://{sb.name}" in ex


def test_generated_definition_and_run(tmp_path):
    recipe = parse_apptainer_def(TASKS / "tmax_log_errors" / "container.def")
    text = definition_text(recipe, tmp_path / "base.sif")
    assert text.startswith("Bootstrap: localimage") and "%post" in text
    cfg = SandboxConfig(backend="apptainer", cache_dir=str(tmp_path))
    with make_sandbox(cfg) as sb:
        assert sb.exec("echo hi").stdout == "hi\n"
        sh = sb.shell()
        sh.run("cd /tmp")
        assert sh.run("pwd").stdout == "/tmp\n"
