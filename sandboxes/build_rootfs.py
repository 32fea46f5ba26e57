#!/usr/bin/env python3
"""Build a root filesystem for the bwrap backend (and the Podman/Apptainer base images).

    python3 sandboxes/build_rootfs.py OUT_DIR                 # from the host's binaries (seconds, offline)
    python3 sandboxes/build_rootfs.py OUT_DIR --debootstrap   # minimal Debian (minutes, needs the mirror)
    python3 sandboxes/build_rootfs.py OUT_DIR --podman-tag localhost/tmax-base:custom   # also podman import

Then ``SandboxConfig(rootfs="OUT_DIR")`` or ``tmax-jax run-task TASK --rootfs OUT_DIR``.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", type=Path, help="directory to create")
    p.add_argument(
        "--debootstrap", action="store_true", help="use debootstrap instead of the host's binaries"
    )
    p.add_argument("--suite", default="bookworm", help="Debian suite for --debootstrap")
    p.add_argument("--mirror", default="http://deb.debian.org/debian", help="Debian mirror for --debootstrap")
    p.add_argument("--podman-tag", help="also import the rootfs into podman under this tag")
    args = p.parse_args()
    from tmax_jax.sandbox.rootfs_builder import build_host_rootfs, debootstrap_rootfs

    if args.debootstrap:
        debootstrap_rootfs(args.out, args.suite, args.mirror)
    else:
        build_host_rootfs(args.out)
    print(f"rootfs ready: {args.out}")
    if args.podman_tag:
        tar = subprocess.Popen(["tar", "-C", str(args.out), "-c", "."], stdout=subprocess.PIPE)
        r = subprocess.run(["podman", "import", "-", args.podman_tag], stdin=tar.stdout)
        tar.wait()
        if r.returncode != 0:
            return r.returncode
        print(f"podman image: {args.podman_tag}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
