#!/usr/bin/env bash
# Set up (idempotent), lint, and run the whole test suite. Extra arguments go to pytest.
# The suite runs on WT_TEST_WORKERS pytest-xdist workers (default 3 on the 2-core machines;
# 0 runs it in this process), each module on one worker, never more heavy modules (Ray
# fleets, engines) at once than cores: the third worker runs the light ones beside them.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check .
WORKERS=${WT_TEST_WORKERS:-3}
if [ "$WORKERS" = 0 ]; then
  .venv/bin/python -m pytest "$@"
else
  # loadfile hands out the modules costliest first by tests/module_seconds.json
  # (tests/xdist_order.py)
  .venv/bin/python -m pytest -n "$WORKERS" --dist loadfile "$@"
fi
