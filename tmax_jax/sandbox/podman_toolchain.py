"""Has the agent changed the verifier's toolchain? Checks of a podman container's overlay upper dir.

Under podman the agent's root filesystem is a writable overlay (as under Docker) and the verifier runs
on that same filesystem, so the agent could swap what the verifier starts: the interpreter, bash,
pytest and its plugins, ``.pth``/``sitecustomize`` start-up code, the dynamic loader's configuration,
a command earlier on the verifier's fixed PATH, a ``/conftest.py`` or ``/pytest.ini`` above
``/tests``. Every change the agent makes lands in the overlay's upper dir, read here on the host:

- ``scan(upper, lowers, tests)``: the toolchain changes the upper dir holds now. A changed or deleted image
  file cannot be undone from inside (copy-up and whiteouts stay), so a scan after the verifier sees
  whatever was done before or during it, except a file that is new, planted and removed again.
- ``Watch``: inotify over the toolchain dirs of the upper dir while the verifier runs; any change
  there (the plant-and-remove case) counts as tampering.

The rule: the tests run against the agent's state with tools the agent could not change. Every
executable, shared library and configuration the verifier's processes load or interpret (the loader,
NSS and its modules, PAM, OpenSSL, gconv, locale and time-zone data, ``file``'s magic, shell start-up
files, Python) comes from the image as built; the agent's files are data at their paths. So also:

- configuration read at start-up (``CONFIG``: ``/etc/nsswitch.conf``, ``/etc/pam.d``, ``/etc/magic``,
  ``/etc/profile``, ``/etc/localtime``, ``/usr/lib/locale``, a lib dir's ``gconv/``, ...) changed,
  added or removed (a file copied up unchanged is no change); a new ``libnss_*`` module (glibc loads
  any module ``nsswitch.conf`` names, the image's own config included, by name from the lib dirs);
- a new command on the verifier's PATH that a shell script of the tests looks for or installs
  (``harness_commands``: ``command -v pytest-3 && pytest-3``, ``apt-get install -y curl``), or whose
  name is a harness's (``pytest*``, ``python*``, ``bash``, ...): it would come before what the tests
  meant to run.

What is allowed: new commands that shadow nothing and that the tests do not look for (a tool the
task asked for, which the tests run), new Python packages that are not pytest, its dependencies or
start-up hooks, new libraries other than NSS modules (the loader only finds them through its
configuration, which is protected), configuration of the system's services (``/etc/hosts``,
``/etc/nginx``, ``/etc/cron.d``, new ``/etc/pam.d`` services, new ``/etc/alternatives``), anything
outside these dirs. A verifier that itself writes into these dirs (a ``pip install`` into the
system site-packages) is reported too: tests install into ``/tests``.
"""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path

from tmax_jax.sandbox import inotify

