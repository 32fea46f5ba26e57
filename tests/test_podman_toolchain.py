"""The podman verifier's toolchain checks on hand-made overlay layers (real dirs, whiteouts, inotify)."""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path

import pytest

from tmax_jax.sandbox.podman_toolchain import Watch, scan, shadow_scan


def _put(root: Path, rel: str, data: str = "x") -> Path:
    p = root / rel
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(data)
    return p


@pytest.fixture
def layers(tmp_path):
    """An image layer with python, bash, pytest and a libc; an empty upper dir."""
    lower, upper = tmp_path / "lower", tmp_path / "upper"
    for rel in (
        "usr/bin/python3",
        "usr/bin/bash",
        "usr/bin/grep",
        "usr/lib/python3.11/os.py",
        "usr/lib/python3/dist-packages/pytest/__init__.py",
        "usr/lib/x86_64-linux-gnu/libc.so.6",
        "etc/passwd",
    ):
        _put(lower, rel)
    (lower / "bin").symlink_to("usr/bin")
    upper.mkdir()
    return upper, [str(lower)]


ALLOWED = [
    "app/answer.txt",
    "usr/local/bin/mytool",  # a new command that shadows nothing
    "usr/local/lib/python3.11/dist-packages/mypkg/__init__.py",
    "usr/local/lib/python3.11/dist-packages/mypkg-1.0.dist-info/entry_points.txt",
    "usr/lib/x86_64-linux-gnu/libnew.so.1",
    "usr/share/doc/x",
    "etc/passwd",  # useradd
    "tmp/scratch",
]
TAMPERED = {
    "usr/bin/python3": "/usr/bin/python3",
    "usr/local/bin/grep": "shadows",
    "usr/local/bin/python3": "shadows",
    "usr/bin/pyvenv.cfg": "prefix",
    "usr/lib/python3.11/sitecustomize.py": "standard library",
    "usr/lib/python3.11/__pycache__/os.cpython-311.pyc": "standard library",
    "usr/lib/python311.zip": "python311.zip",
    "usr/local/lib/python3.11/dist-packages/pytest/__main__.py": "pytest",
    "usr/local/lib/python3.11/dist-packages/_pytest/main.py": "_pytest",
    "usr/lib/python3/dist-packages/zz.pth": "start-up",
    "usr/lib/python3/dist-packages/usercustomize.py": "usercustomize",
    "etc/ld.so.preload": "ld.so.preload",
    "etc/ld.so.conf.d/evil.conf": "ld.so.conf.d",
    "etc/python3.11/sitecustomize.py": "python3.11",
    "usr/lib/x86_64-linux-gnu/libc.so.6": "libc.so.6",
    "conftest.py": "/conftest.py",
    "pytest.ini": "/pytest.ini",
    "pytest.toml": "/pytest.toml",  # pytest 9's own config names
    ".pytest.toml": "/.pytest.toml",
}


def test_allowed_changes_pass(layers):
    upper, lowers = layers
    for rel in ALLOWED:
        _put(upper, rel, "[console_scripts]\nmytool = mypkg:main\n" if rel.endswith(".txt") else "x")
    assert scan(upper, lowers) is None


@pytest.mark.parametrize("rel", sorted(TAMPERED))
def test_each_toolchain_change_is_found(layers, rel):
    upper, lowers = layers
    _put(upper, rel)
    reason = scan(upper, lowers)
    assert reason is not None and TAMPERED[rel] in reason, reason


def test_a_command_the_tasks_own_build_made_is_task_content(tmp_path):
    """A wrapper the task's Dockerfile put on PATH (which its instruction may ask the agent to fix) may
    change, as under Docker; a harness command the build installed (pytest's console script, python,
    a stand-in for a base command) may not."""
    layer, base, upper = tmp_path / "layer", tmp_path / "base", tmp_path / "upper"
    for rel in ("usr/bin/python3", "usr/bin/bash", "usr/bin/grep"):
        _put(base, rel)
    _put(layer, "usr/local/bin/greet", "#!/bin/sh\necho broken\n")
    _put(
        layer, "usr/local/bin/runner", "#!/usr/bin/python3\nfrom pytest import console_main\nconsole_main()\n"
    )
    _put(layer, "usr/local/bin/python3.12", "x")
    _put(layer, "usr/local/bin/grep", "x")
    lowers = [str(layer), str(base)]
    upper.mkdir()
    _put(upper, "usr/local/bin/greet", "#!/bin/sh\necho fixed\n")
    assert scan(upper, lowers) is None
    for rel, why in (
        ("usr/local/bin/runner", "/usr/local/bin/runner (a command of the image) was changed"),
        ("usr/local/bin/python3.12", "/usr/local/bin/python3.12 (a command of the image) was changed"),
        ("usr/local/bin/grep", "/usr/local/bin/grep (a command of the image) was changed"),
    ):
        _put(upper, rel, "#!/bin/sh\necho 1 > /logs/verifier/reward.txt\n")
        assert why in (scan(upper, lowers) or ""), rel
        (upper / rel).unlink()


