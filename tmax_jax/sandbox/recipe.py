"""Environment recipes: a Dockerfile subset and Apptainer ``.def`` files parsed into build steps.

The bwrap backend cannot run a real image build, so a recipe is reduced to steps it can replay in a
sandbox over the read-only rootfs: FROM (mapped to a local rootfs), RUN, COPY/ADD (local files and
archives), WORKDIR, ENV, ARG, SHELL and USER, BuildKit heredocs (``RUN <<EOF``, ``COPY <<EOF /path``).

What the replay cannot express as its four step kinds (run, copy, workdir, env) is rewritten into a
RUN step here: a heredoc file becomes a shell write, a local archive ``ADD`` a copy plus ``tar -x``,
``SHELL`` and ``USER`` a wrapper around each later RUN (``setpriv`` to the user, as root of the
sandbox holds CAP_SETUID inside its own namespace). Variables expand as Docker does, over the base
image's defaults (``PATH``, ``HOME``) rather than over nothing. Instructions that only describe how a
container is launched (CMD, ENTRYPOINT, EXPOSE, LABEL, ...) are recorded and ignored; anything that
cannot be honoured is a TaskFormatError naming the file, line and instruction.
"""

from __future__ import annotations

import base64
import json
import posixpath
import re
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from tmax_jax.errors import TaskFormatError
from tmax_jax.sandbox.base import BASE_PATH

IGNORED = {"CMD", "ENTRYPOINT", "EXPOSE", "LABEL", "MAINTAINER", "STOPSIGNAL", "HEALTHCHECK"}
UNSUPPORTED = {"VOLUME", "ONBUILD"}
# What ``${PATH}`` and ``${HOME}`` mean in a Dockerfile: the base image's values, not the empty string
# (``ENV PATH=/opt/x:${PATH}`` would otherwise leave the next RUN without mkdir).
DEFAULT_BASE_ENV = {"PATH": BASE_PATH, "HOME": "/root"}
DEFAULT_SHELL = ("/bin/bash", "-c")
# RUN flags that change nothing a replay keeps: a cache mount only speeds a build up; the network
# flags are moot (build steps that download are found and reported by the availability check).
_HARMLESS_RUN_FLAGS = re.compile(r"^--(mount=(type=cache|type=tmpfs)\b.*|network=.*|security=sandbox)$")
# A heredoc opener (<<EOF, <<-"EOF", <<'EOF'): delimiter in group 3 (also read by the eval
# environment check).
HEREDOC = re.compile(r"(?<!<)<<(-?)\s*([\"']?)([A-Za-z_][\w.-]*)\2")
_ARCHIVE = re.compile(r"\.(tar|tgz|tbz2?|txz|tar\.(gz|bz2|xz|zst))$")


@dataclass(frozen=True)
class Step:
    """kind: run | copy | workdir | env. ``args`` holds the step's data (see ``parse_dockerfile``)."""

    kind: str
    args: tuple[str, ...]
    line: int = 0
    source: str = ""


@dataclass
class Recipe:
    """``user``: the Dockerfile's last USER (what the container, so the agent, would run as)."""

    base: str = "ubuntu:24.04"
    steps: list[Step] = field(default_factory=list)
    context: Path | None = None
    ignored: list[str] = field(default_factory=list)
    user: str = "root"

    def key_data(self) -> list:
        return [self.base, [(s.kind, list(s.args)) for s in self.steps]]


@dataclass(frozen=True)
class Instruction:
    line: int
    name: str  # upper-cased
    rest: str
    source: str
    heredocs: tuple[tuple[str, bool, str], ...] = ()  # (delimiter, quoted, body)


