"""Write a drafted task in the Harbor / Terminal-Bench 2.0 layout."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

from tmax_jax.tasks.generator.base import TaskDraft, final_test_source

TEST_SH = """#!/bin/bash
# Runs the generated pytest verifier; it writes the graded reward itself (0 when it cannot run).
mkdir -p /logs/verifier
python3 -m pytest -q -p no:cacheprovider /tests/test_final_state.py
[ -f /logs/verifier/reward.txt ] || echo 0 > /logs/verifier/reward.txt
"""


def write_harbor_dir(draft: TaskDraft, sig: dict[str, str], out: Path, name: str, seed: int) -> Path:
    out.mkdir(parents=True, exist_ok=False)
    (out / "instruction.md").write_text(draft.prompt + "\n")
    meta = {"name": name, "family": draft.family, "seed": seed, **{f"axis_{k}": v for k, v in sig.items()}}
    toml = 'version = "1.0"\n\n[metadata]\n' + "".join(f"{k} = {json.dumps(v)}\n" for k, v in meta.items())
    services = "agent_services = true\n" if draft.limits.get("agent_services") else ""
    toml += f'\n[verifier]\ntimeout_sec = 120.0\n{services}\n[agent]\ntimeout_sec = 300.0\n\n[environment]\ncpus = 1\nmemory = "2G"\nstorage = "2G"\nallow_internet = false\n'
    (out / "task.toml").write_text(toml)
    env = out / "environment"
    (env / "fixtures").mkdir(parents=True)
    (env / "fixtures" / ".keep").write_text("")
    for rel, data in draft.fixtures.items():
        p = env / "fixtures" / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data) if isinstance(data, bytes) else p.write_text(data)
    (env / "setup.sh").write_text(
        '#!/bin/bash\nset -euo pipefail\nrm -f "$FIXTURES_DIR/.keep"\n' + draft.setup
    )
    post = " && ".join(line for line in draft.post.strip().splitlines() if line.strip()) or "true"
    (env / "Dockerfile").write_text(
        "FROM ubuntu:24.04\n"
        f"RUN {post}\n"
        "COPY fixtures/ /tmp/tmax-setup/fixtures/\n"
        "COPY setup.sh /tmp/tmax-setup/setup.sh\n"
        "RUN cd /tmp/tmax-setup && FIXTURES_DIR=/tmp/tmax-setup/fixtures bash setup.sh\n"
    )
    (out / "tests").mkdir()
    (out / "tests" / "test.sh").write_text(TEST_SH)
    (out / "tests" / "test_final_state.py").write_text(final_test_source(draft))
    (out / "solution").mkdir()
    (out / "solution" / "solve.sh").write_text(
        "#!/bin/bash\nset -euo pipefail\n" + textwrap.dedent(draft.solution).strip() + "\n"
    )
    return out
