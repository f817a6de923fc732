#!/usr/bin/env bash
# The test command: set up (idempotent) and run the whole suite, real small models included.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest -q -p no:cacheprovider --timeout 900 "$@"
