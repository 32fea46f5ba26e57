"""``link_scan``: symlinks an agent made that would lead a verifier into its own files, resolved on a
real directory tree standing for the sandbox's view (``/tests`` absent, as for the agent)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from tmax_jax.sandbox.link_scan import LinkWatch, find_link_into_verifier, reaches_verifier


def _view(root: Path):
    return lambda parts: os.path.join(root, *parts)


def _scan(root: Path, **kw):
    return find_link_into_verifier([(root, ())], _view(root), **kw)


@pytest.fixture
def root(tmp_path):
    r = tmp_path / "view"
    for d in ("app/sub", "etc", "usr/bin", "opt"):
        (r / d).mkdir(parents=True)
    (r / "app" / "answer.txt").write_text("mine\n")
    (r / "etc" / "mtab").symlink_to("../proc/self/mounts")
    (r / "bin").symlink_to("usr/bin")
    return r


# (link path in the view, its content): each leads into the verifier's files.
INTO = [
    ("app/a", "/tests/expected.txt"),
    ("app/a", "/tests"),
    ("app/a", "/logs/verifier/reward.txt"),
    ("app/a", "../tests/expected.txt"),  # relative, climbing out of /app
    ("app/sub/a", "../../../../tests/x"),  # past the root stays at the root
    ("app/a", "/proc/self/root/tests/expected.txt"),
    ("app/a", "/proc/1/cwd/expected.txt"),
    ("app/a", "/proc/thread-self/fd/3"),
    ("app/a", "/dev/fd/3"),
    ("app/a", "/nonexistent/../tests/x"),  # a missing dir a running process could still make
]
# ...and these do not.
CLEAR = [
    ("app/a", "/dev/null"),
    ("app/a", "/dev/stdout"),
    ("app/a", "/proc/mounts"),
    ("app/a", "/proc/self/mounts"),
    ("app/a", "/etc/mtab"),  # a link of the base's, into /proc/self/mounts
    ("app/a", "answer.txt"),
    ("app/a", "/usr/bin/python3"),
    ("app/a", "/bin/sh"),
    ("app/a", "/app/testsuite"),
]


@pytest.mark.parametrize(("link", "target"), INTO)
def test_links_into_the_verifiers_files_are_found(root, link, target):
    (root / link).symlink_to(target)
    reason = _scan(root)
    assert reason is not None and reason.startswith(f"/{link} is a link into the verifier's own files"), (
        reason
    )


@pytest.mark.parametrize(("link", "target"), CLEAR)
def test_other_links_are_the_agents_business(root, link, target):
    (root / link).symlink_to(target)
    assert _scan(root) is None


def test_chains_through_the_agents_own_links_are_followed(root):
    # /app/answer.txt -> d/x, /app/d/x -> ../r/tests/expected.txt, /app/r -> /: only the chain leads
    # into /tests, and the link reported is the first one the walk meets on it.
    (root / "app" / "r").symlink_to("/")
    (root / "app" / "d").mkdir()
    (root / "app" / "d" / "x").symlink_to("../r/tests/expected.txt")
    assert reaches_verifier(_view(root), ["app"], "d/x") == "/tests"
    assert reaches_verifier(_view(root), ["app"], "r/etc") is None
    (root / "app" / "answer.txt").unlink()
    (root / "app" / "answer.txt").symlink_to("d/x")
    assert "into the verifier's own files (/tests)" in _scan(root)
    # A dir link at the top (the verifier's root rebuilds those): /t -> /tests, /app/y -> /t/y.
    (root / "app" / "d" / "x").unlink()
    (root / "app" / "answer.txt").unlink()
    (root / "t").symlink_to("/tests")
    assert _scan(root) == "/t is a link into the verifier's own files (/tests)"


def test_loops_and_skipped_tops(root):
    (root / "app" / "l1").symlink_to("l2")
    (root / "app" / "l2").symlink_to("l1")
    assert _scan(root) is None  # ELOOP: the verifier's open fails as well
    (root / "opt" / "a").symlink_to("/tests/x")
    assert _scan(root) is not None
    assert _scan(root, skip_top=frozenset({"opt"})) is None


def _watching(root: Path):
    return LinkWatch([(root, ())], _view(root), skip_top=frozenset({"proc"})).start()


def test_watch_sees_a_link_made_and_removed_while_it_runs(root):
    w = _watching(root)
    link = root / "app" / "answer.txt"
    link.unlink()
    link.symlink_to("/tests/expected.txt")
    time.sleep(0.05)
    link.unlink()  # gone before the scan after the verifier
    link.write_text("mine\n")
    reason = w.stop()
    assert reason is not None and reason.startswith("/app/answer.txt is a link into the verifier's own files")
    assert _scan(root) is None


@pytest.mark.parametrize("how", ["made", "moved"])
def test_watch_sees_links_in_dirs_that_appear(root, tmp_path, how):
    w = _watching(root)
    if how == "made":  # a new dir, then a link in it (its watch may come after the link)
        (root / "app" / "new" / "deep").mkdir(parents=True)
        (root / "app" / "new" / "deep" / "x").symlink_to("/proc/self/cwd/expected.txt")
    else:  # a tree made elsewhere, moved in whole
        (tmp_path / "out" / "deep").mkdir(parents=True)
        (tmp_path / "out" / "deep" / "x").symlink_to("/proc/self/cwd/expected.txt")
        (tmp_path / "out").rename(root / "app" / "new")
    time.sleep(0.05)
    reason = w.stop()
    assert reason is not None and "/app/new/deep/x is a link into the verifier's own files" in reason, reason


def test_watch_leaves_other_files_and_links_alone(root):
    w = _watching(root)
    (root / "app" / "log").symlink_to("/dev/stdout")
    (root / "app" / "d").mkdir()
    (root / "app" / "d" / "f").write_text("x")
    (root / "proc").mkdir()
    (root / "proc" / "l").symlink_to("/tests")  # a skipped top dir (the kernel's)
    time.sleep(0.05)
    assert w.stop() is None


def test_watch_leaves_package_trees_to_the_scans(root):
    (root / "app" / "node_modules" / "pkg").mkdir(parents=True)
    w = _watching(root)
    (root / "app" / "node_modules" / "pkg" / "x").symlink_to("/tests/expected.txt")
    time.sleep(0.05)
    assert w.stop() is None  # not watched there...
    assert "/app/node_modules/pkg/x is a link" in _scan(root)  # ...but the scan after finds it
