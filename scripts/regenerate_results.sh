#!/usr/bin/env bash
# Regenerate every committed QA result, then re-execute the pages that read them.
#
#   bash scripts/regenerate_results.sh           # every QA notebook's result (a few minutes)
#   bash scripts/regenerate_results.sh --bench   # and the benchmarks too (several minutes more)
#   bash scripts/regenerate_results.sh --llamacpp   # and time the llama.cpp build (minutes of every core)
#
# How the QA notebooks, their results and the tests fit together:
# - Each QA notebook (qa/*.ipynb except qa/verdicts.ipynb) takes papermill parameters in its first
#   code cell (tagged `parameters`) and writes one JSON result with labcode.results.QAResult:
#   atomically, and raising (so that papermill exits non-zero) when a check fails. The failed result
#   is still written, so the reason can be read.
# - The parameter `output_path` decides where the result goes. Its default, empty, means
#   qa/_runs/results/<name>.json, which git ignores: running a notebook with its defaults (nbval in
#   the test suite, a reader pressing "run all") never touches the committed qa/results/.
# - This script is where the committed parameters live: each papermill line below writes one file of
#   qa/results/. Only parameters that differ from the notebook's defaults are passed; the result file
#   records all of them (every parameter except output_path).
# - tests/test_qa.py replays each committed result: it re-runs the notebook named in the file with
#   the parameters recorded in it, into a temporary folder, and compares the two files (same checks,
#   same verdicts, values within stated tolerances, timings never compared).
#   tests/test_results_schema.py validates every file against qa/results.schema.json.
# - The QA notebooks are committed with the outputs of a default run, and qa/verdicts.ipynb and the
#   chapter-6 notebook with outputs computed from qa/results/; nbval checks all of them. So after
#   regenerating, this script re-executes them in place.
#
# - qa/results/bench.json is not written by a QA notebook: it is the benchmark record of
#   `python -m labcode.bench --full`, with timings of the machine it ran on. Timings are recorded,
#   never compared, so it is regenerated only when asked (--bench) and the tests do not replay it.
# - qa/results/llamacpp_build.json is the same kind of record: `python -m labcode.bench.llamacpp`
#   downloads llama-cpp-python's source archive and times the compilation of llama.cpp, which chapter 9
#   weighs against the test command's budget. It needs the package registry and is regenerated only
#   when asked (--llamacpp).
#
# If a QA run fails, the script stops with papermill's error; the executed notebook is kept in
# qa/_runs/ for reading.
set -euo pipefail
cd "$(dirname "$0")/.."
bench=0
llamacpp=0
for arg in "$@"; do
  case "$arg" in
    --bench) bench=1 ;;
    --llamacpp) llamacpp=1 ;;
    *) echo "usage: bash scripts/regenerate_results.sh [--bench] [--llamacpp]" >&2; exit 2 ;;
  esac
done
unset MPLBACKEND  # a non-interactive backend set here would drop every figure from the notebooks
mkdir -p qa/_runs

run_qa() {  # run_qa NOTEBOOK RESULT [papermill -p NAME VALUE ...]
  local notebook="$1" result="$2"
  shift 2
  echo "regenerating qa/results/$result from $notebook"
  .venv/bin/papermill -k python3 --cwd . --no-progress-bar --log-level WARNING \
    "$notebook" "qa/_runs/${result%.json}.ipynb" -p output_path "qa/results/$result" "$@"
}

run_qa qa/equivalence.ipynb equivalence_float64.json -p dtype float64
run_qa qa/equivalence.ipynb equivalence_float32.json -p dtype float32
run_qa qa/probes.ipynb probes.json
run_qa qa/rotary_kshift.ipynb rotary_kshift.json
run_qa qa/engines.ipynb engines.json
run_qa qa/hf_caches.ipynb hf_caches.json
run_qa qa/distributed.ipynb distributed.json
run_qa qa/windows.ipynb windows.json
run_qa qa/real_model.ipynb real_model.json
run_qa qa/serving.ipynb serving.json
run_qa qa/rollback.ipynb rollback.json
# (tests/test_qa.py checks that every committed result has its line here.)
if [ "$bench" = 1 ]; then
  echo "regenerating qa/results/bench.json (the benchmarks, several minutes)"
  .venv/bin/python -m labcode.bench --full --no-progress --out qa/results/bench.json
fi
if [ "$llamacpp" = 1 ]; then
  echo "regenerating qa/results/llamacpp_build.json (downloads and compiles llama.cpp, minutes of every core)"
  .venv/bin/python -m labcode.bench.llamacpp --out qa/results/llamacpp_build.json
fi

# Committed outputs: every QA notebook with its defaults (writing only under qa/_runs/), then the
# pages computed from qa/results/: the verification report and every chapter that reads the results.
qa_notebooks=()
for nb in qa/*.ipynb; do [ "$nb" != qa/verdicts.ipynb ] && qa_notebooks+=("$nb"); done
bash scripts/execute_notebooks.sh "${qa_notebooks[@]}"
readers=(qa/verdicts.ipynb)
for nb in notebooks/*.ipynb; do grep -q 'qa/results' "$nb" && readers+=("$nb"); done
bash scripts/execute_notebooks.sh "${readers[@]}"
echo "regenerated: $(ls qa/results/*.json | tr '\n' ' ')"
