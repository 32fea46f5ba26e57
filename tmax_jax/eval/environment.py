"""Can a task run without the internet?

Harbor tasks build their image from ``environment/Dockerfile``, and many install packages at build
time; many verifiers (``tests/test.sh``) and reference solutions (``solution/solve.sh``) download
too (``apt-get install``, ``curl ... | sh`` of an installer, ``uvx``). Where the sandbox has no
network such a step cannot succeed and the attempt says nothing about the model, so the evaluation
lists these tasks as "environment unavailable", naming the line, instead of scoring them 0. The
check reads the files statically (nothing is built or run).
"""

from __future__ import annotations

import dataclasses
import re
import shlex
from pathlib import Path

from tmax_jax.errors import TaskFormatError
from tmax_jax.sandbox.recipe import HEREDOC, instructions

# Commands that download, matched against each simple command of a RUN step or script line (split on
# && ; | and newlines); the first match names the command. The patterns err towards "fetches": a
# false "unavailable" costs one skipped task, a false "available" scores the model 0 for our network.
_OFFLINE_FLAGS = r"(?!.*\s(--offline|--frozen|-o)\b)"
_FETCHERS: tuple[tuple[str, re.Pattern[str]], ...] = tuple(
    (name, re.compile(pattern))
    for name, pattern in (
        (
            "uv",
            r"\buv\s+(pip\s+install|sync|add|lock|tool\s+(install|run)|python\s+install|run\s+.*--with)\b"
            r"(?!.*\s--offline\b)",
        ),
        ("uvx", r"(^|\s|/)uvx\s(?!.*\s--offline\b)"),
        ("pip download", r"\b(pip(\d(\.\d+)?)?|python(\d(\.\d+)?)?\s+-m\s+pip)\s+download\b(?!.*--no-index)"),
        ("poetry install", r"\bpoetry\s+(install|add|update|lock)\b"),
        ("pipx install", r"\bpipx\s+(install|run)\b"),
        ("conda install", r"\b(conda|mamba|micromamba)\s+(install|create|env\s+create|update)\b"),
        ("apt-get", r"\bapt(-get)?\s+(-\S+\s+)*(install|update|upgrade|dist-upgrade|source|download)\b"),
        ("apk add", r"\bapk\s+(-\S+\s+)*(add|update|upgrade)\b(?!.*--no-network)"),
        ("yum/dnf", r"\b(yum|dnf|microdnf|zypper)\s+(-\S+\s+)*(install|update|upgrade)\b"),
        ("git clone", r"\bgit\s+(fetch|pull|submodule\s+update|ls-remote)\b"),
        (
            "npm install",
            r"\b(npm|pnpm|bun)\s+(install|i|ci|add|update)\b|\byarn(\s+(install|add))?\s*$|\bnpx\s",
        ),
        ("cargo", r"\bcargo\s+(install|fetch|build|run|test|add|update|check)\b" + _OFFLINE_FLAGS),
        ("go get", r"\bgo\s+(get|install|mod\s+download)\b"),
        ("maven", r"(^|\s|/)mvnw?\s" + r"(?!(.*\s)?(-o|--offline)\b)"),
        ("gradle", r"(^|\s|/)(gradle|gradlew)\s" + r"(?!(.*\s)?--offline\b)"),
        (
            "dotnet restore",
            r"\bdotnet\s+(restore|add\s+\S+\s+package|tool\s+install|build|run|test|publish)\b(?!.*--no-restore)",
        ),
        ("huggingface-cli", r"\b(huggingface-cli\s+download|hf\s+download)\b"),
        ("gem install", r"\b(gem\s+install|bundle(\s+install)?\s*$)"),
        ("R packages", r"install\.packages\(|\bremotes::install"),
        ("cpan", r"\bcpanm?\b"),
    )
)
_URL = re.compile(r"^(https?|ftp|git)://|^git@", re.IGNORECASE)
_URL_IN = re.compile(r"\b(?:https?|ftp)://([^/\s:'\"]+)", re.IGNORECASE)
_LOCAL_HOST = re.compile(r"^(localhost|127\.\d+\.\d+\.\d+|0\.0\.0\.0|\[?::1\]?|[^.]+)$", re.IGNORECASE)
_PIP_INSTALL = re.compile(r"(?<!uv\s)\b(pip(\d(\.\d+)?)?|python(\d(\.\d+)?)?\s+-m\s+pip)\s+install\b(.*)")


@dataclasses.dataclass(frozen=True)
class EnvironmentCheck:
    available: bool
    reason: str = ""  # why not, naming the file and line


# A RUN whose heredoc a shell reads: nothing but the heredoc (BuildKit runs the body), a shell given
# it as input (``bash <<EOF``), or a heredoc piped into one (``cat <<EOF | sh``).
_SHELL_READS = re.compile(r"^(?:\S*/)?(?:ba|da|z)?sh(?:\s+-\w+)*$|\|\s*(?:\S*/)?(?:ba|da|z)?sh\b")


