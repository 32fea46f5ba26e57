"""Sandbox cleanup never deletes host files through a bind that is still mounted.

A session of 2026-12-05 lost the host Python's whole prefix (/root/.pyenv/versions/3.11.7, emptied
in one second during the test suite; the directory itself, a mount point elsewhere, was left):
the bwrap backend binds host dirs under /root into each sandbox's stage dir (``_reachable``), and
cleanup deleted the stage recursively after a lazy unmount whose result it never checked, while
each staged bind began writable (``mount --bind`` then a read-only remount). These tests attack
both: a stage whose bind cannot be unmounted must be left in place, and a staged bind must be
read-only from the moment it exists."""

from __future__ import annotations

import os
import subprocess

import pytest

from tmax_jax.sandbox import overlay
from tmax_jax.sandbox.bwrap import remove_stage

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mounts need host root")


def _bind(src, dst):
    subprocess.run(["mount", "--bind", str(src), str(dst)], check=True)


def _umount(path):
    subprocess.run(["umount", "-l", str(path)], capture_output=True)


@pytest.fixture
def victim(tmp_path):
    d = tmp_path / "host-python"
    (d / "bin").mkdir(parents=True)
    (d / "bin" / "python3").write_text("the host's interpreter\n")
    return d


def test_a_stage_whose_bind_stays_mounted_is_not_deleted_through_it(tmp_path, victim, monkeypatch, capsys):
    stage = tmp_path / "stage"
    (stage / "src0").mkdir(parents=True)
    (stage / "scratch.txt").write_text("x")
    _bind(victim, stage / "src0")  # writable: the worst case a failed remount would leave
    try:
        # The lazy unmount fails (as it may under a busy or foreign mount namespace): cleanup must
        # not fall through to a recursive delete of the stage.
        real_run = subprocess.run

        def failing_umount(cmd, *a, **k):
            if cmd and cmd[0] == "umount":
                return subprocess.CompletedProcess(cmd, 32, b"", b"umount: target is busy")
            return real_run(cmd, *a, **k)

        monkeypatch.setattr(overlay.subprocess, "run", failing_umount)
        remove_stage(stage)
        monkeypatch.undo()
        assert (victim / "bin" / "python3").read_text() == "the host's interpreter\n"
        assert stage.exists()  # left in place, with its mount
        # ... and said so, from remove_unmounted_tree itself: its other callers (the verifier dir,
        # the registry's stale records) get the same warning.
        err = capsys.readouterr().err
        assert f"{stage} left in place" in err and "1 mount(s) still under it" in err
    finally:
        _umount(stage / "src0")
    # Once the bind is gone the stage goes too, and the host dir is still whole.
    remove_stage(stage)
    assert not stage.exists()
    assert (victim / "bin" / "python3").is_file()


def test_a_stage_is_removed_with_its_binds_detached_first(tmp_path, victim):
    stage = tmp_path / "stage"
    (stage / "src0").mkdir(parents=True)
    _bind(victim, stage / "src0")
    remove_stage(stage)
    assert not stage.exists()
    assert (victim / "bin" / "python3").read_text() == "the host's interpreter\n"
    assert overlay.mounts_under(tmp_path) == []


def test_staged_binds_are_read_only_from_the_start(tmp_path, victim):
    dst = tmp_path / "src0"
    dst.mkdir()
    overlay.readonly_bind(str(victim), str(dst))
    try:
        assert (dst / "bin" / "python3").read_text() == "the host's interpreter\n"
        with pytest.raises(OSError) as e:
            (dst / "bin" / "python3").unlink()
        assert e.value.errno == 30  # EROFS
        with pytest.raises(OSError):
            (dst / "planted").write_text("x")
        assert (victim / "bin" / "python3").is_file() and not (victim / "planted").exists()
    finally:
        _umount(dst)


def test_mount_points_with_spaces_are_found(tmp_path, victim):
    dst = tmp_path / "a dir" / "src 0"
    dst.mkdir(parents=True)
    _bind(victim, dst)
    try:
        assert overlay.mounts_under(tmp_path) == [str(dst)]
    finally:
        _umount(dst)


def test_a_deep_tree_is_removed_without_recursion(tmp_path):
    d = tmp_path / "deep"
    d.mkdir()
    fd = os.open(d, os.O_RDONLY)
    for _ in range(3000):  # deeper than Python's recursion limit: shutil.rmtree raised here
        os.mkdir("d", dir_fd=fd)
        fd, old = os.open("d", os.O_RDONLY, dir_fd=fd), fd
        os.close(old)
    os.close(os.open("f", os.O_WRONLY | os.O_CREAT, dir_fd=fd))
    os.close(fd)
    assert overlay.remove_unmounted_tree(d)
    assert not d.exists()


def test_a_clean_up_that_fails_is_recorded_and_retried_by_the_sweep(tmp_path, monkeypatch, capsys):
    import json

    from tmax_jax.sandbox import SandboxConfig, make_sandbox, registry

    cfg = SandboxConfig(cache_dir=str(tmp_path / "cache"))
    real_run = subprocess.run

    def failing_rm(cmd, *a, **k):
        if cmd and cmd[0] == "rm":
            return subprocess.CompletedProcess(cmd, 1, b"", b"rm: cannot remove: Device or resource busy")
        return real_run(cmd, *a, **k)

    with make_sandbox(cfg) as sb:
        sb.exec("mkdir -p /app/x && echo hi > /app/x/f")
        monkeypatch.setattr(overlay.subprocess, "run", failing_rm)
    monkeypatch.undo()
    # The episode's close did not raise; it said so and left a record marked closed.
    assert "could not remove" in capsys.readouterr().err
    rec = json.loads((sb.run_dir / "owner.json").read_text())
    assert rec["closed"] is True and rec["stage"] == str(sb.stage) and sb.stage.exists()
    # The next sweep (while this owner still runs) removes what was left.
    assert registry.sweep_stale(cfg.resolved_run_dir) == 1
    assert not sb.run_dir.exists() and not sb.stage.exists()