PATH_DIRS = ("usr/local/sbin", "usr/local/bin", "usr/sbin", "usr/bin", "sbin", "bin")
# Dirs on the way to the toolchain: replacing or renaming one swaps everything below it.
SPINE = (
    "usr",
    "usr/local",
    "usr/lib",
    "usr/local/lib",
    "usr/lib64",
    "usr/local/lib64",
    "etc",
    "lib",
    "lib64",
)
# What pytest reads from ``/``, the one directory above ``/tests``: a conftest.py (loaded once
# ``/`` is the rootdir) and every config file name pytest 9 looks for (``addopts = -p module`` would
# load a plugin of the agent's).
ROOT_CONFIGS = frozenset(
    {
        "conftest.py",
        "pytest.toml",
        ".pytest.toml",
        "pytest.ini",
        ".pytest.ini",
        "pyproject.toml",
        "tox.ini",
        "setup.cfg",
    }
)
# Imported by ``python3 -m pytest`` or at interpreter start-up, from the site dirs.
PROTECTED_MODULES = frozenset(
    {
        "pytest",
        "_pytest",
        "py",
        "pluggy",
        "iniconfig",
        "packaging",
        "pygments",
        "exceptiongroup",
        "tomli",
        "colorama",
        "sitecustomize",
        "usercustomize",
        "_distutils_hack",
    }
)
_PY_TREE = re.compile(r"^(?:usr/(?:local/)?)?lib(?:64)?/python\d[^/]*")
_LIB_DIR = re.compile(r"(?:usr/)?lib(?:64)?(?:/[^/]+-linux-gnu[^/]*)?|usr/local/lib")
# Configuration (and the modules it names) that the verifier's processes load or interpret at
# start-up: the dynamic loader's, Python's, NSS (a bash with no SHELL looks its user up), PAM, the
# shells' start-up files, readline's, OpenSSL's (``openssl.cnf`` can load a provider), gconv
# (``iconv`` loads the modules its config names), locale and time-zone data (and the message
# catalogs of the C locales, which gettext reads under the verifier's C.UTF-8), ``file``'s magic,
# MIME types (Python's ``mimetypes``), git's system config (``core.fsmonitor`` runs a command).
# Any entry at or below one of these, new, changed or removed, is a change of the verifier's tools.
CONFIG = re.compile(
    r"^(?:etc/(?:ld\.so\.(?:preload|conf|cache|conf\.d)|python\d[^/]*|nsswitch\.conf|host\.conf|gai\.conf"
    r"|pam\.conf|security|environment|profile|profile\.d|bash\.bashrc|bashrc|bash\.bash_logout|inputrc"
    r"|magic|magic\.mime|ssl/openssl\.cnf|localtime|timezone|locale\.gen|locale\.conf|locale\.alias"
    r"|default/locale|mime\.types|gitconfig)"
    r"|usr/lib/locale|usr/share/zoneinfo|usr/share/misc/magic[^/]*|usr/share/file|usr/lib/file|usr/lib/ssl"
    r"|usr/share/locale(?:-langpack)?/(?:C|C\.[^/]*|POSIX|locale\.alias)"
    r"|(?:usr/)?lib(?:64)?(?:/[^/]+-linux-gnu[^/]*)?/(?:gconv|security|ossl-modules|engines-\d+))(?:/|$)"
)
# Dirs on the way to ``CONFIG`` entries (beside ``SPINE`` and the lib dirs): replacing one hides them.
_CONFIG_SPINE = frozenset(
    {"etc/default", "etc/ssl", "usr/share", "usr/share/misc", "usr/share/locale", "usr/share/locale-langpack"}
)
# Dirs whose image entries are the verifier's (a PAM service of the image's programs, the target of
# an image command's ``/etc/alternatives`` link), while new entries configure what the agent added.
_IMAGE_ENTRIES = re.compile(r"^etc/(?:pam\.d|alternatives)(?:/|$)")
_SITE = ("site-packages", "dist-packages")


def _rel_parts(rel: str) -> list[str]:
    return rel.split("/") if rel else []


def _entry_kind(path: str) -> str:
    """'whiteout', 'opaque' (a dir that hides the image's), 'redirect' (a renamed dir), 'dir',
    'symlink', 'linked' (a file with other hard links: it can change under a path nobody watches),
    'file'."""
    st = os.lstat(path)
    if stat.S_ISCHR(st.st_mode) and st.st_rdev == 0:
        return "whiteout"
    if stat.S_ISLNK(st.st_mode):
        return "symlink"
    if not stat.S_ISDIR(st.st_mode):
        return "linked" if st.st_nlink > 1 else "file"
    for ns in ("trusted", "user"):
        for attr, kind in (("opaque", "opaque"), ("redirect", "redirect")):
            try:
                val = os.getxattr(path, f"{ns}.overlay.{attr}", follow_symlinks=False)
            except OSError:
                continue
            if kind == "redirect" or val.strip(b"\0") == b"y":
                return kind
    return "dir"


def _read_small(path: str, limit: int = 1 << 20) -> bytes:
    try:
        st = os.lstat(path)
        if not stat.S_ISREG(st.st_mode):
            return b""
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return b""
    try:
        return os.read(fd, limit)
    finally:
        os.close(fd)