def _runs_heredoc(rest: str) -> bool:
    cmd = HEREDOC.sub("", rest).strip()
    return not cmd or bool(_SHELL_READS.search(cmd))


def dockerfile_instructions(text: str) -> list[tuple[int, str, str]]:
    """``(line number, INSTRUCTION, arguments)``: continuations joined, comments dropped, and a
    heredoc's body appended to its RUN's arguments when a shell runs it (``RUN <<EOF``,
    ``RUN bash <<EOF``). Any other heredoc body is a file's contents (``RUN cat > ci.yml <<'EOF'``,
    ``COPY <<EOF /app/x``): data, whatever commands its text mentions."""
    try:
        parsed = instructions(text)
    except TaskFormatError:  # an unclosed heredoc: read what there is; the build reports the error
        parsed = instructions(re.sub(r"(?<!<)<<", "< <", text))
    out = []
    for i in parsed:
        bodies = [body for _, _, body in i.heredocs] if i.name == "RUN" and _runs_heredoc(i.rest) else []
        out.append((i.line, i.name, "\n".join([i.rest, *bodies])))
    return out


def _shell_commands(script: str) -> list[str]:
    """The simple commands of ``script`` that must succeed: one whose failure the script ignores
    (``pip install -q pytest || true``, as a verifier that finds pytest already there does) is
    left out, since offline it fails and the script goes on as under Docker without the network."""
    parts = re.split(r"(&&|\|\||;|\||\n)", script)
    cmds, ops = [c.strip() for c in parts[::2]], parts[1::2]
    return [
        c
        for i, c in enumerate(cmds)
        if c and not (i < len(ops) and ops[i] == "||" and re.fullmatch(r"true|:", cmds[i + 1]))
    ]


def _pip_fetches(cmd: str) -> bool:
    """``pip install``: offline with ``--no-index``, or ``--no-deps`` of local paths only."""
    m = _PIP_INSTALL.search(cmd)
    if not m:
        return False
    try:
        words = shlex.split(m.group(6))
    except ValueError:
        words = m.group(6).split()
    if "--no-index" in words:
        return False
    takes_value = {"-r", "--requirement", "-c", "--constraint", "-t", "--target", "--prefix", "--root"}
    targets, skip = [], False
    for w in words:
        if skip:
            skip = False
            if w in ("-r", "--requirement"):
                return True
            continue
        if w in ("-r", "--requirement"):
            return True  # a requirements file names packages from the index
        if w in takes_value:
            skip = True
        elif not w.startswith("-"):
            targets.append(w)
    local = all(t.startswith((".", "/", "~")) or t.endswith((".whl", ".tar.gz", ".zip")) for t in targets)
    return not (targets and local and "--no-deps" in words)


def _curl_fetches(cmd: str, strict: bool) -> bool:
    """curl/wget of a URL on another machine (``curl localhost:8000`` talks to the task's service).

    strict (a build step, where no service of the task runs yet): any curl/wget but one that names
    only local hosts."""
    if not re.search(r"(^|\s|/)(curl|wget)\s", cmd + " "):
        return False
    hosts = _URL_IN.findall(cmd)
    if not hosts:
        # `curl -fsS example.com/x` (no scheme): a dotted host name is another machine.
        words = [w for w in cmd.split()[1:] if not w.startswith("-")]
        hosts = [
            w.split("/")[0].split(":")[0] for w in words if re.match(r"^[\w-]+(\.[\w-]+)+(:\d+)?(/|$)", w)
        ]
    if strict and not hosts:
        return True
    return any(not _LOCAL_HOST.match(h) for h in hosts)


def _git_clone_fetches(cmd: str) -> bool:
    m = re.search(r"\bgit\s+clone\b(.*)", cmd)
    if not m:
        return False
    return any(_URL.search(w) or re.match(r"^[\w.-]+@[\w.-]+:", w) for w in m.group(1).split())


def command_fetches(cmd: str, strict: bool = False) -> str | None:
    """What downloads in one simple shell command, or None (``strict``: see ``_curl_fetches``)."""
    if _pip_fetches(cmd):
        return "pip install"
    if _curl_fetches(cmd, strict):
        return "curl" if re.search(r"(^|\s|/)curl\s", cmd + " ") else "wget"
    if _git_clone_fetches(cmd):
        return "git clone"
    for name, pattern in _FETCHERS:
        if pattern.search(cmd):
            return name
    return None


def _script_fetches(script: str, lineno: int, strict: bool = False) -> list[tuple[int, str]]:
    found: list[tuple[int, str]] = []
    for cmd in _shell_commands(script):
        what = command_fetches(cmd, strict)
        if what and (lineno, what) not in found:
            found.append((lineno, what))
    return found


