"""Dockerfile subset / Apptainer .def parsing and the content-addressed bwrap layers."""

from __future__ import annotations

import base64
import os
import textwrap
from pathlib import Path

import pytest

from tmax_jax.errors import SandboxError, TaskFormatError
from tmax_jax.sandbox import SandboxConfig, make_sandbox
from tmax_jax.sandbox.layers import build_layer
from tmax_jax.sandbox.recipe import parse_apptainer_def, parse_dockerfile


def _df(tmp_path: Path, text: str, files: dict[str, str] | None = None) -> Path:
    ctx = tmp_path / "env"
    ctx.mkdir(exist_ok=True)
    for name, content in (files or {}).items():
        (ctx / name).parent.mkdir(parents=True, exist_ok=True)
        (ctx / name).write_text(content)
    p = ctx / "Dockerfile"
    p.write_text(textwrap.dedent(text))
    return p


def test_parse_dockerfile_subset(tmp_path):
    p = _df(
        tmp_path,
        """\
        # comment
        ARG VER=3
        FROM python:3.12-slim AS base
        ENV A=1 B="two words"
        ENV LEGACY value with spaces
        WORKDIR /app
        COPY --chown=root:root a.txt b.txt /app/
        RUN echo $A \\
            && echo v${VER}
        RUN ["bash", "-c", "echo exec form"]
        CMD ["python3"]
        EXPOSE 8000
        """,
    )
    r = parse_dockerfile(p)
    assert r.base == "python:3.12-slim"
    kinds = [(s.kind, s.args) for s in r.steps]
    assert ("env", ("A", "1")) in kinds and ("env", ("B", "two words")) in kinds
    assert ("env", ("LEGACY", "value with spaces")) in kinds
    assert ("workdir", ("/app",)) in kinds
    assert ("copy", ("a.txt", "b.txt", "/app/")) in kinds
    runs = [s.args[0] for s in r.steps if s.kind == "run"]
    assert runs[0] == "chown -R root:root /app/a.txt /app/b.txt"  # --chown is honoured after the copy
    assert runs[1].split() == ["echo", "$A", "&&", "echo", "v${VER}"]
    assert runs[2] == "bash -c 'echo exec form'"
    assert len(r.ignored) == 2


@pytest.mark.parametrize(
    "line, match",
    [
        ("VOLUME /data", "VOLUME is not supported by the bwrap backend"),
        ("SHELL /bin/zsh", "SHELL needs the JSON form"),
        ("FROM golang:1.22", "build stage base golang:1.22 has no local rootfs"),
        ("COPY --from=ghcr.io/astral-sh/uv:0.7 /uv /bin/", "needs a registry"),
        ("USER", "USER needs one user"),
        ("RUN --mount=type=secret,id=k cat /run/secrets/k", "RUN flag --mount=type=secret"),
        ("ADD https://example.com/x.tgz /app/", "URL"),
        ("COPY --from=builder /x /y", "--from"),
        ("FROBNICATE now", "unknown Dockerfile instruction 'FROBNICATE'"),
    ],
)
def test_dockerfile_instructions_bwrap_cannot_do(tmp_path, line, match):
    p = _df(tmp_path, f"FROM ubuntu:24.04\n{line}\n")
    with pytest.raises(TaskFormatError, match=match) as e:
        parse_dockerfile(p)
    assert ":2:" in str(e.value)  # names the line


def test_parse_apptainer_def(tmp_path):
    p = tmp_path / "container.def"
    p.write_text(
        "Bootstrap: docker\nFrom: ubuntu:22.04\n\n%files\n    data.txt /opt/data.txt\n%environment\n    export X=1\n%post\n    mkdir -p /home/user\n    echo hi > /home/user/hi\n"
    )
    r = parse_apptainer_def(p)
    assert r.base == "ubuntu:22.04"
    assert [s.kind for s in r.steps] == ["copy", "env", "run"]
    assert "echo hi > /home/user/hi" in r.steps[-1].args[0]
    p.write_text("Bootstrap: docker\n%post\n true\n")
    with pytest.raises(TaskFormatError, match="From:"):
        parse_apptainer_def(p)


def test_layer_is_built_once_and_rebuilt_on_change(tmp_path):
    cfg = SandboxConfig(cache_dir=str(tmp_path / "cache"))
    p = _df(
        tmp_path,
        "FROM ubuntu:24.04\nENV GREETING=hello\nWORKDIR /app\nCOPY data/ /app/data/\nRUN cat data/x.txt > copy.txt && echo $GREETING >> copy.txt\n",
        {"data/x.txt": "one\n"},
    )
    img = build_layer(cfg, parse_dockerfile(p))
    assert img.workdir == "/app" and img.env == {"GREETING": "hello"}
    again = build_layer(cfg, parse_dockerfile(p))
    assert again.layer == img.layer  # cache hit: same content, same key
    with make_sandbox(cfg, image=img) as sb:
        r = sb.exec("pwd; cat copy.txt; echo $GREETING; ls data")
        assert r.stdout == "/app\none\nhello\nhello\nx.txt\n"
        sb.exec("echo tamper > /app/copy.txt")
    with make_sandbox(cfg, image=img) as sb:  # each sandbox gets its own copy of the layer
        assert sb.exec("cat /app/copy.txt").stdout == "one\nhello\n"
    (p.parent / "data" / "x.txt").write_text("two\n")
    changed = build_layer(cfg, parse_dockerfile(p))
    assert changed.layer != img.layer
    with make_sandbox(cfg, image=changed) as sb:
        assert sb.exec("head -1 /app/copy.txt").stdout == "two\n"