class _Image:
    """The image under the agent's changes (``lowers``, top first) and the command names the tests'
    shell scripts use (``harness``, from ``harness_commands``)."""

    def __init__(self, lowers: list[str], harness: frozenset[str] = frozenset()):
        self.lowers = [lo for lo in lowers if lo]
        self.harness = harness
        self._cmds: set[str] | None = None
        self._base_cmds: set[str] | None = None

    def has(self, rel: str) -> bool:
        return any(os.path.lexists(os.path.join(lo, rel)) for lo in self.lowers)

    def same(self, rel: str, kind: str, full: str) -> bool:
        """Whether the upper dir's ``rel`` (at ``full``) is the image's own entry, unchanged: a
        regular file with the same mode and bytes as the topmost image layer's (copied up by a
        ``touch`` or a rewrite with the same content), or a link to the same target."""
        for lo in self.lowers:
            img = os.path.join(lo, rel)
            try:
                ist, st = os.lstat(img), os.lstat(full)
            except OSError:
                continue
            if _entry_kind(img) == "whiteout":
                return False
            if kind == "symlink" and stat.S_ISLNK(ist.st_mode):
                return os.readlink(img) == os.readlink(full)
            if kind != "file" or not stat.S_ISREG(ist.st_mode) or ist.st_mode != st.st_mode:
                return False
            return ist.st_size == st.st_size <= (1 << 20) and _read_small(img) == _read_small(full)
        return False

    def base_commands(self) -> set[str]:
        """The commands on the verifier's PATH in the base alone (the last, bottom lower: the rootfs
        the task's own build steps were replayed on), not only in a layer the task's Dockerfile made."""
        if self._base_cmds is None:
            self._base_cmds = _path_commands(self.lowers[-1:])
        return self._base_cmds

    def commands(self) -> set[str]:
        if self._cmds is None:
            self._cmds = _path_commands(self.lowers)
        return self._cmds


def _path_commands(lowers: list[str]) -> set[str]:
    """The names in the PATH directories of ``lowers``."""
    out: set[str] = set()
    for lo in lowers:
        for d in PATH_DIRS:
            try:
                out.update(os.listdir(os.path.join(lo, d)))
            except OSError:
                pass
    return out


# Commands a verifier's harness starts (test.sh's interpreter, pytest and its runners); a task's
# build may install them into its own layer (``pip install pytest`` writes /usr/local/bin/pytest).
_HARNESS_NAMES = re.compile(
    r"^(python[\w.+-]*|pip[\w.+-]*|pytest[\w.+-]*|py\.test[\w.+-]*|bash|sh|dash|env|uv|uvx|node|npm|npx|"
    r"timeout|tee|cat|echo|test|\[)$"
)


# How a shell script looks for a command before it picks one (``command -v pytest-3``), and how it
# installs one (``apt-get install -y curl``, ``pip install pytest``).
_LOOKUPS = frozenset({"which", "type", "hash", "-v", "-V"})
_SH_TOKEN = re.compile(r"[;&|(){}`\n]|[^\s;&|(){}`'\"<>]+")
_CMD_NAME = re.compile(r"[A-Za-z0-9_][\w.+-]*")
_PATH_TEST = re.compile(r"-[xfe]")


