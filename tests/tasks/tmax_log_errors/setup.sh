#!/bin/bash
# Runs at build time in /tmp/tmax-setup with the fixtures next to it.
set -euo pipefail
cp "$FIXTURES_DIR"/*.log /home/user/logs/