def instructions(text: str, where: Path | str = "Dockerfile") -> list[Instruction]:
    """Logical instructions: continuations joined, comments dropped, heredoc bodies attached."""
    lines = text.splitlines()
    out: list[Instruction] = []
    buf, start, i = "", 0, 0
    while i < len(lines):
        line = lines[i].rstrip()
        i += 1
        if not buf and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if buf and line.lstrip().startswith("#"):
            continue  # comment lines inside a continuation are dropped, as Docker does
        if not buf:
            start = i
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        joined = (buf + line).strip()
        buf = ""
        name, _, rest = joined.partition(" ")
        name, rest = name.upper(), rest.strip()
        docs = []
        if name in ("RUN", "COPY", "ADD"):
            for m in HEREDOC.finditer(rest):
                strip_tabs, quoted, delim = m.group(1) == "-", bool(m.group(2)), m.group(3)
                body = []
                while True:
                    if i >= len(lines):
                        raise TaskFormatError(
                            f"{where}:{start}: heredoc <<{delim} of {name} has no closing {delim} line"
                        )
                    raw = lines[i]
                    i += 1
                    if (raw.lstrip("\t") if strip_tabs else raw).rstrip("\r") == delim:
                        break
                    body.append(raw.lstrip("\t") if strip_tabs else raw)
                docs.append((delim, quoted, "\n".join(body) + "\n" if body else ""))
        out.append(Instruction(start, name, rest, joined, tuple(docs)))
    if buf:
        name, _, rest = buf.strip().partition(" ")
        out.append(Instruction(start, name.upper(), rest.strip(), buf.strip()))
    return out


_VAR = re.compile(r"\\\$|\$(\w+)|\$\{(\w+)(?::([-+])([^}]*))?\}")


def _subst(s: str, env: Mapping[str, str]) -> str:
    """Docker's variable expansion: ``$X``, ``${X}``, ``${X:-default}``, ``${X:+word}``, ``\\$``."""

    def one(m: re.Match) -> str:
        if m.group(0) == "\\$":
            return "$"
        name = m.group(1) or m.group(2)
        val = env.get(name, "")
        if m.group(3) == "-":
            return val or _subst(m.group(4), env)
        if m.group(3) == "+":
            return _subst(m.group(4), env) if val else ""
        return val

    return _VAR.sub(one, s)


def _json_or_words(rest: str) -> list[str]:
    if rest.startswith("["):
        try:
            v = json.loads(rest)
        except ValueError:
            v = None
        if isinstance(v, list) and all(isinstance(x, str) for x in v):
            return v
    return shlex.split(rest)


def _as_user(user: str, cmd_argv: list[str], explicit_home: bool) -> str:
    """A shell line that runs ``cmd_argv`` as Docker's ``USER user[:group]`` would.

    As in Docker: a named user takes its primary group and supplementary groups from the image's
    /etc/passwd and /etc/group; a bare uid without an entry runs with gid 0; HOME is the user's home
    unless the Dockerfile set HOME itself.
    """
    name, _, group = user.partition(":")
    q = shlex.quote(name)
    gid = shlex.quote(group) if group else f'"$(id -g {q} 2>/dev/null || echo 0)"'
    groups = "--clear-groups" if name.isdigit() or group else "--init-groups"
    setpriv = f"exec /usr/bin/setpriv --reuid={q} --regid={gid} {groups} -- {shlex.join(cmd_argv)}"
    if explicit_home:
        return setpriv
    return f'HOME="$(getent passwd {q} | cut -d: -f6)"; export HOME="${{HOME:-/}}"; {setpriv}'


def as_user_line(user: str, cmd_argv: list[str], explicit_home: bool) -> str:
    """``cmd_argv`` as a shell line run as ``USER user[:group]`` (the agent's commands, at run time)."""
    return _as_user(user, cmd_argv, explicit_home)


def _is_root(user: str) -> bool:
    name, _, group = user.partition(":")
    return name in ("root", "0") and group in ("", "root", "0")


class _Stage:
    """What a RUN step is wrapped in: build arguments, SHELL and USER in force."""

    def __init__(self, shell: tuple[str, ...] = DEFAULT_SHELL):
        self.args: dict[str, str] = {}
        self.shell = shell
        self.user = "root"
        self.explicit_home = False

    def run_line(self, script: str | None, argv: list[str] | None = None) -> str:
        """The shell line for a RUN of ``script`` (shell form) or ``argv`` (exec form)."""
        exports = "".join(f"export {k}={shlex.quote(v)}; " for k, v in self.args.items())
        if argv is None:
            if self.shell == DEFAULT_SHELL and _is_root(self.user):
                return exports + script if exports else script
            argv = [*self.shell, script]
        elif _is_root(self.user):
            return exports + shlex.join(argv) if exports else shlex.join(argv)
        if _is_root(self.user):
            return exports + f"exec {shlex.join(argv)}"
        return exports + _as_user(self.user, argv, self.explicit_home)


