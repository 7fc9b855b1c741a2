#!/usr/bin/env bash
# Prints the path of a working Python 3.12 with venv and ensurepip (the version the package is built and tested
# with), or says what to install and exits 1. $PYTHON, when set, must be one; otherwise python3.12 on PATH, then
# pyenv's 3.12 versions (where `python3.12` is only a pyenv shim that does not run).
set -u
works() { [ -n "$1" ] && "$1" -c 'import sys, venv, ensurepip; sys.exit(sys.version_info[:2] != (3, 12))' >/dev/null 2>&1; }
if [ -n "${PYTHON:-}" ]; then
  if works "$PYTHON"; then command -v "$PYTHON"; exit 0; fi
  echo "PYTHON=$PYTHON is not a working Python 3.12 with venv and ensurepip" >&2
  exit 1
fi
candidate="$(command -v python3.12 2>/dev/null)"
if works "$candidate"; then echo "$candidate"; exit 0; fi
if command -v pyenv >/dev/null 2>&1; then
  # grep without -q reads pyenv's whole list: -q would exit at the match and pyenv die of SIGPIPE.
  for version in $(pyenv versions --bare 2>/dev/null | grep -E '^3\.12(\.[0-9]+)?$' | sort -t. -k3 -n -r); do
    candidate="$(PYENV_VERSION="$version" pyenv which python3 2>/dev/null)"
    if works "$candidate"; then echo "$candidate"; exit 0; fi
  done
fi
echo "jax_s2attn needs Python 3.12 with venv: install it (apt install python3.12 python3.12-venv, or pyenv install 3.12)," \
  "or name one with PYTHON=/path/to/python3.12" >&2
exit 1
