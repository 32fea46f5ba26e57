"""Shared caches built by two processes at once: the host rootfs, a bwrap layer, the podman base
image. Both processes must end with the same complete entry, built once; a damaged entry (half of
its standard library deleted) is detected on the next use and rebuilt."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tmax_jax.cache_publish import check_tree, read_manifest, verify_tree
from tmax_jax.sandbox.recipe import parse_dockerfile
from tmax_jax.sandbox.rootfs_builder import ID_FILE, SKIP_STDLIB, cached_host_rootfs, check_rootfs

HOST_STDLIB = Path("/usr/lib/python3.11")
ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(
    not HOST_STDLIB.is_dir(), reason="the host rootfs builder needs Debian's /usr/bin/python3 (3.11)"
)

# Each child announces itself, then waits for the parent's "go", so both start building together.
BARRIER = """
import json, os, sys, time
from pathlib import Path
sync = Path(sys.argv[1]); name = sys.argv[2]
(sync / ("ready-" + name)).touch()
deadline = time.monotonic() + 120
while not (sync / "go").exists():
    if time.monotonic() > deadline:
        sys.exit("no go signal")
    time.sleep(0.005)
"""


def _together(tmp_path: Path, body: str, args: list[str], n: int = 2) -> list[dict]:
    """Run ``BARRIER + body`` in ``n`` processes released at the same moment; their JSON outputs."""
    sync = tmp_path / f"sync-{uuid.uuid4().hex[:6]}"
    sync.mkdir()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", BARRIER + body, str(sync), str(i), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for i in range(n)
    ]
    deadline = time.monotonic() + 120
    while len(list(sync.glob("ready-*"))) < n and time.monotonic() < deadline:
        time.sleep(0.01)
    (sync / "go").touch()
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=600)
        assert p.returncode == 0, err[-3000:]
        outs.append(json.loads(out.strip().splitlines()[-1]))
    return outs


def _stdlib_names(root: Path) -> set[str]:
    return set(os.listdir(root / "usr/lib/python3.11"))


def _assert_complete_rootfs(root: Path, ident: str) -> None:
    # Against the builder's own manifest, every file re-hashed.
    assert verify_tree(root, skip=frozenset({ID_FILE})) is None
    assert (root / ID_FILE).read_text().strip() == ident
    # Against the host: every stdlib entry the builder means to copy is there.
    assert _stdlib_names(root) == {n for n in os.listdir(HOST_STDLIB) if n not in SKIP_STDLIB}
    # And the rootfs's own Python starts from it: the imports the damaged cache of the issue lacked.
    probe = "import json, importlib, encodings, email, sqlite3; print(json.__file__)"
    r = subprocess.run(
        [str(root / "usr/bin/python3"), "-I", "-c", probe],
        env={"PYTHONHOME": str(root / "usr"), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr[-1500:]
    assert r.stdout.strip() == str(root / "usr/lib/python3.11/json/__init__.py")


def _damage_stdlib(root: Path) -> list[str]:
    """Delete every other top-level entry of the stdlib, as a half-finished copy would leave it."""
    import shutil

    lib = root / "usr/lib/python3.11"
    gone = sorted(os.listdir(lib))[::2]
    for name in gone:
        p = lib / name
        shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
    return gone


ROOTFS_CHILD = """
from tmax_jax.sandbox.rootfs_builder import cached_host_rootfs
root, ident = cached_host_rootfs(sys.argv[3])
print(json.dumps({"root": str(root), "id": ident, "ino": os.stat(root).st_ino}))
"""


@pytest.fixture(scope="module")
def raced_rootfs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("rootfs-race")
    cache = tmp / "cache"
    return cache, _together(tmp, ROOTFS_CHILD, [str(cache)])


def test_rootfs_built_by_two_processes_at_once_is_one_complete_tree(raced_rootfs):
    cache, (a, b) = raced_rootfs
    assert a["id"] == b["id"] and a["root"] == b["root"]
    assert a["ino"] == b["ino"]  # one published tree, never replaced under the other process
    root = Path(a["root"])
    _assert_complete_rootfs(root, a["id"])
    assert read_manifest(root)["id"][:16] == a["id"]
    leftovers = [p.name for p in root.parent.iterdir() if p.name.startswith(f".{root.name}.tmp-")]
    assert leftovers == []


def test_damaged_rootfs_is_detected_and_rebuilt(raced_rootfs):
    cache, (a, _) = raced_rootfs
    root = Path(a["root"])
    gone = _damage_stdlib(root)
    doc, why = check_rootfs(root)
    assert doc is None and f"usr/lib/python3.11/{gone[0]}" in why
    again, ident = cached_host_rootfs(cache)
    assert again == root and ident == a["id"]  # the same content, so the same id
    _assert_complete_rootfs(root, ident)
    # A tree from before manifests (only an id file, as the old builder left it) is not trusted.
    (root / ".tmax-manifest.json").unlink()
    assert "no readable .tmax-manifest.json" in check_rootfs(root)[1]


def test_truncated_file_is_detected(tmp_path):
    from tmax_jax.cache_publish import publish_tree

    final = tmp_path / "entry"

    def build(d: Path) -> None:
        (d / "sub").mkdir()
        (d / "sub" / "a.bin").write_bytes(os.urandom(4096))
        os.symlink("sub/a.bin", d / "link")

    doc, built = publish_tree(final, build)
    assert built and check_tree(final)[1] is None
    assert publish_tree(final, build) == (doc, False)
    with open(final / "sub" / "a.bin", "r+b") as f:
        f.truncate(100)
    assert "sub/a.bin" in check_tree(final)[1] and "100 bytes" in check_tree(final)[1]
    _, built = publish_tree(final, build)
    assert built and verify_tree(final) is None


LAYER_CHILD = """
from tmax_jax.sandbox.config import SandboxConfig
from tmax_jax.sandbox.layers import build_layer
from tmax_jax.sandbox.recipe import parse_dockerfile
logs = []
img = build_layer(SandboxConfig(cache_dir=sys.argv[3]), parse_dockerfile(Path(sys.argv[4])), log=logs.append)
print(json.dumps({"layer": str(img.layer), "built": bool(logs)}))
"""


def _layer_task(tmp_path: Path) -> tuple[Path, dict[str, bytes]]:
    ctx = tmp_path / "env"
    files = {f"data/f{i:02d}.txt": f"file {i}\n".encode() * (i + 1) for i in range(24)}
    for rel, data in files.items():
        (ctx / rel).parent.mkdir(parents=True, exist_ok=True)
        (ctx / rel).write_bytes(data)
    df = ctx / "Dockerfile"
    df.write_text("FROM ubuntu:24.04\nWORKDIR /app\nCOPY data/ /app/data/\nRUN ls data | wc -l > count.txt\n")
    return df, files


def _assert_layer(layer: Path, files: dict[str, bytes]) -> None:
    assert verify_tree(layer) is None
    for rel, data in files.items():
        assert (layer / "fs/app" / rel).read_bytes() == data
    assert (layer / "fs/app/count.txt").read_text().strip() == str(len(files))


def test_layer_built_by_two_processes_at_once_once_and_damage_rebuilt(tmp_path):
    from tmax_jax.sandbox.config import SandboxConfig
    from tmax_jax.sandbox.layers import build_layer, layer_problem

    df, files = _layer_task(tmp_path)
    cache = tmp_path / "cache"
    a, b = _together(tmp_path, LAYER_CHILD, [str(cache), str(df)])
    assert a["layer"] == b["layer"]
    assert sorted([a["built"], b["built"]]) == [False, True]  # the lock: one replayed, one waited
    layer = Path(a["layer"])
    _assert_layer(layer, files)

    data = layer / "fs/app/data"
    gone = sorted(os.listdir(data))[::2]
    for name in gone:
        (data / name).unlink()
    assert f"fs/app/data/{gone[0]}" in layer_problem(layer)
    logs: list[str] = []
    img = build_layer(SandboxConfig(cache_dir=str(cache)), parse_dockerfile(df), log=logs.append)
    assert img.layer == layer and logs  # replayed again
    _assert_layer(layer, files)


PODMAN_CHILD = """
from tmax_jax.sandbox.config import SandboxConfig
from tmax_jax.sandbox.podman_images import ensure_base_image, image_id
tag = ensure_base_image(SandboxConfig(backend="podman", cache_dir=sys.argv[3]), repo=sys.argv[4])
print(json.dumps({"tag": tag, "id": image_id(tag)}))
"""


def _podman_probe(tag: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            "podman", "run", "--rm", "--runtime", "runc", "--network", "none",
            "--ulimit=nofile=20000:20000", "--ulimit=nproc=4096:4096",
            tag, "python3", "-c", "import json, importlib, encodings, email; print('ok')",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )  # fmt: skip


def _repo_images(repo: str) -> list[str]:
    r = subprocess.run(
        ["podman", "images", "--filter", f"reference={repo}", "--format", "{{.Repository}}:{{.Tag}} {{.ID}}"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    return sorted(r.stdout.split("\n")[:-1])


@pytest.mark.podman
def test_podman_base_image_two_processes_at_once_and_damage_reimported(tmp_path):
    from tmax_jax.sandbox.podman_images import podman_available

    ok, why = podman_available()
    if not ok:
        pytest.skip(why)
    # A repository name of its own: other processes on this machine use localhost/tmax-base.
    repo = f"localhost/tmax-test-{uuid.uuid4().hex[:8]}"
    cache = tmp_path / "cache"
    ids: list[str] = []
    try:
        a, b = _together(tmp_path, PODMAN_CHILD, [str(cache), repo])
        ids.append(a["id"])  # left dangling once the damaged image takes its name
        assert a == b
        root, ident = cached_host_rootfs(cache)
        assert a["tag"] == f"{repo}:{ident}"
        assert _repo_images(repo) == [f"{a['tag']} {a['id'][:12]}"]  # imported once, no temp names left
        r = _podman_probe(a["tag"])
        assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-1500:]

        # The damaged image: the right name and label, half a standard library.
        tar = subprocess.Popen(
            ["tar", "-C", str(root), "-c", "--exclude=./usr/lib/python3.11/encodings", "."],
            stdout=subprocess.PIPE,
        )
        r = subprocess.run(
            ["podman", "import", "--change", f"LABEL tmax-jax.rootfs-id={ident}", "-", a["tag"]],
            stdin=tar.stdout,
            capture_output=True,
            timeout=300,
        )
        tar.wait()
        assert r.returncode == 0, r.stderr[-800:]
        assert "No module named 'encodings'" in _podman_probe(a["tag"]).stderr

        (c,) = _together(tmp_path, PODMAN_CHILD, [str(cache), repo], n=1)  # a new process: first use
        assert c["tag"] == a["tag"] and c["id"] != a["id"]
        r = _podman_probe(c["tag"])
        assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-1500:]
    finally:
        for line in _repo_images(repo):
            subprocess.run(["podman", "rmi", "-f", line.split()[0]], capture_output=True, timeout=120)
        for image in ids:
            subprocess.run(["podman", "rmi", "-f", image], capture_output=True, timeout=120)


FILE_CHILD = """
from tmax_jax.cache_publish import publish_file
built = []
def build(tmp):
    built.append(1)
    time.sleep(0.3)  # a slow builder, so the other process arrives while this one holds the lock
    tmp.write_bytes(bytes(range(256)) * 64)
publish_file(Path(sys.argv[3]), build)
print(json.dumps({"built": bool(built)}))
"""


def test_single_file_entry_built_once_and_truncation_rebuilt(tmp_path):
    """The mechanism of the apptainer .sif cache (apptainer itself is not installable here)."""
    from tmax_jax.cache_publish import publish_file

    final = tmp_path / "sif" / "base.sif"
    want = bytes(range(256)) * 64
    a, b = _together(tmp_path, FILE_CHILD, [str(final)])
    assert sorted([a["built"], b["built"]]) == [False, True]
    assert final.read_bytes() == want
    assert sorted(p.name for p in final.parent.iterdir()) == [
        ".base.sif.lock",
        "base.sif",
        "base.sif.manifest.json",
    ]
    final.write_bytes(want[:1000])
    calls = []
    publish_file(final, lambda tmp: (calls.append(1), tmp.write_bytes(want)))
    assert calls and final.read_bytes() == want
