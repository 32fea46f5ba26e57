"""The host side of the verifier's guard against the code it tests.

Many verifiers run the agent's code inside their own process: the tests import its module, call its
function, run its script. Whatever that code does then, it does with the verifier's rights, so it
can end pytest early with status 0 (``os._exit(0)``, ``pytest.exit(returncode=0)``), skip or xfail
the tests that would fail, swap pytest's runner, add a hook that rewrites reports, append to the
running ``test.sh``, or write ``reward.txt`` and kill the shell that would have overwritten it.

What closes those, in every backend's ``run_verifier``:

* the tests' files (``test.sh`` above all: bash reads its script as it goes) and the verifier's own
  Python dir are mounted read-only over the writable ``/tests`` (``readonly_test_files``);
* a pytest plugin of ours (``verifier_guard_plugin.py``, copied into the verifier's ``/tests`` and
  loaded by ``PYTEST_PLUGINS`` in every pytest the verifier runs) fails a test skipped or xfailed by
  code outside the tests and pytest, a session stopped by it, a session that exits 0 with tests that
  never ran, a runner or hook changed after start-up, and a session whose parent died under it; it
  sets the session's exit status to 1 (so the verifier's own logic writes 0) and leaves a record in
  ``/logs/tmax-guard``, beside and not in ``/logs/verifier``; at its end it kills the processes the
  session started and left running (one could rewrite ``reward.txt`` after the verifier's last
  write; the verifier has a pid namespace of its own);
* ``read_records`` here turns those records into the reason the reward is 0 (``VerifierRun.tampered``)
  and a session that started and never finished (ended from inside: ``os._exit``, ``exec``, a signal)
  into a reason no positive reward of that verification is trusted (``VerifierRun.suspect``);
* ``reward_files_problem``: a ``reward.txt`` or ``reward.json`` that is not a regular file (a link to
  ``/dev/null`` that swallowed the verifier's ``echo 0``) is an error, never skipped for the other;
* the runner trusts no positive reward from a verifier that ended with a status above 128 (killed by
  a signal: the shell that would have written 0).

Code inside the verifier's process can still undo what is checked from inside it: this closes the
simple, learnable ways, and ``sandboxes/README.md`` says what stays open.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

PLUGIN_NAME = "tmax_guard"
PLUGIN_SOURCE = Path(__file__).with_name("verifier_guard_plugin.py")
# Inside the verifier: where the plugin writes its records (a dir of the verifier's own /logs).
GUARD_DIR = "/logs/tmax-guard"
MAX_RECORDS = 64
# How many of the tests' files get a read-only mount each; beyond it, the top-level files only.
MAX_READONLY_FILES = 256


def plugin_text() -> str:
    return PLUGIN_SOURCE.read_text()


def merge_env(ours: dict[str, str], task: dict[str, str] | None) -> dict[str, str]:
    """The verifier's plugin variables with a task's own: the task's values win, except that its
    ``PYTHONPATH`` comes after ours and its ``PYTEST_PLUGINS`` beside ours."""
    out = {**ours, **(task or {})}
    for key, sep in (("PYTHONPATH", ":"), ("PYTEST_PLUGINS", ",")):
        theirs = (task or {}).get(key)
        if key in ours and theirs:
            out[key] = ours[key] + sep + theirs
    return out


def _test_files(root: Path, own_dir: str) -> list[str]:
    """The tests' regular files (relative, sorted), without the verifier's own dir ``own_dir``."""
    files: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel = os.path.relpath(dirpath, root)
        if rel == own_dir or rel.startswith(own_dir + os.sep):
            dirnames[:] = []
            continue
        dirnames.sort()
        for name in filenames:
            p = os.path.join(dirpath, name)
            if os.path.isfile(p) and not os.path.islink(p):
                files.append(os.path.normpath(os.path.join(rel, name)))
    files.sort()
    return files


def readonly_test_files(tests_copy: Path, own_dir: str) -> list[str]:
    """Paths inside ``/tests`` (relative) to mount read-only over the writable tests dir: the
    verifier's own Python dir ``own_dir`` (relative) and the tests' regular files (all of them up to
    ``MAX_READONLY_FILES``, else the top-level ones). The dirs stay writable: a verifier's HOME is
    /tests, and tools make caches there."""
    files = _test_files(Path(tests_copy), own_dir)
    if len(files) > MAX_READONLY_FILES:
        files = [f for f in files if os.sep not in f][:MAX_READONLY_FILES]
    return [own_dir, *files]


def tests_fit_readonly(tests_copy: Path, own_dir: str) -> bool:
    """Whether every file of the tests gets its read-only mount (``readonly_test_files``): the
    same count, the verifier's own dir left out."""
    return len(_test_files(Path(tests_copy), own_dir)) <= MAX_READONLY_FILES


def _read_json(dir_fd: int, name: str) -> dict | None:
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dir_fd)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        with os.fdopen(os.dup(fd), "rb") as f:
            raw = f.read(1 << 16)
    finally:
        os.close(fd)
    try:
        doc = json.loads(raw.decode("utf-8", errors="replace"))
    except ValueError:
        return None
    return doc if isinstance(doc, dict) else None


def read_records(guard_dir: Path) -> tuple[str | None, str | None]:
    """(tampered, suspect) from the plugin's records in ``guard_dir`` (host side; links and special
    files are never followed): the first thing a session found, and the first session that started
    but never finished."""
    try:
        top = os.open(guard_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:
        return None, None
    tampered = suspect = None
    try:
        names = sorted(n for n in os.listdir(top) if n.endswith(".json"))[:MAX_RECORDS]
        for name in names:
            doc = _read_json(top, name)
            if doc is None:
                continue
            findings = doc.get("findings")
            if tampered is None and isinstance(findings, list) and findings:
                tampered = f"code under test: {str(findings[0])[:300]}"
            if suspect is None and doc.get("status") != "finished":
                argv = " ".join(str(a) for a in doc.get("argv", []) if isinstance(a, str))[:120]
                suspect = (
                    f"pytest (pid {doc.get('pid')}, {argv!r}) never finished its session: ended from "
                    "inside (os._exit, exec, a signal) by code under test"
                )
    finally:
        os.close(top)
    return tampered, suspect


def reward_files_problem(logs_dir: Path) -> str | None:
    """A reward file the verifier's logs dir holds as something other than a regular file."""
    from tmax_jax.tasks.reward import REWARD_FILES

    for name in REWARD_FILES:
        try:
            st = os.lstat(os.path.join(logs_dir, name))
        except OSError:
            continue
        if not stat.S_ISREG(st.st_mode):
            kind = "a link" if stat.S_ISLNK(st.st_mode) else "not a regular file"
            return f"/logs/verifier/{name} is {kind}"
    return None
