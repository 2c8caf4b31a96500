#!/usr/bin/env bash
# Set up if needed, then build the book from scratch, executing every notebook.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
unset MPLBACKEND  # a non-interactive backend set here would drop every figure from the notebooks
rm -rf _build/html _build/jupyter_execute _build/.doctrees
.venv/bin/jupyter-book build . -W --keep-going
echo
echo "The book is at $(pwd)/_build/html/index.html"
