"""Every live sandbox of this process, so that exit, SIGINT/SIGTERM and exceptions clean them all.

Each sandbox also leaves an ``owner.json`` in its run dir; ``sweep_stale`` removes what a dead owner
left behind (a parent killed with SIGKILL cannot clean up; its sandbox processes already died with
it through ``--die-with-parent``, and the next pool start removes its dirs, cgroups and containers).
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

from tmax_jax.sandbox import cgroup
from tmax_jax.sandbox.overlay import remove_unmounted_tree
from tmax_jax.sandbox.procs import pid_alive, tool_env

_LIVE: dict = {}
_LOCK = threading.Lock()
_INSTALLED = False
_ATEXIT = False
_PREVIOUS: dict[int, object] = {}


def install_handlers() -> None:
    """Called by SandboxPool (usually built in the main thread) and on each sandbox start."""
    _install()


def register(sb) -> None:
    with _LOCK:
        _LIVE[sb.id] = sb
    _install()


def unregister(sb) -> None:
    with _LOCK:
        _LIVE.pop(sb.id, None)


def live() -> list:
    with _LOCK:
        return list(_LIVE.values())


def close_all() -> None:
    for sb in live():
        try:
            sb.close()
        except Exception:  # noqa: BLE001 - keep closing the others
            pass


def _on_signal(signum, frame):
    close_all()
    prev = _PREVIOUS.get(signum)
    if callable(prev):
        prev(signum, frame)
    elif signum == signal.SIGINT:
        raise KeyboardInterrupt
    else:
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)


def _install() -> None:
    """atexit once; signal handlers as soon as we are called from the main thread (Python only
    lets the main thread set them, and the first sandbox may well start in a pool worker)."""
    global _INSTALLED, _ATEXIT
    if not _ATEXIT:
        _ATEXIT = True
        atexit.register(close_all)
    if _INSTALLED:
        return
    if threading.current_thread() is threading.main_thread():
        _INSTALLED = True
        for s in (signal.SIGINT, signal.SIGTERM):
            prev = signal.getsignal(s)
            # Keep Python's default SIGINT behaviour (KeyboardInterrupt) after our cleanup.
            _PREVIOUS[s] = None if prev in (signal.default_int_handler, signal.SIG_DFL) else prev
            signal.signal(s, _on_signal)


def _proc_start_ticks(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    return int(stat[stat.rfind(b")") + 2 :].split()[19])


def owner_record(extra: dict) -> dict:
    pid = os.getpid()
    return {"pid": pid, "start_ticks": _proc_start_ticks(pid), **extra}


def owner_alive(rec: dict) -> bool:
    pid = rec.get("pid")
    return bool(pid) and pid_alive(pid) and _proc_start_ticks(pid) == rec.get("start_ticks")


def cleanup_record(run_dir: Path, rec: dict) -> bool:
    """Remove everything one sandbox record names: container, cgroup, mount, dir. Returns whether
    its dirs are gone (a failure is said on stderr; ``keep_for_sweep`` leaves a record to retry)."""
    if rec.get("container"):
        subprocess.run(
            ["podman", "rm", "-f", "-t", "0", rec["container"]],
            capture_output=True,
            env=tool_env(),
            timeout=60,
        )
    if rec.get("apptainer_instance"):
        subprocess.run(
            [rec.get("apptainer_bin", "apptainer"), "instance", "stop", "-F", rec["apptainer_instance"]],
            capture_output=True,
            env=tool_env(),
            timeout=60,
        )
    if rec.get("cgroup"):
        cg = cgroup.Cgroup(rec["cgroup"])
        cg.kill_all()
        cg.remove()
    done = True
    if rec.get("stage"):
        from tmax_jax.sandbox.bwrap import remove_stage

        done = remove_stage(Path(rec["stage"]))
    # Unmounts what is mounted under the run dir (its state dir among them) and deletes it only
    # when nothing is left: never a recursive delete through a staged bind of a host dir.
    return remove_unmounted_tree(run_dir) and done


def keep_for_sweep(run_dir: Path, rec: dict) -> None:
    """Leave ``rec`` (marked closed) in ``run_dir`` for ``sweep_stale`` to retry a clean-up that
    failed, even while its owner still runs."""
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "owner.json").write_text(json.dumps({**rec, "closed": True}))
    except OSError as e:
        print(f"tmax-jax: cannot record {run_dir} for a later clean-up: {e}", file=sys.stderr)


def sweep_stale(run_root: Path) -> int:
    """Clean the sandboxes under ``run_root`` whose owner process is gone or that were closed with
    something left behind. Returns how many."""
    n = 0
    try:
        entries = list(run_root.iterdir())
    except OSError:
        return 0
    for d in entries:
        try:
            rec = json.loads((d / "owner.json").read_text())
        except (OSError, ValueError):
            continue
        if owner_alive(rec) and not rec.get("closed"):
            continue
        if not cleanup_record(d, rec):
            keep_for_sweep(d, rec)
        n += 1
    return n
