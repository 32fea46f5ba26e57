"""Environment recipes: a Dockerfile subset and Apptainer ``.def`` files parsed into build steps.

The bwrap backend cannot run a real image build, so a recipe is reduced to steps it can replay in a
sandbox over the read-only rootfs: FROM (mapped to a local rootfs), RUN, COPY/ADD (local files),
WORKDIR, ENV, ARG. Instructions that only describe how a container is launched (CMD, ENTRYPOINT,
EXPOSE, LABEL, ...) are recorded and ignored; anything else is an error naming the instruction.
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

from tmax_jax.errors import TaskFormatError

IGNORED = {"CMD", "ENTRYPOINT", "EXPOSE", "LABEL", "MAINTAINER", "STOPSIGNAL", "HEALTHCHECK"}
UNSUPPORTED = {"VOLUME", "SHELL", "ONBUILD"}


@dataclass(frozen=True)
class Step:
    """kind: run | copy | workdir | env. ``args`` holds the step's data (see ``parse_dockerfile``)."""

    kind: str
    args: tuple[str, ...]
    line: int = 0
    source: str = ""


@dataclass
class Recipe:
    base: str = "ubuntu:24.04"
    steps: list[Step] = field(default_factory=list)
    context: Path | None = None
    ignored: list[str] = field(default_factory=list)

    def key_data(self) -> list:
        return [self.base, [(s.kind, list(s.args)) for s in self.steps]]


def _logical_lines(text: str):
    buf, start = "", 0
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.rstrip()
        if not buf and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if buf and line.lstrip().startswith("#"):
            continue  # comment lines inside a continuation are dropped, as Docker does
        if not buf:
            start = n
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        buf += line
        yield start, buf.strip()
        buf = ""
    if buf:
        yield start, buf.strip()


_VAR = re.compile(r"\$(\w+)|\$\{(\w+)(?::-([^}]*))?\}")


def _subst(s: str, env: dict[str, str]) -> str:
    return _VAR.sub(lambda m: env.get(m.group(1) or m.group(2), m.group(3) or ""), s)


def _json_or_words(rest: str) -> list[str]:
    if rest.startswith("["):
        try:
            v = json.loads(rest)
        except ValueError:
            v = None
        if isinstance(v, list) and all(isinstance(x, str) for x in v):
            return v
    return shlex.split(rest)


def parse_dockerfile(path: Path, build_args: dict[str, str] | None = None) -> Recipe:
    """Parse the Dockerfile subset. Raises TaskFormatError naming the file, line and instruction."""
    path = Path(path)
    if not path.is_file():
        raise TaskFormatError(f"Dockerfile not found: {path}")
    recipe = Recipe(base="", context=path.parent)
    env: dict[str, str] = dict(build_args or {})
    for lineno, line in _logical_lines(path.read_text()):
        parts = line.split(None, 1)
        inst, rest = parts[0].upper(), (parts[1] if len(parts) > 1 else "").strip()
        where = f"{path}:{lineno}"
        if inst == "FROM":
            if recipe.base:
                raise TaskFormatError(
                    f"{where}: multi-stage builds (a second FROM) are not supported by the bwrap backend; use --backend podman"
                )
            words = [w for w in rest.split() if not w.startswith("--")]
            if not words:
                raise TaskFormatError(f"{where}: FROM needs an image name")
            recipe.base = _subst(words[0], env)
        elif not recipe.base and inst != "ARG":
            raise TaskFormatError(f"{where}: {inst} before FROM")
        elif inst == "RUN":
            if rest.startswith("--"):
                raise TaskFormatError(
                    f"{where}: RUN flags ({rest.split()[0]}) are not supported by the bwrap backend"
                )
            if rest.startswith("["):
                cmd = shlex.join(_json_or_words(rest))
            else:
                cmd = rest
            recipe.steps.append(Step("run", (cmd,), lineno, line))
        elif inst in ("COPY", "ADD"):
            words = _json_or_words(rest)
            flags = [w for w in words if w.startswith("--")]
            words = [w for w in words if not w.startswith("--")]
            for f in flags:
                if not f.startswith(("--chown", "--chmod")):
                    raise TaskFormatError(f"{where}: {inst} {f} is not supported by the bwrap backend")
            if len(words) < 2:
                raise TaskFormatError(f"{where}: {inst} needs at least a source and a destination")
            srcs, dest = [_subst(w, env) for w in words[:-1]], _subst(words[-1], env)
            for s in srcs:
                if inst == "ADD" and re.match(r"^[a-z]+://", s):
                    raise TaskFormatError(
                        f"{where}: ADD from a URL ({s}) is not supported (no network in builds)"
                    )
                if inst == "ADD" and re.search(r"\.(tar|tgz|tar\.\w+)$", s):
                    raise TaskFormatError(
                        f"{where}: ADD of an archive ({s}) is not supported by the bwrap backend; use COPY + RUN tar"
                    )
            recipe.steps.append(Step("copy", (*srcs, dest), lineno, line))
        elif inst == "WORKDIR":
            recipe.steps.append(Step("workdir", (_subst(rest, env),), lineno, line))
        elif inst == "ENV":
            for k, v in _parse_env(rest, where).items():
                env[k] = _subst(v, env)
                recipe.steps.append(Step("env", (k, env[k]), lineno, line))
        elif inst == "ARG":
            k, _, v = rest.partition("=")
            env.setdefault(k.strip(), v.strip().strip('"'))
        elif inst == "USER":
            if rest.split(":")[0] not in ("root", "0"):
                raise TaskFormatError(
                    f"{where}: USER {rest} is not supported by the bwrap backend (sandboxes run as root)"
                )
        elif inst in IGNORED:
            recipe.ignored.append(line)
        elif inst in UNSUPPORTED:
            raise TaskFormatError(
                f"{where}: Dockerfile instruction {inst} is not supported by the bwrap backend; use --backend podman"
            )
        else:
            raise TaskFormatError(f"{where}: unknown Dockerfile instruction {inst!r}")
    if not recipe.base:
        raise TaskFormatError(f"{path}: no FROM instruction")
    return recipe


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
