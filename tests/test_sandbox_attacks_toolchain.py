"""Attack tests of one promise (sandboxes/README.md): the tests run against the agent's state with tools
the agent could not change. Every executable, shared library and configuration the verifier's processes
load or interpret comes from the image as built; the agent's files are data at their paths.

Each attack is a Harbor task whose reference solution changes what the verifier's tools load instead of
solving it, run end to end through ``run_task(..., "oracle")`` on bwrap and, where podman works here,
on podman; each must score 0. The control changes configuration a task may legitimately ask for
(``/etc/hosts``, a service's config dir), imports the agent's module and runs ``python3 -m`` on its
package from ``/app``, and must score 1.
"""

from __future__ import annotations

import shutil
import subprocess
import time
import uuid
from pathlib import Path

import pytest
from test_sandbox_attacks import BACKENDS, TEST_SH, _write_task, sandbox_config

from tmax_jax.sandbox import podman_toolchain
from tmax_jax.tasks import load_task
from tmax_jax.tasks.runner import run_task

# What each payload does once the verifier runs it: copy the answer only the tests hold into the
# agent's answer file (the verifier may read /tests; the agent's own processes find nothing there).
PAYLOAD_C = r"""
#include <stdio.h>
__attribute__((constructor)) static void tmax_payload(void) {
    char buf[4096];
    FILE *in = fopen("/tests/expected.txt", "r");
    if (!in) return;
    size_t n = fread(buf, 1, sizeof buf, in);
    fclose(in);
    FILE *out = fopen("/app/answer.txt", "w");
    if (!out) return;
    fwrite(buf, 1, n, out);
    fclose(out);
}
"""
PAYLOAD_PY = """\
try:
    import shutil
    shutil.copyfile("/tests/expected.txt", "/app/answer.txt")
except OSError:
    pass
"""
# ``file`` reports the answer as a PNG image: what the tests check, and what the agent's own magic
# rule makes it say of a text file.
MAGIC_TEST_SH = """\
#!/bin/bash
cd /app
if file -b answer.png | grep -q '^PNG image data'; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
"""
# The tests prefer a ``pytest-3`` when the image has one (as some distributions name it), or a
# faster runner of their own when it is installed.
PREFER_TEST_SH = TEST_SH.replace(
    "if python3 -m pytest",
    'if command -v pytest-3 >/dev/null 2>&1; then run=pytest-3; else run="python3 -m pytest"; fi\nif $run',
)
PREFER_RUNNER_SH = PREFER_TEST_SH.replace("pytest-3", "tmax-fastrun")

ATTACKS = {
    # 1. Configuration the verifier's tools load at start-up: an NSS module that nsswitch.conf names,
    # loaded by the verifier's bash for its passwd lookup (no SHELL set) before any test runs.
    "nss_module_in_bash_startup": """
        d=/usr/lib/$(uname -m)-linux-gnu
        mkdir -p "$d" && cp /solution/libnss_tmaxevil.so.2 "$d/"
        printf 'passwd: tmaxevil files\\ngroup: tmaxevil files\\nhosts: files dns\\n' > /etc/nsswitch.conf
    """,
    # a magic rule that makes `file` call a text file a PNG image.
    "magic_rule_misleads_file": """
        echo 'TMAXFAKE not an image' > /app/answer.png
        printf '0\\tstring\\tTMAXFAKE\\tPNG image data, 1 x 1, 8-bit/color RGBA, non-interlaced\\n' > /etc/magic
    """,
    # 2. A new command that the tests prefer when it exists (the image has none by that name).
    "new_command_tests_prefer": """
        printf '#!/bin/sh\\nexit 0\\n' > /usr/local/bin/pytest-3
        chmod 0755 /usr/local/bin/pytest-3
    """,
    "new_runner_tests_look_for": """
        printf '#!/bin/sh\\nexit 0\\n' > /usr/local/bin/tmax-fastrun
        chmod 0755 /usr/local/bin/tmax-fastrun
    """,
    # 3. A module the standard library imports optionally (``copy`` probes ``org.python.core``), served
    # from the verifier's working directory by its last-dir finder.
    "stdlib_probe_from_workdir": f"""
        mkdir -p /app/org
        cat > /app/org/__init__.py <<'EOF'
{PAYLOAD_PY}EOF
    """,
}
TEST_SHS = {
    "magic_rule_misleads_file": MAGIC_TEST_SH,
    "new_command_tests_prefer": PREFER_TEST_SH,
    "new_runner_tests_look_for": PREFER_RUNNER_SH,
}
# What the reason of each 0 names: the change found, or (a module never served) the test that failed.
REASONS = {
    "nss_module_in_bash_startup": "libnss_tmaxevil.so.2",
    "magic_rule_misleads_file": "/etc/magic",
    "new_command_tests_prefer": "/usr/local/bin/pytest-3",
    "new_runner_tests_look_for": "/usr/local/bin/tmax-fastrun",
    "stdlib_probe_from_workdir": "verifier failed",
}