def _write_file_step(dest: str, content: str, mode: str | None, lineno: int, source: str) -> Step:
    """A RUN step writing ``content`` at ``dest`` (relative to the WORKDIR, as COPY's destination)."""
    blob = base64.b64encode(content.encode()).decode()
    q = shlex.quote(dest)
    cmd = f'mkdir -p "$(dirname {q})" && printf %s {blob} | base64 -d > {q}'
    if mode:
        cmd += f" && chmod {shlex.quote(mode)} {q}"
    return Step("run", (cmd,), lineno, source)


STAGE_STASH = "/tmp/tmax-stage"


# Top-level paths a build stage's cleanup never touches: the kernel's, the stash's, the sandbox's own.
_STAGE_KEEP = ("/proc", "/dev", "/sys", "/tmp", "/.tmax")
DEFAULT_READ_ONLY = ("/usr", "/etc", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")


class _Stages:
    """Multi-stage builds on one rootfs: an earlier stage's steps run first, isolated (its ENV and
    WORKDIR inlined into its own RUN steps, never the image's), then what a later ``COPY --from``
    takes is moved aside under ``STAGE_STASH/<n>`` and everything else the stage wrote (anywhere
    outside the read-only base) is removed, so the next stage starts from the bare base, as Docker's
    does; ``COPY --from=<stage>`` copies out of the stash (a path the stage never wrote is the base's
    own, the same rootfs). Stages nothing refers to are skipped, as BuildKit skips them."""

    def __init__(self, text_instructions: list[Instruction], read_only: tuple[str, ...]):
        self.keep_top = tuple(sorted({*_STAGE_KEEP, *(p for p in read_only if p.count("/") == 1)}))
        self.used = False
        self.names: dict[str, int] = {}  # stage name or index -> stage number
        self.referenced: set[str] = set()
        self.copied: dict[str, list[str]] = {}  # stage name -> the absolute paths copied out of it
        for ins in text_instructions:
            for m in re.finditer(r"--from=(\S+)", ins.rest if ins.name in ("COPY", "ADD") else ""):
                ref = m.group(1).lower()
                self.referenced.add(ref)
                try:
                    words = [w for w in _json_or_words(ins.rest) if not w.startswith("--")]
                except ValueError:
                    continue
                self.copied.setdefault(ref, []).extend(
                    posixpath.normpath(posixpath.join("/", w)) for w in words[:-1]
                )
            if ins.name == "FROM":
                words = [w for w in ins.rest.split() if not w.startswith("--")]
                if words:
                    self.referenced.add(words[0].lower())
        self.count = 0
        self.current_names: list[str] = []

    def stash(self, n: int) -> str:
        return f"{STAGE_STASH}/{n}"

    def needed(self) -> bool:
        return any(name in self.referenced for name in self.current_names)

    def isolate(self, steps: list[Step], n: int) -> list[Step]:
        """The finished stage ``n``'s steps, rewritten to leave nothing in the image."""
        out: list[Step] = []
        env: dict[str, str] = {}
        wd = "/"
        for st in steps:
            if st.kind == "env":
                env[st.args[0]] = st.args[1]
            elif st.kind == "workdir":
                wd = posixpath.normpath(posixpath.join(wd, st.args[0]))
                out.append(Step("run", (f"mkdir -p {shlex.quote(wd)}",), st.line, st.source))
            elif st.kind == "copy":
                dest = st.args[-1]
                full = posixpath.join(wd, dest) + ("/" if dest.endswith("/") and dest != "/" else "")
                out.append(Step("copy", (*st.args[:-1], full), st.line, st.source))
            else:
                exports = "".join(f"export {k}={shlex.quote(v)}; " for k, v in env.items())
                cmd = f"cd {shlex.quote(wd)} || exit 1; {exports}{st.args[0]}"
                out.append(Step(st.kind, (cmd, *st.args[1:]), st.line, st.source))
        # Only what a later COPY --from takes is kept; everything else the stage wrote is removed.
        # Top-level dirs stay (a sandbox starts with some); -xdev and the ignored errors leave
        # read-only mounts inside the root (the host Python under /root) alone.
        self.used = True
        srcs = sorted({src for name in self.current_names for src in self.copied.get(name, ())})
        keep = " ".join(shlex.quote(x) for x in srcs)
        stash = shlex.quote(self.stash(n))
        skip = "|".join(shlex.quote(x) for x in self.keep_top)
        out.append(
            Step(
                "run",
                (
                    f'mkdir -p {stash} || exit 1; for s in {keep}; do if [ -e "$s" ] || [ -L "$s" ]; then '
                    f'mkdir -p "$(dirname {stash}"$s")" && cp -a "$s" {stash}"$s" || exit 1; fi; done; '
                    f'for e in /* /.[!.]*; do case "$e" in {skip}) continue;; esac; '
                    f'if [ -d "$e" ] && [ ! -L "$e" ]; then find "$e" -xdev -mindepth 1 -delete 2>/dev/null; '
                    f'else rm -f "$e"; fi; done; '
                    f"find /tmp -xdev -mindepth 1 -maxdepth 1 ! -name {shlex.quote(posixpath.basename(STAGE_STASH))} "
                    "-exec rm -rf {} + 2>/dev/null; true",
                ),
                steps[-1].line if steps else 0,
                f"end of build stage {n}",
            )
        )
        # Where the builder can, the next stage also starts in a fresh build sandbox (with only the
        # stash carried over): what the stage changed in the copy-on-write base dirs (/usr, /etc),
        # which the line above cannot tell from the base's own files, is gone too.
        out.append(Step("reset", (self.stash(n),), steps[-1].line if steps else 0, f"end of build stage {n}"))
        return out

    def copy_from(self, ref: str, srcs: list[str], dest: str, where: str) -> tuple[str, list[str]]:
        """The shell line for ``COPY --from=ref srcs dest``, and the paths it writes."""
        n = self.names.get(ref.lower())
        if n is None:
            raise TaskFormatError(
                f"{where}: COPY --from={ref}: copying from another image needs a registry; the bwrap "
                "backend can copy only from an earlier build stage"
            )
        if n == self.count:
            raise TaskFormatError(f"{where}: COPY --from={ref} names the stage it is in")
        into_dir = dest.endswith("/") or len(srcs) > 1
        lines, targets = [], []
        qd = shlex.quote(dest)
        for s in srcs:
            if any(c in s for c in "*?["):
                raise TaskFormatError(f"{where}: COPY --from={ref} {s}: wildcards are not supported here")
            src = posixpath.normpath(posixpath.join("/", s))
            # A directory's contents go into dest (Docker copies the contents, not the directory).
            target = posixpath.join(dest, posixpath.basename(src)) if into_dir else dest
            qs, qt = shlex.quote(self.stash(n) + src), shlex.quote(target)
            lines.append(
                f's={qs}; [ -e "$s" ] || [ -L "$s" ] || s={shlex.quote(src)}; '
                f'if [ -d "$s" ] && [ ! -L "$s" ]; then mkdir -p {qd} && cp -a "$s/." {qd}/; '
                f'else mkdir -p "$(dirname {qt})" && cp -a "$s" {qt}; fi'
            )
            targets.append(target)
        return " && ".join(f"{{ {ln}; }}" for ln in lines), targets


def parse_dockerfile(
    path: Path,
    build_args: dict[str, str] | None = None,
    base_env: Mapping[str, str] | None = None,
    read_only: tuple[str, ...] | None = None,
) -> Recipe:
    """Parse the Dockerfile subset. Raises TaskFormatError naming the file, line and instruction.

    base_env: the base image's environment that ``$VAR`` expands over (default PATH and HOME).
    read_only: where the backend's read-only base is mounted (an earlier build stage's output is
    removed from everywhere else).
    """
    path = Path(path)
    if not path.is_file():
        raise TaskFormatError(f"Dockerfile not found: {path}")
    try:
        text = path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError) as e:
        raise TaskFormatError(f"{path}: cannot read the Dockerfile: {e}") from None
    return _DockerfileReplay(path, text, build_args, base_env, read_only).recipe()


