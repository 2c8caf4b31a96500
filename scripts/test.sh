#!/usr/bin/env bash
# Set up if needed, then run the complete test suite: unit and property tests, drift tests,
# QA regeneration and result comparison, nbval on every notebook, a clean book build
# with warnings as errors, and the browser tests. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
unset MPLBACKEND
exec .venv/bin/python -m pytest "$@"
