#!/usr/bin/env bash
# Opt-in (not part of CI): the tests that use an integration package, run against the oldest
# releases pyproject.toml's extras allow. Every `>=` floor of the transformers, lightning, export
# and plot extras is installed exactly (`==`), with the same torch as $PYTHON's, into a fresh
# virtual environment in a temporary folder; the tests import this checkout's in-place build
# (which is built first if needed). Extra arguments go to pytest. Results: docs/TESTING.md.
source "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh"
ensure_torch
ensure_extension
cd "$REPO"

mapfile -t floors < <("$PYTHON" - <<'PY'
import tomllib
from packaging.requirements import Requirement

extras = tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]
for name in ("transformers", "lightning", "export", "plot"):
    for text in extras[name]:
        req = Requirement(text)
        floor = [s.version for s in req.specifier if s.operator == ">="]
        print(f"{req.name}=={floor[0]}" if floor else req.name)
PY
)
torch_version="$("$PYTHON" -c 'import torch; print(torch.__version__.split("+")[0])')"
scratch="$(mktemp -d)"
trap 'rm -rf "$scratch"' EXIT
"$PYTHON" -m venv "$scratch/venv"
floor_python="$scratch/venv/bin/python"
log "floor environment: torch==$torch_version ${floors[*]}"
"$floor_python" -m pip install -q "torch==$torch_version" pytest "${floors[@]}"
"$floor_python" -m pip list 2>/dev/null | grep -i -E "^(torch|transformers|accelerate|lightning|safetensors|matplotlib|huggingface.hub|tokenizers|numpy) " >&2

tests=(tests/python/test_integration_transformers.py tests/python/test_integration_lightning.py
       tests/python/test_example.py tests/python/test_export.py tests/python/test_compile.py
       tests/python/test_budget_floor.py tests/python/test_hostile.py)
PYTHONPATH="$REPO" OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" \
  "$floor_python" -m pytest -q -ra -p no:cacheprovider "${tests[@]}" "$@"