class _DockerfileReplay:
    """The state of one parse (the stage being built, its variables, the stages before it) and one
    handler per instruction (``_from``, ``_arg``, ``_run``, ...)."""

    def __init__(self, path: Path, text: str, build_args, base_env, read_only):
        self.path = path
        self.rec = Recipe(base="", context=path.parent)
        self.build_args = dict(build_args or {})
        self.base_env = dict(base_env or DEFAULT_BASE_ENV)
        self.global_args: dict[str, str] = {}  # ARGs before the first FROM: only for FROM lines
        self.env: dict[str, str] = dict(self.base_env)
        self.stage = _Stage()
        self.n_written = 0
        self.parsed = instructions(text, path)
        self.stages = _Stages(self.parsed, tuple(read_only if read_only is not None else DEFAULT_READ_ONLY))
        self.done_steps: list[Step] = []  # earlier stages' steps, isolated
        self.handlers = {
            "FROM": self._from,
            "ARG": self._arg,
            "RUN": self._run,
            "COPY": self._copy,
            "ADD": self._copy,
            "WORKDIR": self._workdir,
            "ENV": self._env,
            "SHELL": self._shell,
            "USER": self._user,
        }

    def recipe(self) -> Recipe:
        rec = self.rec
        for ins in self.parsed:
            where = f"{self.path}:{ins.line}"
            handler = self.handlers.get(ins.name)
            if ins.name not in ("FROM", "ARG") and not rec.base:
                raise TaskFormatError(f"{where}: {ins.name} before FROM")
            if handler is not None:
                # Expansion sees the stage's ARGs and ENVs (ENV wins, as in Docker).
                handler(ins, where, {**self.stage.args, **self.env})
            elif ins.name in IGNORED:
                rec.ignored.append(ins.source)
            elif ins.name in UNSUPPORTED:
                raise TaskFormatError(
                    f"{where}: Dockerfile instruction {ins.name} is not supported by the bwrap backend; "
                    "use --backend podman"
                )
            else:
                raise TaskFormatError(f"{where}: unknown Dockerfile instruction {ins.name!r}")
        if not rec.base:
            raise TaskFormatError(f"{self.path}: no FROM instruction")
        rec.steps = self.done_steps + rec.steps
        if self.stages.used or self.n_written:
            # Scratch files of the replay (stashed stages, heredoc scripts) are not part of the image.
            rec.steps.append(
                Step("run", (f"rm -rf {STAGE_STASH} /tmp/tmax-heredoc-* /tmp/tmax-add-*",), 0, "end of build")
            )
        return rec

    def _from(self, ins: Instruction, where: str, scope: dict) -> None:
        from tmax_jax.sandbox.rootfs import is_known_base

        rec, stages = self.rec, self.stages
        words = [w for w in ins.rest.split() if not w.startswith("--")]
        if not words:
            raise TaskFormatError(f"{where}: FROM needs an image name")
        image = _subst(words[0], self.global_args)
        alias = words[2].lower() if len(words) >= 3 and words[1].lower() == "as" else None
        if rec.base and image.lower() in stages.current_names:
            # FROM <the stage just finished>: the same filesystem and variables carry on.
            if alias:
                stages.current_names.append(alias)
                stages.names[alias] = stages.count
            return
        if rec.base:
            if image.lower() in stages.names:
                raise TaskFormatError(
                    f"{where}: FROM {image} (an earlier, not the previous, build stage) is not supported "
                    "by the bwrap backend"
                )
            if stages.needed():
                self.done_steps += stages.isolate(rec.steps, stages.count)
            stages.count += 1
            rec.steps = []
            self.env = dict(self.base_env)
            self.stage = _Stage()
            rec.user = "root"
        if stages.count and rec.base and not is_known_base(image) and not Path(image).is_dir():
            raise TaskFormatError(
                f"{where}: build stage base {image} has no local rootfs for the bwrap backend"
            )
        if rec.base and is_known_base(image) != is_known_base(rec.base):
            raise TaskFormatError(
                f"{where}: build stages on different bases ({rec.base}, {image}) are not supported "
                "by the bwrap backend"
            )
        rec.base = image
        stages.current_names = [str(stages.count)] + ([alias] if alias else [])
        for name in stages.current_names:
            stages.names[name] = stages.count

    def _arg(self, ins: Instruction, where: str, scope: dict) -> None:
        for k, v in _parse_args(ins.rest, where).items():
            value = self.build_args.get(k, _subst(v, scope) if v is not None else None)
            if not self.rec.base:
                self.global_args[k] = value or ""
            elif value is None and k in self.global_args:
                self.stage.args[k] = self.global_args[k]  # `ARG X` in a stage takes the global default
            elif value is not None:
                self.stage.args[k] = value

    def _run(self, ins: Instruction, where: str, scope: dict) -> None:
        rest, stage = ins.rest, self.stage
        while m := re.match(r"(--\S+)\s*", rest):
            if not _HARMLESS_RUN_FLAGS.match(m.group(1)):
                raise TaskFormatError(f"{where}: RUN flag {m.group(1)} is not supported by the bwrap backend")
            rest = rest[m.end() :]
        if ins.heredocs and HEREDOC.fullmatch(rest):
            delim, _, body = ins.heredocs[0]
            if body.startswith("#!"):
                # A script with its own interpreter runs as a file, as BuildKit runs it.
                self.n_written += 1
                f = f"/tmp/tmax-heredoc-{self.n_written}"
                cmd = stage.run_line(None, [f])
                blob = base64.b64encode(body.encode()).decode()
                script = f"printf %s {blob} | base64 -d > {f} && chmod 0755 {f} && ({cmd})"
                self.rec.steps.append(Step("run", (script,), ins.line, ins.source))
                return
            cmd = stage.run_line(body)
        elif ins.heredocs:
            # `RUN python3 <<EOF`: the shell's own here-document, given back its body lines.
            docs = "".join(f"\n{body}{delim}" for delim, _, body in ins.heredocs)
            cmd = stage.run_line(rest + docs)
        elif rest.startswith("["):
            cmd = stage.run_line(None, _json_or_words(rest))
        else:
            cmd = stage.run_line(rest)
        self.rec.steps.append(Step("run", (cmd,), ins.line, ins.source))

    def _copy(self, ins: Instruction, where: str, scope: dict) -> None:
        self.n_written = _copy(
            self.rec, ins, ins.name, ins.rest, scope, self.stage, where, self.n_written, self.stages
        )

    def _workdir(self, ins: Instruction, where: str, scope: dict) -> None:
        self.rec.steps.append(Step("workdir", (_subst(ins.rest, scope),), ins.line, ins.source))

    def _env(self, ins: Instruction, where: str, scope: dict) -> None:
        for k, v in _parse_env(_protect_literal_dollars(ins.rest), where).items():
            self.env[k] = _subst(v, {**self.stage.args, **self.env}).replace(_LITERAL_DOLLAR, "$")
            self.stage.args.pop(k, None)  # an ENV of the same name hides the ARG
            if k == "HOME":
                self.stage.explicit_home = True
            self.rec.steps.append(Step("env", (k, self.env[k]), ins.line, ins.source))

    def _shell(self, ins: Instruction, where: str, scope: dict) -> None:
        try:
            shell = json.loads(ins.rest)
        except ValueError:
            shell = None
        if not (isinstance(shell, list) and shell and all(isinstance(x, str) for x in shell)):
            raise TaskFormatError(f'{where}: SHELL needs the JSON form, e.g. SHELL ["/bin/bash", "-c"]')
        self.stage.shell = tuple(shell)

    def _user(self, ins: Instruction, where: str, scope: dict) -> None:
        user = _subst(ins.rest, scope).strip()
        if not user or len(user.split()) != 1:
            raise TaskFormatError(f"{where}: USER needs one user[:group], got {ins.rest!r}")
        self.stage.user = self.rec.user = user


