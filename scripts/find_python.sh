#!/usr/bin/env bash
# Prints the path of a Python >= 3.12 (JAX >= 0.11 needs it): first on PATH, then under pyenv;
# the oldest that qualifies, since 3.12 is what the GPU machines run.
set -u
ok() { "$1" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 12) else 1)' 2>/dev/null; }
for name in python3.12 python3.13 python3.14 python3 python; do
  path=$(command -v "$name" 2>/dev/null) && ok "$path" && { echo "$path"; exit 0; }
done
roots=()
command -v pyenv >/dev/null 2>&1 && roots+=("$(pyenv root)")
roots+=("${PYENV_ROOT:-$HOME/.pyenv}")
for root in "${roots[@]}"; do
  for path in $(ls -d "$root"/versions/3.1[2-9]*/bin/python 2>/dev/null | sort -V); do
    ok "$path" && { echo "$path"; exit 0; }
  done
done
echo "jspec needs Python >= 3.12 (JAX >= 0.11 requires it): none found on PATH or under pyenv." >&2
echo "Install one (e.g. 'pyenv install 3.12') and run make again." >&2
exit 1
