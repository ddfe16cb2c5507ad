#!/usr/bin/env bash
# Regenerates python/kvcache/_core.pyi from the installed native module (pybind11-stubgen).
# CI runs it with --check and fails when the committed stub differs.
set -euo pipefail
cd "$(dirname "$0")/.."
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
(cd "$out" && python3 -m pybind11_stubgen kvcache._core -o . >/dev/null)
python3 -m ruff format -q "$out/kvcache/_core.pyi"
if [ "${1:-}" = "--check" ]; then
  diff -u python/kvcache/_core.pyi "$out/kvcache/_core.pyi" || {
    echo "python/kvcache/_core.pyi is stale: run scripts/gen_stubs.sh" >&2
    exit 1
  }
else
  cp "$out/kvcache/_core.pyi" python/kvcache/_core.pyi
fi
