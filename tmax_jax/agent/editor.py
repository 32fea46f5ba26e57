"""A file editor for agents, working through the sandbox shell (OpenHands' ``str_replace_editor`` style).

Commands: ``view`` (a file with line numbers, optionally a ``view_range``; a directory two levels
deep), ``create`` (a new file; an existing one is refused), ``str_replace`` (``old_str`` must occur
exactly once), ``insert`` (``new_str`` after line ``insert_line``, 0 = the top) and ``undo_edit``
(the file as it was before its last edit; undoing a create removes the file). Paths are absolute.

Files move as base64 through ``shell.run``, so the editor needs only ``base64`` in the sandbox and
works on every backend; the edit logic runs here. A bad request returns an ``EditorError`` whose
message is the tool's answer to the model.
"""

from __future__ import annotations

import base64
import binascii
import shlex
from typing import Any

from tmax_jax.errors import TmaxError

# Base64 of the largest file must pass the shell's output cap (1 MiB by default) whole.
MAX_FILE_BYTES = 256 << 10
SNIPPET_LINES = 4
COMMANDS = ("view", "create", "str_replace", "insert", "undo_edit")


class EditorError(TmaxError):
    """The request cannot be done; the message says why (shown to the model)."""


def numbered(lines: list[str], first: int = 1) -> str:
    """``cat -n`` style: the line number right-aligned in 6 columns, a tab, the line."""
    return "\n".join(f"{i:6}\t{line}" for i, line in enumerate(lines, first))