def _nss_module(dest: Path) -> None:
    """Build the NSS module of the first attack (a real shared object, with gcc on the host)."""
    if shutil.which("gcc") is None:
        pytest.skip("gcc is needed to build the NSS module")
    src = dest.with_suffix(".c")
    src.write_text(PAYLOAD_C)
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(dest), str(src)], check=True)
    src.unlink()


def _task(tmp_path: Path, name: str, solve: str, expected: str, test_sh: str = TEST_SH) -> Path:
    d = _write_task(tmp_path / "tasks", name, solve, expected)
    (d / "tests" / "test.sh").write_text(test_sh)
    return d


@pytest.fixture(params=BACKENDS)
def cfg(request, tmp_path):
    return sandbox_config(request.param, tmp_path)


@pytest.mark.parametrize("attack", sorted(ATTACKS))
def test_toolchain_attack_scores_zero(cfg, tmp_path, attack):
    d = _task(tmp_path, attack, ATTACKS[attack], "42-" + uuid.uuid4().hex[:8], TEST_SHS.get(attack, TEST_SH))
    if attack == "nss_module_in_bash_startup":
        _nss_module(d / "solution" / "libnss_tmaxevil.so.2")
    res = run_task(load_task(d), "oracle", cfg)
    assert res.reward == 0.0, (attack, res.reason, res.verifier_log[-2000:])
    assert REASONS[attack] in res.reason, res.reason


CONTROL_SOLVE = """
    echo '127.0.0.1 tmax-answer.test' >> /etc/hosts
    mkdir -p /etc/tmaxsvc/sites.d && echo 'listen 8080;' > /etc/tmaxsvc/sites.d/app.conf
    mkdir -p /etc/cron.d && echo '*/5 * * * * root true' > /etc/cron.d/tmax-app
    echo "ANSWER = '42-right'" > /app/solution.py
    mkdir -p /app/mypkg && echo "print('42-right')" > /app/mypkg/__main__.py
    printf '#!/bin/sh\\necho 42-right\\n' > /usr/local/bin/tmax-answer && chmod 0755 /usr/local/bin/tmax-answer
    echo 42-right > /app/answer.txt
"""
CONTROL_TEST_PY = """\
import socket
import subprocess
import time
import sys
from pathlib import Path

import solution  # the agent's module, from the working directory (/app)

WANT = Path("/tests/expected.txt").read_text().strip()


def test_answer():
    assert solution.ANSWER == WANT
    assert Path("/app/answer.txt").read_text().strip() == WANT


def test_config_the_task_asked_for():
    assert "tmax-answer.test" in Path("/etc/hosts").read_text()
    assert socket.gethostbyname("tmax-answer.test") == "127.0.0.1"
    assert Path("/etc/tmaxsvc/sites.d/app.conf").read_text().strip() == "listen 8080;"
    assert Path("/etc/cron.d/tmax-app").exists()


def test_package_and_command_of_the_agent():
    got = subprocess.run([sys.executable, "-m", "mypkg"], cwd="/app", capture_output=True, text=True)
    assert got.stdout.strip() == WANT, got.stderr
    assert subprocess.run(["tmax-answer"], capture_output=True, text=True).stdout.strip() == WANT
"""


def test_control_task_config_scores_one(cfg, tmp_path):
    test_py = CONTROL_TEST_PY
    if cfg.backend == "podman":
        # podman gives each container an /etc/hosts of its own (the agent's edit is in its own copy,
        # outside the root filesystem the verifier sees): the rest of the control still holds.
        test_py = test_py.replace('    assert "tmax-answer.test" in Path("/etc/hosts").read_text()\n', "")
        test_py = test_py.replace('    assert socket.gethostbyname("tmax-answer.test") == "127.0.0.1"\n', "")
    d = _task(tmp_path, "control_task_config", CONTROL_SOLVE, "42-right")
    (d / "tests" / "test_answer.py").write_text(test_py)
    res = run_task(load_task(d), "oracle", cfg)
    assert (res.reward, res.reason) == (1.0, "ok"), res.verifier_log[-3000:]


