#!/usr/bin/env bash
# Opt-in (not part of CI): the source distribution installs on a machine without the repository.
# Builds the sdist, copies it alone into a temporary folder, makes a fresh virtual environment
# there with the same torch as $PYTHON's, installs the archive with
# `pip install --no-build-isolation`, then, from that folder, runs `gemini-ext info` and trains
# a tiny model on the sim device (or cuda where the build has it). Honours PYTHON and MAX_JOBS.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
export MAX_JOBS="${MAX_JOBS:-$(nproc)}"
scratch="$(mktemp -d)"
trap 'rm -rf "$scratch"' EXIT
started=$SECONDS

mkdir -p "$scratch/egg" "$scratch/dist"
(cd "$REPO" && "$PYTHON" setup.py -q egg_info --egg-base "$scratch/egg" sdist --dist-dir "$scratch/dist") >/dev/null
archive="$(ls "$scratch"/dist/gemini_ext-*.tar.gz)"
echo "[sdist] $(basename "$archive"): $(tar tzf "$archive" | wc -l) entries, $(du -h "$archive" | cut -f1)"

mkdir "$scratch/elsewhere"
cp "$archive" "$scratch/elsewhere/"
cd "$scratch/elsewhere"
torch_spec="$("$PYTHON" -c 'import torch; print(torch.__version__.split("+")[0])')"
"$PYTHON" -m venv "$scratch/venv"
venv_python="$scratch/venv/bin/python"
"$venv_python" -m pip install -q "torch==$torch_spec" "setuptools>=64" wheel
build_started=$SECONDS
"$venv_python" -m pip install -q --no-build-isolation ./"$(basename "$archive")"
echo "[sdist] installed in $((SECONDS - build_started)) s"
"$scratch/venv/bin/gemini-ext" info
"$venv_python" - <<'PY'
import os
import torch
import gemini_ext as gx

assert not os.path.exists(os.path.join(os.path.dirname(gx.__file__), "..", "csrc")), gx.__file__
device = "cuda" if gx._C.build_info()["cuda"] and torch.cuda.is_available() else "sim"
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
cfg = gx.GeminiConfig(device=device, precision="fp32", chunk_config_dict={"chunk_size": 4096})
with gx.enable(model, cfg) as engine:
    opt = engine.optimizer(torch.optim.AdamW, lr=1e-2)
    x = torch.randn(32, 64, device=engine.compute_device)
    losses = []
    for _ in range(20):
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
assert losses[-1] < losses[0] / 2, losses
print(f"[sdist] gemini_ext {gx.__version__} from {os.path.dirname(gx.__file__)} trained on {device}: "
      f"loss {losses[0]:.4f} -> {losses[-1]:.4f}")
PY
echo "[sdist] passed in $((SECONDS - started)) s"