def _looked_for(text: str) -> set[str]:
    """The command names a shell script looks for or installs: the word after ``command -v``,
    ``which``, ``type`` or ``hash``, the file name of a PATH dir's path it tests with ``-x``/``-f``/
    ``-e``, the words of a ``for ... in`` list (``for c in pytest-3 pytest; do command -v $c``), and
    the names after ``install`` (a package of that name installs a command of that name, later on
    PATH than ``/usr/local/bin``). Quotes are ignored; an over-approximation."""
    out: set[str] = set()
    for line in text.splitlines():
        line = re.sub(r"(^|\s)#.*", "", line)
        toks = _SH_TOKEN.findall(line)
        mode = None  # 'lookup': the next name; 'list': names up to a separator; 'install': likewise
        for i, tok in enumerate(toks):
            if len(tok) == 1 and tok in ";&|(){}`":
                mode = None
                continue
            if tok in _LOOKUPS and (tok[0] != "-" or (i and toks[i - 1] == "command")):
                mode = "lookup"
                continue
            if tok == "in" and i >= 2 and toks[i - 2] == "for":
                mode = "list"
                continue
            if tok == "install":
                mode = "install"
                continue
            if _PATH_TEST.fullmatch(tok) and i + 1 < len(toks) and _path_dir_of(toks[i + 1].lstrip("/")):
                out.add(toks[i + 1].rsplit("/", 1)[1])
                continue
            if mode is None or tok.startswith("-"):
                continue
            name = re.split(r"[=<>~!\[@]", tok, maxsplit=1)[0]  # pytest==8.4, pkg[extra]
            if _CMD_NAME.fullmatch(name):
                out.add(name)
            if mode == "lookup":
                mode = None
    return out


def harness_commands(
    tests: str | os.PathLike, max_files: int = 200, max_bytes: int = 1 << 20
) -> frozenset[str]:
    """The command names the tests' shell scripts (``*.sh``, or a ``#!`` naming a shell) look for or
    install (``_looked_for``): a new command on the verifier's PATH by one of these names would come
    before what the tests meant to run (``command -v pytest-3 && pytest-3 || python3 -m pytest``;
    a ``curl`` that test.sh installs into /usr/bin). A new command the tests just run is the
    agent's (a tool the task asked for), as under Docker."""
    out: set[str] = set()
    seen = 0
    for root, dirs, files in os.walk(tests):
        dirs[:] = sorted(d for d in dirs if not os.path.islink(os.path.join(root, d)))
        for name in sorted(files):
            path = os.path.join(root, name)
            data = _read_small(path, max_bytes)
            first = data.split(b"\n", 1)[0]
            if not (name.endswith(".sh") or (first.startswith(b"#!") and b"sh" in first)):
                continue
            seen += 1
            if seen > max_files:
                return frozenset(out)
            out |= _looked_for(data.decode("utf-8", "replace"))
    return frozenset(out)


def _harness_command(name: str, rel: str, image: _Image) -> bool:
    """Whether a command made by the task's build is part of the verifier's harness: a known name,
    or a console script that starts pytest or its plugins."""
    if _HARNESS_NAMES.match(name):
        return True
    for lo in image.lowers[:-1]:
        head = _read_small(os.path.join(lo, rel), 4096)
        if b"pytest" in head or b"pluggy" in head:
            return True
    return False


def _path_dir_of(rel: str) -> str | None:
    for d in PATH_DIRS:
        if rel.startswith(d + "/") and "/" not in rel[len(d) + 1 :]:
            return d
    return None


def _site_rest(rel: str) -> str | None:
    """The path inside a Python site dir ('' for the site dir itself), None outside any."""
    m = _PY_TREE.match(rel)
    if not m:
        return None
    parts = _rel_parts(rel[m.end() :].lstrip("/"))
    if parts and parts[0] in _SITE:
        return "/".join(parts[1:])
    return None


def _module_stem(name: str) -> str:
    return name.split(".", 1)[0].split("-", 1)[0]


def protected(rel: str, is_dir: bool = False) -> bool:
    """Any change at ``rel`` while the verifier runs counts as tampering.

    The dirs on the way (``usr``, ``usr/bin``, ...) are not: writing anywhere below one copies it
    up, and removing or replacing one leaves a whiteout or an opaque dir that ``scan`` reports.
    """
    if rel in ROOT_CONFIGS:
        return True
    if rel in SPINE or rel in PATH_DIRS or _LIB_DIR.fullmatch(rel):
        return False
    if _path_dir_of(rel) or _PY_TREE.match(rel) or CONFIG.match(rel) or _IMAGE_ENTRIES.match(rel):
        return True
    parent = rel.rsplit("/", 1)[0] if "/" in rel else ""
    return not is_dir and bool(_LIB_DIR.fullmatch(parent))


