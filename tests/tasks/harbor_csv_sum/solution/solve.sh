#!/bin/bash
set -euo pipefail
cd /app
awk -F, 'NR > 1 { s += $2 * $3 } END { printf "%.2f\n", s }' sales.csv > revenue.txt
