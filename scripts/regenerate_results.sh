#!/usr/bin/env bash
# Regenerate every committed QA result, then re-execute the pages that read them.
#
#   bash scripts/regenerate_results.sh           # every QA notebook's result (a few minutes)
#   bash scripts/regenerate_results.sh --bench   # and the benchmarks too (15 to 25 minutes more)
#   bash scripts/regenerate_results.sh --llamacpp   # and time the llama.cpp build, then run llama.cpp on the real model
#   bash scripts/regenerate_results.sh --long       # and the long records (tens of minutes)
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
# - qa/results/llamacpp_build.json is the same kind of record: `python -m labcode.engines.llamacpp`
#   downloads llama-cpp-python's source archive and times the compilation of llama.cpp, which chapter 9
#   weighs against the test command's budget. It needs the package registry and is regenerated only
#   when asked (--llamacpp).
# - qa/results/llamacpp_compare.json is the same kind of record: `python -m labcode.engines.llamacpp_compare`
#   runs llama.cpp (the wheel the build just kept, installed into a temporary folder outside .venv and
#   given with --site) on the course's real model beside the course's model and caches; only with --llamacpp.
# - qa/results/*_long.json are long records: a QA notebook run on texts of a thousand tokens and more,
#   minutes of every core, regenerated only when asked (--long). They are written by the QA notebook
#   like every other result and compared by the same rules, by tests/test_qa.py when
#   KVCV_LONG_RECORDS=1 is set; the test command checks their schema and committed checks only.
#
# If a QA run fails, the script stops with papermill's error; the executed notebook is kept in
# qa/_runs/ for reading.
set -euo pipefail
cd "$(dirname "$0")/.."
bench=0
llamacpp=0
long=0
for arg in "$@"; do
  case "$arg" in
    --bench) bench=1 ;;
    --llamacpp) llamacpp=1 ;;
    --long) long=1 ;;
    *) echo "usage: bash scripts/regenerate_results.sh [--bench] [--llamacpp] [--long]" >&2; exit 2 ;;
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
run_qa qa/real_windows.ipynb real_windows.json
run_qa qa/serving.ipynb serving.json
run_qa qa/rollback.ipynb rollback.json
run_qa qa/smaller_caches.ipynb smaller_caches.json
if [ "$long" = 1 ]; then
  # Long records (<name>_long.json): the same QA notebooks on long texts, minutes of every core. The
  # test command checks their schema and committed checks; to regenerate one into a temporary folder
  # and compare it with the committed file by its rules instead of overwriting it, run
  #   KVCV_LONG_RECORDS=1 .venv/bin/python -m pytest tests/test_qa.py -k _long
  echo "regenerating the long records (tens of minutes of every core)"
run_qa qa/smaller_caches.ipynb smaller_caches_long.json -p modules json,re,argparse \
    -p n_context 1024 -p n_next 128 -p budget 128 -p kivi_residual 128 -p passkey_module typing \
    -p passkey_filler 1024 -p depths 0.1,0.3,0.5,0.7,0.9 -p passkey_budgets 64,128,256
run_qa qa/real_model.ipynb real_model_long.json -p modules json,typing,logging -p n_tokens 2048 \
    -p windows 64,256,1024
run_qa qa/real_windows.ipynb real_windows_long.json -p texts "typing,inspect;asyncio,os" -p n_tokens 5120 \
    -p sweep_windows 16,64,256,1024,4096 -p recompute_windows 64,256,1024 -p recompute_samples 32 \
    -p schedule_window 256 -p schedule_tokens 1024 -p chunk_sizes 1,16,64,256
fi
# (tests/test_qa.py checks that every committed result has its line here.)
if [ "$bench" = 1 ]; then
  echo "regenerating qa/results/bench.json (the benchmarks, several minutes)"
  .venv/bin/python -m labcode.bench --full --no-progress --out qa/results/bench.json
fi
if [ "$llamacpp" = 1 ]; then
  echo "regenerating qa/results/llamacpp_build.json (downloads and compiles llama.cpp, minutes of every core)"
  lcpp_tmp="$(mktemp -d)"
  trap 'rm -rf "$lcpp_tmp"' EXIT
  .venv/bin/python -m labcode.engines.llamacpp --out qa/results/llamacpp_build.json --keep-wheel "$lcpp_tmp/wheel"
  echo "regenerating qa/results/llamacpp_compare.json (llama.cpp on the real model, against the course's caches)"
  .venv/bin/pip install --quiet --no-deps --target "$lcpp_tmp/site" "$lcpp_tmp"/wheel/llama_cpp_python-*.whl
  .venv/bin/python -m labcode.engines.llamacpp_compare --out qa/results/llamacpp_compare.json --site "$lcpp_tmp/site"
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