def _toolchain_dir(rel: str) -> bool:
    """A dir of the toolchain itself: if it appears in the upper dir, something is being written there."""
    if rel in SPINE:
        return False
    return bool(
        rel in PATH_DIRS
        or _PY_TREE.match(rel)
        or CONFIG.match(rel)
        or _IMAGE_ENTRIES.match(rel)
        or _LIB_DIR.fullmatch(rel)
    )


def _static_reason(rel: str, kind: str, full: str, image: _Image) -> str | None:
    where = "/" + rel
    if rel in ROOT_CONFIGS:
        return f"{where} was written (pytest reads it above /tests)"
    if CONFIG.match(rel):
        if kind == "dir" or image.same(rel, kind, full):
            return None
        return f"{where} was changed (configuration or modules the verifier's tools load at start-up)"
    if _IMAGE_ENTRIES.match(rel):
        return _image_entry_reason(rel, kind, full, image)
    dir_like = (
        rel in SPINE
        or rel in _CONFIG_SPINE
        or rel in PATH_DIRS
        or _LIB_DIR.fullmatch(rel) is not None
        or _PY_TREE.fullmatch(rel) is not None
        or _site_rest(rel) == ""
    )
    if dir_like:
        return None if kind == "dir" else f"{where} was replaced, renamed or removed ({kind})"
    pdir = _path_dir_of(rel)
    if pdir:
        name = rel.rsplit("/", 1)[1]
        if image.has(rel):
            # A command only the task's own build made (a wrapper script the instruction may ask
            # the agent to fix) is task content, as under Docker, unless the verifier's harness
            # starts it or it stands in for a command of the base.
            if name in image.base_commands() or _harness_command(name, rel, image):
                return (
                    f"{where} (a command of the image) was {'removed' if kind == 'whiteout' else 'changed'}"
                )
            return None
        if kind != "whiteout" and name in image.commands():
            return f"{where} shadows the image's {name!r} on the verifier's PATH"
        if kind != "whiteout" and (name in image.harness or _HARNESS_NAMES.match(name)):
            return f"{where} is a new command the verifier's harness may run in place of its own ({name!r})"
        if name == "pyvenv.cfg" or name.endswith("._pth"):
            return f"{where} redirects the Python interpreter's prefix"
        return None
    site = _site_rest(rel)
    if site is not None:
        parts = _rel_parts(site)
        top = parts[0]
        if top == "__pycache__" and len(parts) > 1:
            top = parts[1]
        if _module_stem(top) in PROTECTED_MODULES:
            return f"{where} changes a module the verifier's Python or pytest loads"
        if top.endswith(".pth"):
            return f"{where} is start-up code for every Python process"
        if top.endswith((".dist-info", ".egg-info")):
            # Package metadata is read through links: one pointing at the agent's files could
            # register a pytest plugin after the checks.
            if kind in ("symlink", "linked"):
                return f"{where} is a link (package metadata must be plain files)"
            if len(parts) == 2 and parts[1] == "entry_points.txt" and b"pytest11" in _read_small(full):
                return f"{where} registers a pytest plugin"
        return None
    m = _PY_TREE.match(rel)
    if m:
        return f"{where} is in the Python standard library"
    if "/" in rel and kind != "dir":
        parent = rel.rsplit("/", 1)[0]
        if _LIB_DIR.fullmatch(parent) and (kind == "whiteout" or image.has(rel)):
            return f"{where} (a library of the image) was {'removed' if kind == 'whiteout' else 'changed'}"
        if _LIB_DIR.fullmatch(parent) and rel.rsplit("/", 1)[1].startswith("libnss_"):
            return f"{where} is a new NSS module (glibc loads the modules nsswitch.conf names by name)"
    return None


