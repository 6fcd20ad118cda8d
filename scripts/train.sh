#!/usr/bin/env bash
# The main job: trains the example GPT with gemini_ext (GPU if present, the sim device otherwise)
# and prints a closing summary. Installs whatever is missing first. Extra arguments go to
# examples/train_gpt.py (e.g. --preset 350m --steps 100).
source "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh"
ensure_torch
ensure_extension
cd "$REPO"
exec "$PYTHON" examples/train_gpt.py "$@"