def network_fetches(dockerfile: str) -> list[tuple[int, str]]:
    """``(line, what)`` for every build step of ``dockerfile`` text that downloads from the network."""
    found: list[tuple[int, str]] = []
    for lineno, instr, args in dockerfile_instructions(dockerfile):
        if instr == "RUN":
            # Exec form RUN ["bash", "-c", "..."] reads the same once the JSON punctuation is gone.
            script = re.sub(r'^\[|\]$|",\s*"', " ", args) if args.startswith("[") else args
            found += [f for f in _script_fetches(script, lineno, strict=True) if f not in found]
        elif instr in ("ADD", "COPY"):
            words = [a for a in args.split() if not a.startswith("--")]
            if instr == "ADD" and any(_URL.search(s) for s in words[:-1]):
                found.append((lineno, "ADD from a URL"))
            if any(re.match(r"--from=[\w.-]+[/:]", a) for a in args.split()):
                found.append((lineno, f"{instr} --from an image in a registry"))
    return found


def script_fetches(text: str) -> list[tuple[int, str]]:
    """``(line, what)`` for every line of a shell script that downloads (continuations joined)."""
    found: list[tuple[int, str]] = []
    buf, start = "", 0
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.rstrip()
        if not buf:
            start = n
            if line.lstrip().startswith("#"):
                continue
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        buf += line
        code = re.sub(r"(^|\s)#.*$", "", buf)  # a trailing comment
        found += [f for f in _script_fetches(code, start) if f not in found]
        buf = ""
    if buf:
        found += [f for f in _script_fetches(buf, start) if f not in found]
    return found


def _unavailable(fetches: list[tuple[int, str]], file: str, when: str) -> EnvironmentCheck:
    where = ", ".join(f"line {ln} ({what})" for ln, what in fetches[:3])
    more = f" and {len(fetches) - 3} more" if len(fetches) > 3 else ""
    return EnvironmentCheck(
        False, f"{file} fetches from the internet {when}: {where}{more}; this run is offline"
    )


def check_environment(
    task_dir: str | Path,
    *,
    network: bool = False,
    run_network: bool | None = None,
    prebuilt: bool = False,
) -> EnvironmentCheck:
    """Whether ``task_dir`` can run here.

    network: environment builds can reach the internet. run_network: the sandbox the agent and the
    verifier run in can (default: the same as ``network``); without it a ``tests/test.sh`` or
    ``solution/solve.sh`` that downloads makes the task unavailable. prebuilt: the environment is
    an image already on this machine (task.toml's ``docker_image`` under podman), so the
    Dockerfile is never built and its downloads do not count.
    """
    task_dir = Path(task_dir)
    run_network = network if run_network is None else run_network
    dockerfile = task_dir / "environment" / "Dockerfile"
    if not network and not prebuilt and dockerfile.is_file():
        fetches = network_fetches(dockerfile.read_text(errors="replace"))
        if fetches:
            return _unavailable(fetches, "environment/Dockerfile", "at build time")
    if not run_network:
        for rel, when in (
            ("tests/test.sh", "at test time"),
            ("solution/solve.sh", "in the reference solution"),
        ):
            p = task_dir / rel
            if p.is_file():
                fetches = script_fetches(p.read_text(errors="replace"))
                if fetches:
                    return _unavailable(fetches, rel, when)
    return EnvironmentCheck(True)


def _prebuilt_here(task, backend: str) -> bool:
    """Whether ``backend`` runs ``task`` from a local prebuilt image instead of building its
    Dockerfile: podman with task.toml's ``docker_image`` present in local storage (no pull)."""
    env = getattr(task, "environment", None)
    if backend != "podman" or env is None or env.kind != "dockerfile" or not env.image:
        return False
    from tmax_jax.sandbox.podman_images import image_exists

    try:
        return image_exists(env.image.removeprefix("docker://"))
    except Exception:  # no podman here: the Dockerfile would be built, so it is what counts
        return False


def task_availability(task, *, network: bool = False, backend: str = "bwrap") -> EnvironmentCheck:
    """Whether a loaded task can run in a run whose sandboxes have the internet (``network``) or
    not: its Dockerfile (unless ``backend`` runs a local prebuilt image instead), ``tests/test.sh``
    and ``solution/solve.sh`` scanned for downloads, and a ``task.toml`` that asks for the internet
    at run time (``allow_internet``) given it only when the run has it. ``allow_internet = true``
    alone does not make a task unavailable offline: it is a permission, not a need, and the
    boilerplate of most public tasks (all 3,566 TermiGen task.toml files set it); what needs the
    network is what the scans find, and the result notes that the run was offline
    (``tasks.runner``). Used by ``tmax-jax eval``, ``run-task``/``run-tasks`` and ``train``
    (``tasks.dir``) alike."""
    allow = bool(getattr(getattr(task, "limits", None), "allow_internet", False))
    return check_environment(
        task.path,
        network=network,
        run_network=network and allow,
        prebuilt=not network and _prebuilt_here(task, backend),
    )