def _copy(
    recipe: Recipe, ins: Instruction, inst: str, rest: str, scope, stage, where, n_written, stages: _Stages
) -> int:
    lineno, line = ins.line, ins.source
    words = _json_or_words(rest)
    flags = [w for w in words if w.startswith("--")]
    words = [w for w in words if not w.startswith("--")]
    chown = chmod = from_stage = None
    for f in flags:
        if f.startswith("--chown="):
            chown = _subst(f.split("=", 1)[1], scope)
        elif f.startswith("--chmod="):
            chmod = f.split("=", 1)[1]
        elif f.startswith("--from=") and inst == "COPY":
            from_stage = _subst(f.split("=", 1)[1], scope)
        elif f.startswith("--from"):
            raise TaskFormatError(f"{where}: {inst} {f} is not supported by the bwrap backend")
        elif f.startswith("--link") or f == "--parents=false":
            continue  # layer linking changes how an image is stored, not what is in it
        else:
            raise TaskFormatError(f"{where}: {inst} {f} is not supported by the bwrap backend")
    if len(words) < 2:
        raise TaskFormatError(f"{where}: {inst} needs at least a source and a destination")
    srcs, dest = [_subst(w, scope) for w in words[:-1]], _subst(words[-1], scope)
    if from_stage is not None:
        cmd, targets = stages.copy_from(from_stage, srcs, dest, where)
        recipe.steps.append(Step("run", (cmd,), lineno, line))
        fix = [f"chown -R {shlex.quote(chown)}"] if chown else []
        fix += [f"chmod -R {shlex.quote(chmod)}"] if chmod else []
        if fix:
            paths = " ".join(shlex.quote(t) for t in dict.fromkeys(targets))
            recipe.steps.append(Step("run", (" && ".join(f"{c} {paths}" for c in fix),), lineno, line))
        return n_written
    docs = {delim: (quoted, body) for delim, quoted, body in ins.heredocs}
    into_dir = dest.endswith("/") or len(srcs) > 1
    targets = []
    plain = []
    for s in srcs:
        m = HEREDOC.fullmatch(s) if s.startswith("<<") else None
        if m and m.group(3) in docs:
            # COPY <<EOF /path: an inline file; an unquoted delimiter expands build variables.
            quoted, body = docs[m.group(3)]
            target = posixpath.join(dest, m.group(3)) if into_dir else dest
            recipe.steps.append(
                _write_file_step(target, body if quoted else _subst(body, scope), chmod, lineno, line)
            )
            targets.append(target)
            continue
        if inst == "ADD" and re.match(r"^[a-z]+://", s):
            raise TaskFormatError(f"{where}: ADD from a URL ({s}) is not supported (no network in builds)")
        if inst == "ADD" and _ARCHIVE.search(s):
            # ADD unpacks a local archive into the destination directory.
            n_written += 1
            tmp = f"/tmp/tmax-add-{n_written}/"
            recipe.steps.append(Step("copy", (s, tmp), lineno, line))
            name = shlex.quote(tmp + posixpath.basename(s))
            q = shlex.quote(dest)
            recipe.steps.append(
                Step(
                    "run",
                    (f"mkdir -p {q} && tar -xf {name} -C {q} && rm -rf {shlex.quote(tmp)}",),
                    lineno,
                    line,
                )
            )
            continue
        plain.append(s)
        targets.append(
            posixpath.join(dest, posixpath.basename(s.rstrip("/")))
            if into_dir and not any(c in s for c in "*?[") and not s.endswith("/")
            else dest
        )
    if plain:
        recipe.steps.append(Step("copy", (*plain, dest), lineno, line))
    fix = []
    if chown:
        fix.append(f"chown -R {shlex.quote(chown)}")
    if chmod and plain:
        fix.append(f"chmod -R {shlex.quote(chmod)}")
    if fix and targets:
        paths = " ".join(shlex.quote(t) for t in dict.fromkeys(targets))
        recipe.steps.append(Step("run", (" && ".join(f"{c} {paths}" for c in fix),), lineno, line))
    return n_written


