"""Progress lines of a train run on stderr, tagged with the JAX process when there are several."""

from __future__ import annotations

import sys

import jax


def log(msg: str) -> None:
    who = f" p{jax.process_index()}/{jax.process_count()}" if jax.process_count() > 1 else ""
    print(f"[tmax-jax train{who}] {msg}", file=sys.stderr, flush=True)