class FileEditor:
    def __init__(self, shell: Any, timeout: float = 30.0):
        self.shell = shell
        self.timeout = timeout
        self.history: dict[str, list[str | None]] = {}  # path -> earlier contents (None: absent)

    # ---- the sandbox side ------------------------------------------------------------------------
    def _run(self, command: str) -> str:
        res = self.shell.run(command, timeout=self.timeout)
        out = getattr(res, "output", None)
        if out is None:
            out = getattr(res, "stdout", "") or ""
        return out

    def _kind(self, path: str) -> str:
        q = shlex.quote(path)
        out = self._run(f"if [ -d {q} ]; then echo dir; elif [ -f {q} ]; then echo file; else echo none; fi")
        return out.strip().splitlines()[-1] if out.strip() else "none"

    def _read(self, path: str) -> str:
        q = shlex.quote(path)
        out = self._run(
            f"if ! s=$(stat -c %s {q} 2>/dev/null) || [ ! -r {q} ]; then echo __ERR unreadable; "
            f'elif [ "$s" -gt {MAX_FILE_BYTES} ]; then echo "__ERR too large ($s bytes)"; '
            f"else echo __OK; base64 -w0 < {q}; echo; fi"
        )
        head, _, body = out.partition("\n")
        if head.startswith("__ERR"):
            raise EditorError(f"cannot read {path}: {head[6:]}")
        if not head.startswith("__OK"):
            raise EditorError(f"cannot read {path}: {out.strip()[:200]}")
        try:
            raw = base64.b64decode(body.strip(), validate=True)
        except binascii.Error as e:
            raise EditorError(f"cannot read {path}: its content did not come back whole") from e
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise EditorError(f"{path} is not a UTF-8 text file; use bash to inspect it") from e

    def _write(self, path: str, text: str) -> None:
        q = shlex.quote(path)
        blob = base64.b64encode(text.encode()).decode()
        parent = shlex.quote(path.rsplit("/", 1)[0] or "/")
        out = self._run(
            f"mkdir -p {parent} && base64 -d > {q} <<'__TMAX_EDIT_EOF'\n{blob}\n__TMAX_EDIT_EOF\necho __rc=$?"
        )
        if "__rc=0" not in out:
            raise EditorError(f"cannot write {path}: {out.replace('__rc=', 'exit ').strip()[:200]}")

    # ---- commands --------------------------------------------------------------------------------
    def __call__(self, command: str, path: str, **kw: Any) -> str:
        if command not in COMMANDS:
            raise EditorError(f"unknown command '{command}'; use one of {', '.join(COMMANDS)}")
        if not isinstance(path, str) or not path.startswith("/"):
            raise EditorError(f"path must be absolute (start with /), got {path!r}")
        path = path.rstrip("/") or "/"
        return getattr(self, command)(path, **kw)

    def view(self, path: str, view_range: Any = None, **_: Any) -> str:
        kind = self._kind(path)
        if kind == "none":
            raise EditorError(f"{path} does not exist")
        if kind == "dir":
            if view_range is not None:
                raise EditorError("view_range applies to files, not directories")
            q = shlex.quote(path)
            listing = self._run(f"find {q} -maxdepth 2 -not -path '*/.*' | sort | head -n 400")
            return f"Files and directories up to 2 levels deep in {path}:\n{listing.rstrip()}"
        lines = self._read(path).split("\n")
        if lines and lines[-1] == "":
            lines.pop()
        first, last = 1, len(lines)
        if view_range is not None:
            first, last = _range(view_range, len(lines))
        return f"{path} (lines {first}-{last} of {len(lines)}):\n{numbered(lines[first - 1 : last], first)}"

    def create(self, path: str, file_text: Any = None, **_: Any) -> str:
        if file_text is None:
            raise EditorError("create needs file_text")
        kind = self._kind(path)
        if kind != "none":
            raise EditorError(f"{path} already exists; edit it with str_replace or insert")
        self._write(path, str(file_text))
        self.history.setdefault(path, []).append(None)
        return f"Created {path} ({len(str(file_text).splitlines())} lines)."

    def str_replace(self, path: str, old_str: Any = None, new_str: Any = None, **_: Any) -> str:
        if not old_str:
            raise EditorError("str_replace needs a non-empty old_str")
        old_str, new_str = str(old_str), "" if new_str is None else str(new_str)
        text = self._file_text(path)
        count = text.count(old_str)
        if count == 0:
            raise EditorError(f"old_str does not occur verbatim in {path}; nothing replaced (view the file)")
        if count > 1:
            starts, at = [], text.find(old_str)
            while at >= 0:
                starts.append(text.count("\n", 0, at) + 1)
                at = text.find(old_str, at + 1)
            raise EditorError(
                f"old_str occurs {count} times in {path} (lines {', '.join(map(str, starts))}); "
                "include more context so it is unique"
            )
        at = text.find(old_str)
        new = text[:at] + new_str + text[at + len(old_str) :]
        self._write(path, new)
        self.history.setdefault(path, []).append(text)
        line = text.count("\n", 0, at) + 1
        return f"Edited {path}.\n{_snippet(new, line, new_str.count(chr(10)) + 1)}"

    def insert(self, path: str, insert_line: Any = None, new_str: Any = None, **_: Any) -> str:
        if new_str is None:
            raise EditorError("insert needs new_str")
        text = self._file_text(path)
        lines = text.splitlines(keepends=True)
        try:
            n = int(insert_line)
        except (TypeError, ValueError) as e:
            raise EditorError(f"insert_line must be a line number, got {insert_line!r}") from e
        if not 0 <= n <= len(lines):
            raise EditorError(f"insert_line {n} is outside the file (0..{len(lines)})")
        add = str(new_str)
        if not add.endswith("\n"):
            add += "\n"
        if n == len(lines) and lines and not lines[-1].endswith("\n"):
            lines[-1] += "\n"
        new = "".join(lines[:n]) + add + "".join(lines[n:])
        self._write(path, new)
        self.history.setdefault(path, []).append(text)
        return f"Inserted after line {n} of {path}.\n{_snippet(new, n + 1, add.count(chr(10)))}"

    def undo_edit(self, path: str, **_: Any) -> str:
        stack = self.history.get(path)
        if not stack:
            raise EditorError(f"no edit of {path} to undo")
        before = stack.pop()
        if before is None:
            self._run(f"rm -f {shlex.quote(path)}")
            return f"Undid the creation of {path} (removed)."
        self._write(path, before)
        lines = before.split("\n")
        if lines and lines[-1] == "":
            lines.pop()
        return f"Restored {path} to before its last edit:\n{numbered(lines)}"

    def _file_text(self, path: str) -> str:
        kind = self._kind(path)
        if kind != "file":
            raise EditorError(f"{path} {'is a directory' if kind == 'dir' else 'does not exist'}")
        return self._read(path)


def _range(view_range: Any, n: int) -> tuple[int, int]:
    if not isinstance(view_range, (list, tuple)) or len(view_range) != 2:
        raise EditorError(f"view_range must be [first, last], got {view_range!r}")
    try:
        first, last = int(view_range[0]), int(view_range[1])
    except (TypeError, ValueError) as e:
        raise EditorError(f"view_range must hold two line numbers, got {view_range!r}") from e
    if last == -1:
        last = n
    if not 1 <= first <= max(n, 1) or last < first or last > n:
        raise EditorError(f"view_range {view_range} is outside the file's lines 1..{n}")
    return first, last


def _snippet(text: str, line: int, span: int) -> str:
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    first = max(1, line - SNIPPET_LINES)
    last = min(len(lines), line + max(span, 1) - 1 + SNIPPET_LINES)
    return numbered(lines[first - 1 : last], first)
