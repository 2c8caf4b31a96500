#!/usr/bin/env bash
# Execute notebooks in place (outputs are committed and checked by nbval), each in its own folder.
# Usage: bash scripts/execute_notebooks.sh notebooks/01_small_gpt.ipynb [more.ipynb ...]
set -euo pipefail
cd "$(dirname "$0")/.."
unset MPLBACKEND
# As in the tests: no Hugging Face cache the developer may have, so chapter 1's optional GPT-2 cell
# skips itself and the committed output is the one nbval expects on every machine.
export HF_HUB_OFFLINE=1 HF_HOME="$PWD/_build/empty-hf-home"
for nb in "$@"; do
  echo "executing $nb"
  .venv/bin/jupyter nbconvert --to notebook --execute --inplace \
    --ExecutePreprocessor.kernel_name=python3 --ExecutePreprocessor.timeout=600 "$nb"
done
