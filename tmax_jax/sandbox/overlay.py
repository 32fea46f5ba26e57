"""Copy-on-write base directories for the bwrap backend (host root only).

Each top-level directory of the read-only base (``/usr``, ``/etc``, the real ``/lib*`` dirs of the
host, or every top-level dir of a rootfs directory) becomes an overlay in the sandbox's stage:

- lower: an id-mapped, read-only bind of the base dir (``open_tree`` + ``mount_setattr`` with the
  sandbox's user namespace), so the host's root-owned files appear owned by the sandbox's root and
  Docker's capabilities apply to them there, and only there; below it, when the task's image was
  built with a layer, that layer's own copy-on-write dir (already owned by the sandbox's ids);
- a mask layer between them: whiteouts and replacement files (below);
- upper and work: dirs of the sandbox's size-limited disk tmpfs, beside (not in) the agent's root,
  so nothing the agent writes reaches the base and the disk limit holds;
- merged: mounted once by host root in the host's mount namespace; every command's bwrap binds it,
  so all commands see one consistent filesystem.

Host files that others may not read (``/etc/shadow``, ``/etc/ssl/private``, ...) would become the
sandbox root's own through the id map: they are hidden by whiteouts in the mask layer,
and ``/etc/shadow``/``/etc/gshadow`` are replaced with locked entries for the image's users, as a
Docker image has them.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import threading
from pathlib import Path

_SYS_OPEN_TREE, _SYS_MOVE_MOUNT, _SYS_MOUNT_SETATTR = 428, 429, 442  # x86_64 and aarch64 alike
_OPEN_TREE_CLONE, _OPEN_TREE_CLOEXEC = 1, 0o2000000
_AT_FDCWD, _AT_EMPTY_PATH = -100, 0x1000
_MOUNT_ATTR_RDONLY, _MOUNT_ATTR_NOSUID, _MOUNT_ATTR_NODEV = 0x1, 0x2, 0x4
_MOUNT_ATTR_IDMAP = 0x00100000
_MOVE_MOUNT_F_EMPTY_PATH = 0x4


class _MountAttr(ctypes.Structure):
    _fields_ = [
        ("attr_set", ctypes.c_uint64),
        ("attr_clr", ctypes.c_uint64),
        ("propagation", ctypes.c_uint64),
        ("userns_fd", ctypes.c_uint64),
    ]


_libc = None
_hidden_cache: dict[str, tuple[str, ...]] = {}
_hidden_lock = threading.Lock()


def _lib():
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    return _libc


def _detached_bind(src: str, dst: str, attrs: int, userns_fd: int, what: str) -> None:
    """Clone ``src`` as a detached mount (``open_tree``), set ``attrs`` on it (``mount_setattr``),
    then attach it at ``dst`` (``move_mount``): it is never mounted without those attributes."""
    lib = _lib()
    fd = lib.syscall(_SYS_OPEN_TREE, _AT_FDCWD, os.fsencode(src), _OPEN_TREE_CLONE | _OPEN_TREE_CLOEXEC)
    if fd < 0:
        e = ctypes.get_errno()
        raise OSError(e, f"open_tree({src}): {os.strerror(e)}")
    try:
        attr = _MountAttr(attrs, 0, 0, userns_fd)
        if (
            lib.syscall(_SYS_MOUNT_SETATTR, fd, b"", _AT_EMPTY_PATH, ctypes.byref(attr), ctypes.sizeof(attr))
            < 0
        ):
            e = ctypes.get_errno()
            raise OSError(e, f"{what} {src}: {os.strerror(e)}")
        if lib.syscall(_SYS_MOVE_MOUNT, fd, b"", _AT_FDCWD, os.fsencode(dst), _MOVE_MOUNT_F_EMPTY_PATH) < 0:
            e = ctypes.get_errno()
            raise OSError(e, f"attaching {src} at {dst}: {os.strerror(e)}")
    finally:
        os.close(fd)


def idmapped_bind(src: str, dst: str, userns_path: str) -> None:
    """Mount a read-only bind of ``src`` at ``dst``, its ids seen through ``userns_path``'s map."""
    ns = os.open(userns_path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        attrs = _MOUNT_ATTR_IDMAP | _MOUNT_ATTR_RDONLY | _MOUNT_ATTR_NODEV
        _detached_bind(src, dst, attrs, ns, "id-mapping")
    finally:
        os.close(ns)


def readonly_bind(src: str, dst: str) -> None:
    """Mount a bind of ``src`` at ``dst`` that is read-only from the moment it exists: a plain
    ``mount --bind`` followed by a read-only remount leaves a window in which the host's files are
    writable through ``dst``."""
    attrs = _MOUNT_ATTR_RDONLY | _MOUNT_ATTR_NODEV | _MOUNT_ATTR_NOSUID
    _detached_bind(src, dst, attrs, 0, "making read-only the bind of")


def mounts_under(path: str | os.PathLike, including: bool = False) -> list[str] | None:
    """Mount points strictly below ``path`` (and ``path`` itself when ``including``) in this mount
    namespace, or None when ``/proc/self/mountinfo`` cannot be read (then nothing below ``path`` may be
    assumed unmounted)."""
    top = os.fspath(path).rstrip("/")
    prefix = top + "/"
    try:
        with open("/proc/self/mountinfo", "rb") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    out = []
    for line in lines:
        fields = line.split()
        if len(fields) < 5:
            continue
        # Spaces, tabs, newlines and backslashes in mount points are octal escapes (\040 ...).
        mp = fields[4].decode("unicode_escape").encode("latin-1").decode("utf-8", "surrogateescape")
        if mp.startswith(prefix) or (including and mp == top):
            out.append(mp)
    return out


def remove_unmounted_tree(path: str | os.PathLike) -> bool:
    """Lazily unmount every mount at or below ``path`` (deepest first), then delete ``path`` only if
    none is left: a recursive delete through a bind that is still mounted deletes the host's files
    under its source. Returns whether ``path`` is gone. Never raises: when a mount could not be
    detached, the mount table could not be read or the delete failed, ``path`` is left in place and
    stderr says so, whoever the caller (the sandbox's record then lets the stale sweep retry).

    The delete is ``rm -rf --one-file-system``: it walks any depth without recursion in this
    process (a chain of thousands of dirs a verifier left would overflow Python's stack in
    ``shutil.rmtree``), never follows links and never crosses into another filesystem."""
    try:
        points = mounts_under(path, including=True)
        for mp in sorted(points or [], key=len, reverse=True):
            subprocess.run(["umount", "-l", mp], capture_output=True)
        left = mounts_under(path, including=True)
        if left is None or left:
            why = "the mount table is unreadable" if left is None else f"{len(left)} mount(s) still under it"
            print(f"tmax-jax: {path} left in place, not deleted through its mounts ({why})", file=sys.stderr)
            return False
        if not os.path.lexists(path):
            return True
        r = subprocess.run(["rm", "-rf", "--one-file-system", "--", os.fspath(path)], capture_output=True)
        if not os.path.lexists(path):
            return True
        why = r.stderr.decode(errors="replace").strip().splitlines()[-1:] or [f"rm exit {r.returncode}"]
    except Exception as e:  # noqa: BLE001 - a clean-up must never fail the episode it follows
        why = [f"{type(e).__name__}: {e}"]
    print(f"tmax-jax: could not remove {path}: {why[0]}", file=sys.stderr)
    return False


def hidden_entries(src: str, fresh: bool = False) -> tuple[str, ...]:
    """Paths under ``src`` (relative) that others may not read, or dirs they may not search: what
    the id map would otherwise open to the sandbox's root. Found once per process per dir (a walk
    of the host's /usr takes about a second), or at every call when ``fresh`` (``/etc``, where
    host secrets live and a walk takes milliseconds)."""
    with _hidden_lock:
        got = None if fresh else _hidden_cache.get(src)
        if got is not None:
            return got
        r = subprocess.run(
            ["find", src, "-xdev", "-mindepth", "1", "(", "!", "-perm", "-o=r", "-o", "-type", "d",
             "!", "-perm", "-o=x", ")", "-prune", "-print0"],
            capture_output=True,
        )  # fmt: skip
        rels = []
        for p in r.stdout.split(b"\0"):
            if p:
                rels.append(os.path.relpath(os.fsdecode(p), src))
        got = tuple(sorted(rels))
        _hidden_cache[src] = got
        return got


def _locked_shadow(lower_etc: Path, layer_etc: Path | None, name: str) -> bytes | None:
    """``/etc/shadow`` (``name='shadow'``, from passwd) or ``gshadow`` (from group): every account
    locked, as in a Docker image."""
    src = "passwd" if name == "shadow" else "group"
    text = None
    for d in (layer_etc, lower_etc):
        if d is not None and (d / src).is_file():
            try:
                text = (d / src).read_text(errors="replace")
            except OSError:
                continue
            break
    if text is None:
        return None
    lines = []
    for line in text.splitlines():
        user = line.split(":", 1)[0]
        if not user or user.startswith("#"):
            continue
        lines.append(f"{user}:*:19000:0:99999:7:::" if name == "shadow" else f"{user}:*::")
    return ("\n".join(lines) + "\n").encode()


def prepare_mask(upper: Path, src: str, dest: str, layer_dir: Path | None) -> None:
    """A lower layer between the base and the image's layer: whiteouts over the entries of ``src``
    others may not read, and the Docker-like shadow files for ``/etc``."""
    for rel in hidden_entries(src, fresh=dest == "/etc"):
        path = upper / rel
        _mirror_parents(upper, Path(src), rel)
        if not os.path.lexists(path):
            os.mknod(path, 0o600 | 0o020000, os.makedev(0, 0))
    if dest == "/etc":
        for name in ("shadow", "gshadow"):
            if not os.path.lexists(Path(src) / name):
                continue
            data = _locked_shadow(Path(src), layer_dir, name)
            if data is None:
                continue
            path = upper / name
            if os.path.lexists(path):
                os.unlink(path)
            path.write_bytes(data)
            path.chmod(0o640)


def _mirror_parents(upper: Path, src: Path, rel: str) -> None:
    """The dirs above ``rel`` in ``upper``, with the base's modes and owners (an upper dir's own
    attributes are what the merged dir shows)."""
    parts = rel.split("/")[:-1]
    for i in range(1, len(parts) + 1):
        sub = "/".join(parts[:i])
        d = upper / sub
        if os.path.lexists(d):
            continue
        st = os.lstat(src / sub)
        d.mkdir()
        os.chown(d, st.st_uid, st.st_gid)
        d.chmod(st.st_mode & 0o7777)


def mount_overlay(lowers: list[str], upper: Path, work: Path, merged: Path) -> None:
    opts = f"lowerdir={':'.join(lowers)},upperdir={upper},workdir={work}"
    r = subprocess.run(
        ["mount", "-t", "overlay", "-o", opts, "overlay", str(merged)], capture_output=True, text=True
    )
    if r.returncode != 0:
        raise OSError(0, f"overlay over {lowers[-1]} failed: {r.stderr.strip()}")