_LITERAL_DOLLAR = "\x00"


def _protect_literal_dollars(rest: str) -> str:
    """``\\$`` and a ``$`` inside single quotes are not expanded by Docker: mark them before the
    quotes are removed."""
    out, quote, i = [], None, 0
    while i < len(rest):
        c = rest[i]
        if quote is None and c == "\\" and rest[i + 1 : i + 2] == "$":
            out.append(_LITERAL_DOLLAR)
            i += 2
            continue
        if c in "'\"" and quote in (None, c):
            quote = None if quote == c else c
        out.append(_LITERAL_DOLLAR if c == "$" and quote == "'" else c)
        i += 1
    return "".join(out)


def _parse_args(rest: str, where: str) -> dict[str, str | None]:
    """``ARG NAME[=default] ...``: name -> default (None when there is none)."""
    out: dict[str, str | None] = {}
    words = shlex.split(rest)
    if not words:
        raise TaskFormatError(f"{where}: ARG needs a name")
    for w in words:
        k, eq, v = w.partition("=")
        if not re.fullmatch(r"[A-Za-z_]\w*", k):
            raise TaskFormatError(f"{where}: ARG name {k!r} is not a variable name")
        out[k] = v if eq else None
    return out


def _parse_env(rest: str, where: str) -> dict[str, str]:
    words = shlex.split(rest)
    if not words:
        raise TaskFormatError(f"{where}: ENV needs a name")
    if "=" not in words[0]:
        # legacy form: ENV KEY value with spaces
        return {words[0]: rest.split(None, 1)[1] if len(rest.split(None, 1)) > 1 else ""}
    out = {}
    for w in words:
        if "=" not in w:
            raise TaskFormatError(f"{where}: ENV item {w!r} is not KEY=VALUE")
        k, v = w.split("=", 1)
        out[k] = v
    return out