def _image_entry_reason(rel: str, kind: str, full: str, image: _Image) -> str | None:
    """``/etc/pam.d`` and ``/etc/alternatives``: an image entry changed or removed, the dir itself
    replaced, or a new PAM service that the image's programs would open (``other``, the
    ``common-*`` files the image's services include, or a command of the image)."""
    where = "/" + rel
    parts = rel.split("/")
    if len(parts) == 2:
        if kind == "dir":
            return None
        return f"{where} was replaced, renamed or removed ({kind})"
    if image.has(rel):
        if kind == "dir" or image.same(rel, kind, full):
            return None
        return f"{where} (configuration of the image's programs) was {'removed' if kind == 'whiteout' else 'changed'}"
    name = parts[2]
    if parts[1] == "pam.d" and (name == "other" or name.startswith("common-") or name in image.commands()):
        return f"{where} is a new PAM configuration that the image's programs would read"
    return None


def _descend(rel: str) -> bool:
    if rel == "" or rel in SPINE or rel in PATH_DIRS or _PY_TREE.match(rel) or CONFIG.match(rel):
        return True
    return rel in _CONFIG_SPINE or bool(_IMAGE_ENTRIES.match(rel)) or _LIB_DIR.fullmatch(rel) is not None


def scan(upper: str | os.PathLike, lowers: list[str], tests: str | os.PathLike | None = None) -> str | None:
    """The first toolchain change found in the upper dir ``upper`` (None: none). ``tests``: the
    verifier's copy of the tests, whose shell scripts name the commands its harness runs."""
    upper = str(upper)
    image = _Image(lowers, harness_commands(tests) if tests is not None else frozenset())
    todo = [""]
    while todo:
        rel = todo.pop()
        try:
            names = sorted(os.listdir(os.path.join(upper, rel)))
        except OSError:
            continue
        for name in names:
            child = f"{rel}/{name}" if rel else name
            full = os.path.join(upper, child)
            try:
                kind = _entry_kind(full)
            except OSError:
                continue
            reason = _static_reason(child, kind, full, image)
            if reason:
                return reason
            if kind in ("dir", "opaque", "redirect") and _descend(child):
                todo.append(child)
    return None


# ---- inotify -------------------------------------------------------------------------------------
_MASK = (
    inotify.IN_MODIFY
    | inotify.IN_ATTRIB
    | inotify.IN_CLOSE_WRITE
    | inotify.IN_MOVED_FROM
    | inotify.IN_MOVED_TO
    | inotify.IN_CREATE
    | inotify.IN_DELETE
    | inotify.IN_DELETE_SELF
    | inotify.IN_MOVE_SELF
    | inotify.IN_ONLYDIR
    | inotify.IN_DONT_FOLLOW
)


class Watch(inotify.EventWatch):
    """Records changes to the toolchain dirs of an upper dir from ``start()`` to ``stop()``.

    ``stop()`` returns the first change found (a reason) or None. Dirs that appear while watching
    are watched from then on and their content checked, so a dir made and filled between two reads
    is still seen.
    """

    what = "the verifier's toolchain"
    thread_name = "tmax-toolchain-watch"

    def __init__(self, upper: str | os.PathLike):
        super().__init__()
        self.upper = str(upper)

    def _add(self, rel: str, appeared: bool) -> None:
        full = os.path.join(self.upper, rel) if rel else self.upper
        wd = self.add_watch(full, _MASK, f"/{rel} for changes")
        if wd is None:
            return
        self._wd[wd] = rel
        try:
            names = os.listdir(full)
        except OSError:
            return
        for name in names:
            child = f"{rel}/{name}" if rel else name
            is_dir = os.path.isdir(os.path.join(self.upper, child))
            if appeared and (protected(child, is_dir) or (is_dir and _toolchain_dir(child))):
                self._flag(f"/{child} appeared while the verifier ran")
            if _descend(child) and os.path.isdir(os.path.join(self.upper, child)):
                if not os.path.islink(os.path.join(self.upper, child)):
                    self._add(child, appeared)

    def _begin(self) -> None:
        self._add("", appeared=False)

    def _event(self, base: str, mask: int, name: str) -> None:
        if not name:
            if mask & (inotify.IN_DELETE_SELF | inotify.IN_MOVE_SELF) and protected(base, True):
                self._flag(f"/{base} was removed or moved while the verifier ran")
            return
        rel = f"{base}/{name}" if base else name
        if protected(rel, bool(mask & inotify.IN_ISDIR)):
            self._flag(f"/{rel} changed while the verifier ran")
        if mask & inotify.IN_ISDIR and mask & (inotify.IN_CREATE | inotify.IN_MOVED_TO):
            if _toolchain_dir(rel):
                self._flag(f"/{rel} appeared while the verifier ran")
            if _descend(rel):
                self._add(rel, appeared=True)


