#!/bin/bash
set -euo pipefail
cd /home/user/logs
for f in $(ls *.log | sort); do
  echo "$f: $(grep -c ERROR "$f" || true)"
done > "$REPORT"