def parse_apptainer_def(path: Path) -> Recipe:
    """Header ``From:``, and sections %files (src dest), %post (one RUN), %environment (exports)."""
    path = Path(path)
    if not path.is_file():
        raise TaskFormatError(f"container definition not found: {path}")
    recipe = Recipe(base="", context=path.parent)
    section, body = None, []
    sections: dict[str, list[str]] = {}
    for line in path.read_text().splitlines():
        m = re.match(r"^%(\w+)", line)
        if m:
            if section:
                sections[section] = body
            section, body = m.group(1).lower(), []
            continue
        if section is None:
            k, _, v = line.partition(":")
            if k.strip().lower() == "from":
                recipe.base = v.strip()
        else:
            body.append(line)
    if section:
        sections[section] = body
    if not recipe.base:
        raise TaskFormatError(f"{path}: no 'From:' line in the header")
    for line in sections.get("files", []):
        words = shlex.split(line)
        if not words:
            continue
        if len(words) > 2:
            raise TaskFormatError(f"{path}: %files line {line!r} must be 'src [dest]'")
        recipe.steps.append(Step("copy", (words[0], words[-1]), 0, line))
    for line in sections.get("environment", []):
        s = line.strip()
        if not s or s.startswith("#"):
            continue
        s = s.removeprefix("export ").strip()
        if "=" not in s:
            raise TaskFormatError(f"{path}: %environment line {line!r} is not KEY=VALUE")
        k, v = s.split("=", 1)
        recipe.steps.append(Step("env", (k.strip(), v.strip().strip('"').strip("'")), 0, line))
    post = "\n".join(sections.get("post", [])).strip()
    if post:
        recipe.steps.append(Step("run", (post,), 0, "%post"))
    for name in sections:
        if name not in ("files", "environment", "post", "runscript", "labels", "help", "test", "startscript"):
            raise TaskFormatError(f"{path}: section %{name} is not supported by the bwrap backend")
    return recipe