def test_pytest_plugin_entry_point_is_found(layers):
    upper, lowers = layers
    _put(
        upper,
        "usr/local/lib/python3.11/dist-packages/evil-1.0.dist-info/entry_points.txt",
        "[pytest11]\ne = evil\n",
    )
    assert "pytest plugin" in scan(upper, lowers)


@pytest.mark.skipif(os.geteuid() != 0, reason="whiteouts are character devices: mknod needs root")
def test_removed_and_renamed_toolchain_is_found(layers):
    upper, lowers = layers
    # ``rm /usr/bin/bash`` leaves a whiteout; ``mv /usr/lib/python3.11 ...`` one at the old name.
    (upper / "usr/bin").mkdir(parents=True)
    os.mknod(upper / "usr/bin/bash", stat.S_IFCHR | 0o600, os.makedev(0, 0))
    assert "/usr/bin/bash" in scan(upper, lowers)
    os.unlink(upper / "usr/bin/bash")
    (upper / "usr/lib").mkdir()
    os.mknod(upper / "usr/lib/python3.11", stat.S_IFCHR | 0o600, os.makedev(0, 0))
    assert "/usr/lib/python3.11 was replaced" in scan(upper, lowers)


def test_replaced_path_dir_symlink_is_found(layers):
    upper, lowers = layers
    (upper / "bin").symlink_to("/app/fakebin")
    assert "/bin was replaced" in scan(upper, lowers)


def _wait_for(watch: Watch) -> str | None:
    time.sleep(0.3)
    return watch.stop()


def test_watch_sees_a_file_planted_and_removed(layers):
    upper, lowers = layers
    (upper / "usr/local").mkdir(parents=True)
    watch = Watch(upper).start()
    p = _put(upper, "usr/local/bin/grep")
    p.unlink()
    assert scan(upper, lowers) is None  # nothing left for a scan to see
    reason = _wait_for(watch)
    assert reason is not None and "/usr/local/bin" in reason, reason


def test_watch_sees_a_site_package_planted_in_new_dirs(layers):
    upper, _ = layers
    watch = Watch(upper).start()
    p = _put(upper, "usr/local/lib/python3.11/dist-packages/pytest/__main__.py")
    p.unlink()
    p.parent.rmdir()
    reason = _wait_for(watch)
    assert reason is not None and "python3.11" in reason, reason


def test_watch_ignores_the_agents_own_files(layers):
    upper, _ = layers
    (upper / "app").mkdir()
    watch = Watch(upper).start()
    for i in range(20):
        _put(upper, f"app/out{i}.txt").write_text("rewritten")
    _put(upper, "usr/share/doc/readme")
    _put(upper, "tmp/x")
    assert _wait_for(watch) is None


@pytest.mark.parametrize("how", ["symlink", "hardlink", "dir_symlink"])
def test_package_metadata_linked_to_agent_files_is_found(layers, tmp_path, how):
    # Metadata that passes the check but points at a file the agent can rewrite after it.
    upper, lowers = layers
    agent_file = _put(upper, "app/ep.txt", "[console_scripts]\n")
    site = upper / "usr/local/lib/python3.11/dist-packages"
    info = site / "evil-1.0.dist-info"
    if how == "dir_symlink":
        site.mkdir(parents=True)
        info.symlink_to("/app/evil.dist-info")
    else:
        info.mkdir(parents=True)
        if how == "symlink":
            (info / "entry_points.txt").symlink_to("/app/ep.txt")
        else:
            os.link(agent_file, info / "entry_points.txt")
    reason = scan(upper, lowers)
    assert reason is not None and "is a link" in reason, reason


@pytest.mark.parametrize("how", ["file", "link"])
def test_shadow_scan_finds_a_pytest_config_at_the_top(tmp_path, how):
    """The agent's root as bwrap's verifier sees it: a config pytest reads from / is reported as a
    file or as a link (the verifier's root rebuilds top-level links); the same names deeper down,
    or a directory bearing one at the top, are the agent's own files."""
    root = tmp_path / "state"
    _put(root, "app/pytest.ini", "[pytest]\n")
    _put(root, "app/sub/conftest.py")
    (root / "setup.cfg").mkdir()
    assert shadow_scan(root) is None
    for name in ("conftest.py", "pytest.toml", ".pytest.ini"):
        p = root / name
        if how == "file":
            p.write_text("[pytest]\n")
        else:
            p.symlink_to("/app/pytest.ini")
        reason = shadow_scan(root)
        assert reason is not None and f"/{name} was written" in reason, reason
        p.unlink()