def lower_dirs(lower_dir_field: str) -> list[str]:
    """podman's ``GraphDriver.Data.LowerDir`` (colon-separated) as a list of existing dirs."""
    return [p for p in lower_dir_field.split(":") if p and Path(p).is_dir()]


# ---- modules that would shadow pytest from a working directory --------------------------------
# A verifier's Python puts its working directory (``python3 -m``) or its script's directory first on
# sys.path, as under Docker (tests run ``python3 -m reconciler`` from /app). What the agent left
# there must then not stand in for pytest or the interpreter's start-up modules.
_SHADOW_NAMES = frozenset(
    PROTECTED_MODULES - {"packaging", "pygments", "colorama", "tomli", "exceptiongroup"}
)
_SHADOW_SKIP = frozenset({"site-packages", "dist-packages", "node_modules", ".git", "__pycache__"})
_SHADOW_TOP_SKIP = frozenset(
    {
        "usr",
        "etc",
        "lib",
        "lib32",
        "lib64",
        "libx32",
        "bin",
        "sbin",
        "proc",
        "sys",
        "dev",
        "tests",
        "logs",
        ".tmax",
    }
)


def shadow_scan(root: str | os.PathLike, max_depth: int = 8, max_entries: int = 200_000) -> str | None:
    """The first module under ``root`` (the agent's files outside the toolchain dirs) that, found
    first on a verifier's sys.path, would replace pytest, its plugin machinery or a start-up hook:
    ``pytest.py``/``pytest.*.so``, a ``pytest/`` package (with ``__init__.py`` or ``__main__.py``;
    a bare namespace dir never wins over the installed package), ``sitecustomize.py``, ... Virtual
    environments' site dirs are skipped (only their own interpreter reads them). Also a pytest
    config or conftest.py at the top (``ROOT_CONFIGS``), as a file or a link."""
    root = str(root)
    todo = [("", 0)]
    seen = 0
    while todo:
        rel, depth = todo.pop()
        try:
            entries = list(os.scandir(os.path.join(root, rel)))
        except OSError:
            continue
        for e in entries:
            seen += 1
            if seen > max_entries:
                return None
            child = f"{rel}/{e.name}" if rel else e.name
            stem = _module_stem(e.name)
            try:
                is_dir = e.is_dir(follow_symlinks=False)
            except OSError:
                continue
            if depth == 0 and e.name in ROOT_CONFIGS and not is_dir:
                # A file or a link of any kind: bwrap's verifier root rebuilds top-level links.
                return f"/{child} was written (pytest reads it above /tests)"
            if is_dir:
                if (
                    stem in _SHADOW_NAMES
                    and "." not in e.name
                    and any(os.path.lexists(os.path.join(e.path, f)) for f in ("__init__.py", "__main__.py"))
                ):
                    return f"/{child} is a package that would shadow {e.name!r} for the verifier's Python"
                if (
                    depth < max_depth
                    and e.name not in _SHADOW_SKIP
                    and not (depth == 0 and e.name in _SHADOW_TOP_SKIP)
                ):
                    todo.append((child, depth + 1))
            elif stem in _SHADOW_NAMES and e.name.endswith((".py", ".pyc", ".so", ".pth")):
                return f"/{child} would shadow {stem!r} for the verifier's Python"
    return None
