#!/usr/bin/env bash
# Create or reuse the virtual environment .venv, install the locked requirements and
# labcode (editable), and install Debian's Chromium for the browser tests if it is missing.
# Idempotent: a second run with unchanged requirements does nothing and takes a second.
set -euo pipefail
cd "$(dirname "$0")/.."

venv="${KVCV_VENV:-.venv}"
py="${PYTHON:-python3}"
stamp="$venv/.kvcv-installed-$("$py" -c 'import hashlib, sys; print(hashlib.sha256(open("requirements.lock", "rb").read() + open("pyproject.toml", "rb").read()).hexdigest()[:16])')"

quiet_pip() {  # pip, without the per-package notes some machines' pip configs print
  "$venv/bin/python" -m pip "$@" 2>&1 | { grep -v -E "^WARNING: Location .* is ignored" || true; }
  return "${PIPESTATUS[0]}"
}

if [ ! -x "$venv/bin/python" ]; then
  echo "setup: creating $venv with $($py --version)"
  "$py" -m venv "$venv"
fi
if [ ! -e "$stamp" ]; then
  echo "setup: installing the locked requirements into $venv (about a minute and a half the first time)"
  quiet_pip install -q --disable-pip-version-check -r requirements.lock
  quiet_pip install -q --disable-pip-version-check --no-deps -e .
  rm -f "$venv"/.kvcv-installed-*
  touch "$stamp"
fi

if [ -n "${KVCV_CHROMIUM:-}" ]; then
  echo "setup: the browser tests will drive $KVCV_CHROMIUM (KVCV_CHROMIUM)"
elif [ ! -x /usr/bin/chromium ]; then
  if command -v apt-get >/dev/null 2>&1; then
    echo "setup: installing Debian's chromium for the browser tests (about a minute)"
    sudo_cmd=""
    [ "$(id -u)" -ne 0 ] && sudo_cmd="sudo"
    $sudo_cmd apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq chromium >/dev/null
  else
    echo "setup: no apt-get here, so no Chromium: the browser tests will be skipped (they are required in CI)"
  fi
fi
echo "setup: environment ready in $venv"
