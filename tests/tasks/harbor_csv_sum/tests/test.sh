#!/bin/bash
# Harbor verifier: run the pytest checks, write 1 or 0 to /logs/verifier/reward.txt.
mkdir -p /logs/verifier
if python3 -m pytest -q -p no:cacheprovider /tests/test_outputs.py; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
