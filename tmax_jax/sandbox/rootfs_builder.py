"""Assemble a small Debian-compatible rootfs from the host's own binaries (no network needed).

Used as the Podman base image (``podman import``) and as a self-contained bwrap rootfs. It holds a
shell, coreutils-style tools, Python 3 with pytest (with its distributions' metadata and console
scripts such as ``/usr/local/bin/pytest``), and the shared libraries they load (from ``ldd``). ``sandboxes/build_rootfs.py`` is the CLI; it can also run debootstrap when a Debian mirror
is reachable.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from tmax_jax.cache_publish import build_tree, check_tree, file_lock, lock_path, publish_tree
from tmax_jax.errors import SandboxError
from tmax_jax.sandbox.rootfs import SKELETON, SKELETON_LINKS

ID_FILE = ".tmax-rootfs-id"
# Bump when what the builder writes changes, so caches of the old layout are rebuilt.
# 3: distributions' metadata (*.dist-info / *.egg-info) and console scripts in /usr/local/bin.
# 4: the base image's empty directories (/var/log, /var/lib, /opt, /srv, ...) and /var/run, /var/lock.
ROOTFS_FORMAT = 4
STDLIB_PROBE = "import importlib, json, encodings, email, sqlite3, ssl, pytest"

TOOLS = (
    "bash sh dash env setpriv sleep cat ls cp mv rm mkdir rmdir ln chmod chown touch echo printf test "
    "head tail wc sort uniq cut tr tee grep sed awk mawk gawk find xargs tar gzip gunzip zcat bzip2 xz date "
    "basename dirname readlink realpath stat du df id whoami uname kill true false expr seq diff cmp "
    "md5sum sha1sum sha256sum base64 mktemp nproc timeout yes od pwd hostname which comm paste join split "
    "fold nl rev tac sum install truncate dd ps pgrep pkill file less more python3 perl"
).split()
PURE_PY = ("pytest", "_pytest", "pluggy", "iniconfig", "packaging", "pygments", "py")
SKIP_STDLIB = {
    "test",
    "idlelib",
    "tkinter",
    "turtledemo",
    "ensurepip",
    "lib2to3",
    "config-3.11-x86_64-linux-gnu",
}


def _ldd(path: Path) -> list[Path]:
    r = subprocess.run(["ldd", str(path)], capture_output=True, text=True)
    out = []
    for line in r.stdout.splitlines():
        m = re.search(r"(/\S+) \(0x", line)
        if m:
            out.append(Path(m.group(1)))
    return out


def _copy(src: Path, root: Path) -> None:
    dest = root / str(src).lstrip("/")
    if dest.exists():
        return
    dest.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(src, dest, follow_symlinks=True)


def _usr_path(p: Path) -> Path:
    s = str(p)
    for top in ("/bin/", "/sbin/", "/lib/", "/lib64/"):
        if s.startswith(top):
            return Path("/usr" + s)
    return p


def _top_levels(dist: importlib.metadata.Distribution) -> set[str]:
    """The importable top-level names a distribution installs."""
    listed = dist.read_text("top_level.txt")
    if listed:
        return {n.strip() for n in listed.split() if n.strip()}
    names = set()
    for f in dist.files or ():
        top = f.parts[0]
        if top in ("..", "__pycache__") or top.endswith((".dist-info", ".egg-info", ".data")):
            continue
        names.add(top.removesuffix(".py") if len(f.parts) == 1 else top)
    return names


def _console_script(python: str, name: str, value: str) -> str:
    """A launcher for the entry point ``module:attr[.attr...] [extras]``, run by the rootfs's own
    Python (the host's scripts name the host's interpreter in their shebang)."""
    mod, _, attr = value.split("[", 1)[0].strip().partition(":")
    ident = r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*"
    if not re.fullmatch(ident, mod) or not re.fullmatch(ident, attr) or not re.fullmatch(r"[\w.+-]+", name):
        raise SandboxError(f"console script {name!r}: entry point {value!r} is not module:attribute")
    return (
        f"#!{python}\n"
        "import sys\n"
        f"from {mod} import {attr.split('.')[0]}\n"
        "if __name__ == '__main__':\n"
        f"    sys.argv[0] = {name!r}\n"
        f"    sys.exit({attr}())\n"
    )


def _copy_distributions(copied: dict[Path, set[str]], site: Path, bin_dir: Path, python: str) -> None:
    """Copy the metadata of every distribution that installed one of the ``copied`` top-level
    names (so ``importlib.metadata`` and pytest's plugin loading find them) and write its console
    scripts into ``bin_dir``."""
    scripts: dict[str, str] = {}
    for host_site in sorted(copied):
        metas = sorted([*host_site.glob("*.dist-info"), *host_site.glob("*.egg-info")])
        for meta in metas:
            dist = importlib.metadata.Distribution.at(meta)
            if not _top_levels(dist) & copied[host_site]:
                continue
            if meta.is_dir():
                shutil.copytree(meta, site / meta.name, ignore=shutil.ignore_patterns("__pycache__"))
            else:  # a single-file PKG-INFO style .egg-info
                shutil.copy2(meta, site / meta.name)
            for ep in dist.entry_points:
                if ep.group == "console_scripts" and ep.name not in scripts:
                    scripts[ep.name] = _console_script(python, ep.name, ep.value)
    bin_dir.mkdir(parents=True, exist_ok=True)
    for name, text in sorted(scripts.items()):
        (bin_dir / name).write_text(text)
        os.chmod(bin_dir / name, 0o755)  # explicit: the manifest records modes, and umasks differ


def _write_host_rootfs(tmp: Path, python: str) -> None:
    """Fill the empty directory ``tmp`` with the rootfs."""
    for d in (
        "usr/bin",
        "usr/sbin",
        "usr/lib",
        "usr/lib64",
        "etc",
        "tmp",
        "proc",
        "dev",
        "sys",
        "run",
        "var/tmp",
        "run/lock",
        *(p.lstrip("/") for p in SKELETON),
    ):
        (tmp / d).mkdir(parents=True, exist_ok=True)
    for p in SKELETON:  # explicit modes: the manifest records them, and umasks differ
        os.chmod(tmp / p.lstrip("/"), 0o700 if p == "/root" else 0o755)
    os.chmod(tmp / "run/lock", 0o1777)
    for target, link in SKELETON_LINKS:
        os.symlink(target, tmp / link.lstrip("/"))
    for name, target in (
        ("bin", "usr/bin"),
        ("sbin", "usr/sbin"),
        ("lib", "usr/lib"),
        ("lib64", "usr/lib64"),
    ):
        os.symlink(target, tmp / name)
    elfs: list[Path] = []
    for tool in TOOLS:
        found = shutil.which(tool, path="/usr/bin:/bin:/usr/sbin:/sbin")
        if not found:
            continue
        real = Path(found).resolve()
        dest_bin = tmp / "usr/bin" / tool
        if not dest_bin.exists():
            shutil.copy2(real, dest_bin)
        elfs.append(real)
    py = Path(python).resolve()
    ver = f"python{sys.version_info.major}.{sys.version_info.minor}"
    if py.name.startswith("python3"):
        ver = py.name
    stdlib = Path(f"/usr/lib/{ver}")
    if not stdlib.is_dir():
        raise SandboxError(
            f"{stdlib} not found: the host rootfs builder needs a Debian python3 (apt install python3)"
        )
    shutil.copy2(py, tmp / "usr/bin" / py.name)
    for alias in ("python3", "python"):
        if not (tmp / "usr/bin" / alias).exists():
            os.symlink(py.name, tmp / "usr/bin" / alias)
    shutil.copytree(
        stdlib,
        tmp / str(stdlib).lstrip("/"),
        ignore=lambda d, names: [n for n in names if n in SKIP_STDLIB],
        symlinks=True,
    )
    elfs.append(py)
    elfs.extend((stdlib / "lib-dynload").glob("*.so"))
    site = tmp / "usr/lib/python3/dist-packages"
    site.mkdir(parents=True, exist_ok=True)
    copied: dict[Path, set[str]] = {}  # host site dir -> top-level names copied from it
    for mod in PURE_PY:
        spec = importlib.util.find_spec(mod)
        if spec is None or spec.origin is None:
            continue
        src = Path(spec.origin).parent if spec.submodule_search_locations else Path(spec.origin)
        if src.is_dir():
            shutil.copytree(src, site / src.name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(src, site / src.name)
        copied.setdefault(src.parent, set()).add(mod)
    _copy_distributions(copied, site, tmp / "usr/local/bin", f"/usr/bin/{py.name}")
    # Read-only at run time, so compile now: pytest imports ~2x faster with .pyc files present.
    subprocess.run(
        # -s/-p: the .pyc files name their sources by the paths they have inside the rootfs, not
        # by the temporary build dir; with a fixed hash seed (set constants marshal in one order)
        # two builds of one host are byte-identical and get the same content id.
        [
            str(py),
            "-m",
            "compileall",
            "-q",
            "-s",
            str(tmp),
            "-p",
            "/",
            str(site),
            str(tmp / str(stdlib).lstrip("/")),
        ],
        capture_output=True,
        env={**os.environ, "PYTHONHASHSEED": "0"},
    )
    seen: set[Path] = set()
    todo = list(elfs)
    while todo:
        p = todo.pop()
        for lib in _ldd(p):
            if lib in seen:
                continue
            seen.add(lib)
            _copy(lib.resolve(), tmp)
            # keep the soname the loader asks for, under usr/ (bin, lib are symlinks to usr/)
            want = tmp / str(_usr_path(lib)).lstrip("/")
            if not want.exists():
                want.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(lib.resolve(), want)
            todo.append(lib.resolve())
    (tmp / "etc/passwd").write_text(
        "root:x:0:0:root:/root:/bin/bash\nnobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n"
    )
    (tmp / "etc/group").write_text("root:x:0:\nnogroup:x:65534:\n")
    (tmp / "etc/hosts").write_text("127.0.0.1 localhost\n::1 localhost\n")
    (tmp / "etc/os-release").write_text('NAME="tmax-jax host-derived rootfs"\nID=debian\n')
    # Never publish a rootfs whose Python cannot start from its own standard library.
    r = subprocess.run(
        [str(tmp / "usr/bin" / py.name), "-I", "-c", STDLIB_PROBE],
        env={"PYTHONHOME": str(tmp / "usr"), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
    )
    if r.returncode != 0:
        raise SandboxError(f"the rootfs's python3 cannot import its standard library: {r.stderr[-800:]}")


def _write_id(tmp: Path, manifest: dict) -> None:
    (tmp / ID_FILE).write_text(rootfs_id(manifest) + "\n")


def rootfs_id(manifest: dict) -> str:
    """The rootfs's content id: a prefix of its manifest's digest (paths, modes, sizes, hashes)."""
    return manifest["id"][:16]


def build_host_rootfs(dest: Path, python: str = "/usr/bin/python3") -> Path:
    """Write the rootfs into ``dest`` (created; must not exist), atomically. Returns ``dest``."""
    dest = Path(dest)
    if os.path.lexists(dest):
        raise SandboxError(f"rootfs destination {dest} already exists")
    with file_lock(lock_path(dest)):
        if os.path.lexists(dest):
            raise SandboxError(f"rootfs destination {dest} already exists")
        build_tree(
            dest,
            lambda tmp: _write_host_rootfs(tmp, python),
            skip=frozenset({ID_FILE}),
            extra={"rootfs_format": ROOTFS_FORMAT, "python": python},
            after=_write_id,
        )
    return dest


def debootstrap_rootfs(
    dest: Path, suite: str = "bookworm", mirror: str = "http://deb.debian.org/debian"
) -> Path:
    """A minimal Debian via debootstrap (minutes; needs the mirror), with python3 and pytest."""
    if shutil.which("debootstrap") is None:
        raise SandboxError("debootstrap is not installed (apt install debootstrap)")
    r = subprocess.run(
        [
            "debootstrap",
            "--variant=minbase",
            "--include=python3,python3-pytest,util-linux",
            suite,
            str(dest),
            mirror,
        ],
        capture_output=True,
        text=True,
    )
    if r.returncode != 0:
        raise SandboxError(f"debootstrap failed: {r.stderr[-1500:]}")
    (Path(dest) / ID_FILE).write_text(f"debootstrap-{suite}\n")
    return Path(dest)


def check_rootfs(root: str | Path) -> tuple[dict | None, str | None]:
    """(manifest, None) when the rootfs at ``root`` is complete, else (None, why not); cheap."""
    doc, why = check_tree(root)
    if doc is None:
        return None, why
    if doc["extra"].get("rootfs_format") != ROOTFS_FORMAT:
        return None, f"{root} was built by another rootfs builder version"
    try:
        ident = (Path(root) / ID_FILE).read_text().strip()
    except OSError:
        return None, f"{root} has no {ID_FILE}"
    if ident != rootfs_id(doc):
        return None, f"{root}/{ID_FILE} says {ident}, its manifest {rootfs_id(doc)}"
    return doc, None


def host_fingerprint(python: str = "/usr/bin/python3") -> str:
    """What the host rootfs copies from this host, in short: the builder's Python, the target
    interpreter, and the versions of the pure-Python packages (``PURE_PY``) it takes from here. A host
    whose pytest is upgraded gets a new rootfs, not the old copy under a matching format."""
    versions = []
    for name in PURE_PY:
        try:
            versions.append(f"{name}={importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            versions.append(f"{name}=-")
    text = "\n".join([sys.version, python, *versions])
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def cached_host_rootfs(cache_dir: str | Path, python: str = "/usr/bin/python3") -> tuple[Path, str]:
    """The minimal host-derived rootfs under ``cache_dir`` and its content id; the base of the
    podman image and of the apptainer .sif. Built once across processes (under a lock, into a
    temporary dir renamed into place); checked against its manifest on every call and rebuilt when
    damaged or unfinished."""
    # The format is in the name, so processes running builders of two versions (an upgrade while
    # evals run) each keep their own tree instead of rebuilding the other's under its readers.
    # The host's packages too: a rootfs made before the host's pytest was upgraded is not reused.
    rootfs_dir = Path(cache_dir) / "rootfs" / f"host-minimal-f{ROOTFS_FORMAT}-{host_fingerprint(python)}"
    doc, _ = publish_tree(
        rootfs_dir,
        lambda tmp: _write_host_rootfs(tmp, python),
        skip=frozenset({ID_FILE}),
        extra={"rootfs_format": ROOTFS_FORMAT, "python": python},
        after=_write_id,
        check=check_rootfs,
    )
    return rootfs_dir, rootfs_id(doc)
