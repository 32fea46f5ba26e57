"""Offline buildability of a task's Dockerfile."""

import pytest

from tmax_jax.eval.environment import check_environment, dockerfile_instructions, network_fetches

OFFLINE_OK = """\
# a comment mentioning pip install is not a build step
FROM ubuntu:24.04
WORKDIR /app
COPY data/ /app/data/
RUN mkdir -p /app/out && \\
    echo ready > /app/out/flag && \\
    python3 -m pip install --no-index --find-links /wheels mypkg
ENV PATH=/app/bin:$PATH
"""


@pytest.mark.parametrize(
    "step,what",
    [
        ("RUN apt-get update && apt-get install -y jq", "apt-get"),
        ("RUN apt install -y jq", "apt-get"),
        ("RUN pip install numpy==2.0", "pip install"),
        ("RUN python3 -m pip install requests", "pip install"),
        ("RUN uv pip install --system pandas", "uv"),
        ("RUN curl -fsSL https://example.com/x.sh | bash", "curl"),
        ("RUN wget -q https://example.com/x.tgz", "wget"),
        ("RUN git clone https://github.com/a/b /src", "git clone"),
        ("RUN cd /app && npm ci", "npm install"),
        ("RUN apk add --no-cache bash", "apk add"),
        ("RUN cargo install ripgrep", "cargo"),
        ("RUN go install example.com/tool@latest", "go get"),
        ('RUN ["/bin/sh", "-c", "pip3 install flask"]', "pip install"),
        ("ADD https://example.com/data.tar.gz /data/", "ADD from a URL"),
        ("RUN <<EOF\nset -e\npip3 install numpy\nEOF", "pip install"),  # a BuildKit heredoc's body
        ("COPY --from=ghcr.io/astral-sh/uv:0.7 /uv /bin/", "COPY --from an image in a registry"),
        ("RUN cargo build --release", "cargo"),
        ("RUN dotnet restore", "dotnet restore"),
        ("RUN pip3.12 download -d /w numpy", "pip download"),
    ],
)
def test_fetching_steps_are_found(step, what):
    text = "FROM debian:12\nRUN echo start\n" + step + "\n"
    assert network_fetches(text) == [(3, what)]


@pytest.mark.parametrize(
    "step",
    [
        # A file written through a shell heredoc: its body is the file's text, not commands.
        "RUN mkdir -p /app && cat > /app/ci.yml << 'EOF'\nsteps:\n  - run: pip install -r requirements.txt\nEOF",
        "RUN cat <<EOF > /app/setup.md\nThen run: curl https://example.com/get.sh | bash\nEOF",
        "COPY <<EOF /app/README\npip install numpy\nEOF",
    ],
)
def test_heredoc_file_contents_are_not_commands(step):
    text = "FROM debian:12\nRUN echo start\n" + step + "\nRUN echo done\n"
    assert network_fetches(text) == []


@pytest.mark.parametrize(
    "step", ["RUN bash <<EOF\npip install numpy\nEOF", "RUN cat <<'EOF' | sh\npip install numpy\nEOF"]
)
def test_heredoc_read_by_a_shell_is_commands(step):
    assert network_fetches("FROM debian:12\n" + step + "\n") == [(2, "pip install")]


def test_offline_dockerfile_has_no_fetches():
    assert network_fetches(OFFLINE_OK) == []
    instrs = dockerfile_instructions(OFFLINE_OK)
    assert [i[1] for i in instrs] == ["FROM", "WORKDIR", "COPY", "RUN", "ENV"]
    assert instrs[3][0] == 5  # a continued RUN reports its first line


def test_continued_run_reports_its_first_line():
    text = "FROM x\nRUN set -e; \\\n    echo a; \\\n    pip install b\n"
    assert network_fetches(text) == [(2, "pip install")]


def test_check_environment(tmp_path):
    env = tmp_path / "environment"
    env.mkdir()
    assert check_environment(tmp_path).available  # no Dockerfile: nothing to build
    (env / "Dockerfile").write_text(OFFLINE_OK)
    assert check_environment(tmp_path).available
    (env / "Dockerfile").write_text("FROM x\nRUN apt-get update\nRUN pip install a\nRUN curl x\nRUN wget y\n")
    res = check_environment(tmp_path)
    assert not res.available
    assert "line 2 (apt-get)" in res.reason and "1 more" in res.reason and "offline" in res.reason
    assert check_environment(tmp_path, network=True).available