def test_layer_errors_name_the_problem(tmp_path):
    cfg = SandboxConfig(cache_dir=str(tmp_path / "cache"))
    if os.geteuid() != 0:  # an ordinary user's sandboxes have a read-only base
        bad_run = _df(tmp_path, "FROM ubuntu:24.04\nRUN touch /usr/bin/x\n")
        with pytest.raises(SandboxError, match="RUN touch /usr/bin/x.*read-only"):
            build_layer(cfg, parse_dockerfile(bad_run))
        outside = _df(tmp_path, "FROM ubuntu:24.04\nWORKDIR /usr/src/app\n")
        with pytest.raises(
            TaskFormatError, match="WORKDIR /usr/src/app is inside the bwrap backend's read-only base"
        ):
            build_layer(cfg, parse_dockerfile(outside))
    missing = _df(tmp_path, "FROM ubuntu:24.04\nCOPY nothere.txt /app/\n")
    with pytest.raises(TaskFormatError, match="nothere.txt"):
        build_layer(cfg, parse_dockerfile(missing))
    unknown = _df(tmp_path, "FROM ghcr.io/acme/private:1\nRUN true\n")
    with pytest.raises(SandboxError, match="no local rootfs"):
        build_layer(cfg, parse_dockerfile(unknown))


def test_heredocs_and_variables_parse_as_buildkit_does(tmp_path):
    p = _df(
        tmp_path,
        """\
        FROM ubuntu:24.04
        ARG NAME=tmax
        RUN <<-EOF
        \techo "tab-stripped $NAME"
        \tEOF
        COPY <<'RAW' <<COOKED /app/conf/
        literal ${NAME}
        RAW
        expanded ${NAME}
        COOKED
        RUN python3 - <<'PY'
        print("stdin script")
        PY
        ENV P="/opt/x:${PATH}" Q=${NAME:+set} R=\\$NAME S='$NAME'
        SHELL ["/bin/sh", "-e", "-c"]
        RUN echo after shell
        """,
    )
    r = parse_dockerfile(p)
    runs = [s.args[0] for s in r.steps if s.kind == "run"]
    assert runs[0] == 'export NAME=tmax; echo "tab-stripped $NAME"\n'  # ARGs reach RUN steps
    blobs = [base64.b64decode(cmd.split("printf %s ")[1].split()[0]).decode() for cmd in runs[1:3]]
    assert blobs == ["literal ${NAME}\n", "expanded tmax\n"]
    assert "/app/conf/RAW" in runs[1] and "/app/conf/COOKED" in runs[2]
    assert runs[3] == "export NAME=tmax; python3 - <<'PY'\nprint(\"stdin script\")\nPY"
    env = {s.args[0]: s.args[1] for s in r.steps if s.kind == "env"}
    assert env == {
        "P": "/opt/x:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        "Q": "set",
        "R": "$NAME",
        "S": "$NAME",
    }
    assert runs[4] == "export NAME=tmax; exec /bin/sh -e -c 'echo after shell'"


def test_unclosed_heredoc_names_the_line(tmp_path):
    p = _df(tmp_path, "FROM ubuntu:24.04\nRUN <<EOF\necho never closed\n")
    with pytest.raises(TaskFormatError, match=r":2: heredoc <<EOF of RUN has no closing EOF"):
        parse_dockerfile(p)


@pytest.mark.skipif(os.geteuid() != 0, reason="the copy-on-write base needs host root (id-mapped mounts)")
def test_layer_writes_into_the_base_like_docker(tmp_path):
    """RUN/COPY/WORKDIR into /usr and /etc (and a removal) are the image's, in every sandbox started
    from it, not the agent's changes (no tampering verdict), and never the host's."""
    cfg = SandboxConfig(cache_dir=str(tmp_path / "cache"))
    p = _df(
        tmp_path,
        """\
        FROM ubuntu:24.04
        WORKDIR /usr/src/app
        COPY tool.sh /usr/local/bin/tmax-layer-tool
        RUN chmod 0755 /usr/local/bin/tmax-layer-tool && rm /etc/debian_version && echo built > /usr/src/app/x
        """,
        {"tool.sh": "#!/bin/sh\necho from-layer\n"},
    )
    img = build_layer(cfg, parse_dockerfile(p))
    for _ in range(2):
        with make_sandbox(cfg, image=img) as sb:
            r = sb.exec("pwd; cat x; tmax-layer-tool; test -e /etc/debian_version || echo gone")
            assert r.stdout == "/usr/src/app\nbuilt\nfrom-layer\ngone\n", r.output
            sb.exec("echo agent > /usr/src/app/x")
            tests = tmp_path / "tests"
            tests.mkdir(exist_ok=True)
            (tests / "t.sh").write_text("tmax-layer-tool > /logs/verifier/out\n")
            run = sb.run_verifier(tests, ["/bin/bash", "/tests/t.sh"], timeout=30)
            assert run.tampered is None and run.logs["out"] == b"from-layer\n", run
    assert os.path.exists("/etc/debian_version") and not os.path.exists("/usr/local/bin/tmax-layer-tool")