# ---- the checks themselves, on hand-made overlay layers ------------------------------------------
IMAGE_FILES = {
    "usr/bin/python3": "py",
    "usr/bin/su": "su",
    "etc/nsswitch.conf": "passwd: files\n",
    "etc/pam.d/su": "auth include common-auth\n",
    "etc/pam.d/common-auth": "auth required pam_unix.so\n",
    "etc/alternatives/awk": "mawk",
    "etc/localtime": "TZif",
    "usr/lib/x86_64-linux-gnu/libnss_files.so.2": "elf",
    "usr/lib/x86_64-linux-gnu/gconv/gconv-modules": "module",
}
# Each a change of what the verifier's tools load (a new file, or the image's changed).
CONFIG_CHANGES = [
    "etc/nsswitch.conf",
    "etc/pam.d/su",
    "etc/pam.d/other",  # new: the PAM service of every program without its own
    "etc/pam.d/common-session",
    "etc/security/limits.conf",
    "etc/profile.d/zz.sh",
    "etc/bash.bashrc",
    "etc/environment",
    "etc/inputrc",
    "etc/magic",
    "etc/ssl/openssl.cnf",
    "etc/localtime",
    "etc/default/locale",
    "etc/gitconfig",
    "etc/alternatives/awk",
    "usr/share/zoneinfo/UTC",
    "usr/lib/locale/locale-archive",
    "usr/share/misc/magic.mgc",
    "usr/share/locale/C.UTF-8/LC_MESSAGES/coreutils.mo",  # gettext reads it under LANG=C.UTF-8
    "usr/lib/x86_64-linux-gnu/libnss_tmaxevil.so.2",
    "usr/lib/x86_64-linux-gnu/gconv/gconv-modules.d/evil.conf",
    "usr/lib/x86_64-linux-gnu/security/pam_evil.so",
    "usr/lib/x86_64-linux-gnu/ossl-modules/evil.so",
    "usr/local/bin/pytest-3",
    "usr/local/bin/py.test-3",
    "usr/local/bin/python3.99",
    "usr/local/bin/tmaxrun",  # the tests' script looks for it
    "usr/local/bin/curl",  # the tests' script installs it (into /usr/bin, later on PATH)
]
# Configuration of the system's services, new commands nobody asked for, and image files copied up
# unchanged: the agent's business.
ALLOWED_CHANGES = {
    "etc/hosts": "127.0.0.1 tmax\n",
    "etc/nginx/sites-enabled/app": "server {}\n",
    "etc/cron.d/job": "* * * * * root true\n",
    "etc/pam.d/sshd": "auth include common-auth\n",  # a new service (an sshd the agent installed)
    "etc/alternatives/java": "/usr/lib/jvm/java",
    "etc/ssl/certs/my-ca.pem": "cert",
    "etc/nsswitch.conf": "passwd: files\n",  # copied up, same bytes
    "usr/lib/x86_64-linux-gnu/libpq.so.5": "elf",
    "usr/local/bin/mytool": "#!/bin/sh\n",
    "usr/share/locale/de/LC_MESSAGES/mytool.mo": "catalog",
    "usr/local/bin/tmax-tool": "#!/bin/sh\n",  # a tool the task asked for, which the tests run
}


def _layers(tmp_path: Path) -> tuple[Path, list[str], Path]:
    lower, upper, tests = tmp_path / "lower", tmp_path / "upper", tmp_path / "tests"
    for rel, data in IMAGE_FILES.items():
        (lower / rel).parent.mkdir(parents=True, exist_ok=True)
        (lower / rel).write_text(data)
    upper.mkdir()
    tests.mkdir()
    (tests / "test.sh").write_text(
        "#!/bin/bash\napt-get install -y curl\ncd /app\n"
        "if command -v tmaxrun; then tmaxrun; else tmax-tool --check; fi && echo 1 > /logs/r\n"
    )
    return upper, [str(lower)], tests


def _plant(upper: Path, rel: str, data: str = "agent's\n") -> None:
    (upper / rel).parent.mkdir(parents=True, exist_ok=True)
    (upper / rel).write_text(data)


@pytest.mark.parametrize("rel", CONFIG_CHANGES)
def test_each_config_and_harness_change_is_found(tmp_path, rel):
    upper, lowers, tests = _layers(tmp_path)
    _plant(upper, rel)
    reason = podman_toolchain.scan(upper, lowers, tests)
    assert reason is not None and reason.startswith(f"/{rel} "), reason


def test_task_config_and_unchanged_copies_are_allowed(tmp_path):
    upper, lowers, tests = _layers(tmp_path)
    for rel, data in ALLOWED_CHANGES.items():
        _plant(upper, rel, data)
    assert podman_toolchain.scan(upper, lowers, tests) is None


def test_harness_commands_are_what_the_tests_scripts_look_for_or_install(tmp_path):
    (tmp_path / "run").write_text("#!/bin/sh\nfor c in fastcheck slowcheck; do type $c && break; done\n")
    (tmp_path / "test.sh").write_text(
        "apt-get update; apt-get install -y curl jq=1.6 && pip install 'pytest==8.4.1'\n"
        "if command -v uv >/dev/null; then :; else curl -Ls x | sh; fi  # which comment\n"
        "[ -x /usr/local/bin/mycheck ] && /usr/local/bin/mycheck; which tool2 || true\n"
        "tmax-tool --check | grep -v ok; bash -c 'ran --all'\n"
    )
    (tmp_path / "notes.txt").write_text("which notinscript\n")
    got = podman_toolchain.harness_commands(tmp_path)
    assert got == {"curl", "jq", "pytest", "uv", "mycheck", "tool2", "fastcheck", "slowcheck"}, got


def test_watch_sees_config_planted_and_removed(tmp_path):
    """A process the agent left that writes a magic rule only while the verifier runs."""
    upper, lowers, _ = _layers(tmp_path)
    (upper / "etc").mkdir()  # as in a sandbox: the agent's /etc has an upper dir from the start
    watch = podman_toolchain.Watch(upper).start()
    _plant(upper, "etc/magic")
    (upper / "etc/magic").unlink()
    assert podman_toolchain.scan(upper, lowers) is None  # nothing left for a scan to see
    time.sleep(0.3)
    reason = watch.stop()
    assert reason is not None and "/etc/magic" in reason, reason
