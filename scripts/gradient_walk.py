"""The files one gradient's walk passes through: a backward and step() that clips (at 1.0) on sim.

Contributors' tool for the code's shape, not a test. The Python files come from sys.setprofile over
the measured backward and step(); the C++ files from gcov: build the extension with coverage
(CFLAGS=--coverage LDFLAGS=--coverage GEMINI_EXT_UNITY=0 python setup.py build_ext --inplace), then

    python scripts/gradient_walk.py --build-dir build --out /tmp/walk

runs the same training twice in fresh processes, once stopping after the measured iteration's
forward and once after its step(), and names the C++ files with a line run more often in the second.
Both processes end the same way (the engine closed), so the difference is the backward and the step.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import subprocess
import sys

WARM_ITERATIONS = 3  # the placement decided and the early step armed before the measured one


def train(stop_after: str, python_files_out: str | None) -> None:
    import torch

    import gemini_ext as gx
    from gemini_ext.models import GPT, GPTConfig, synthetic_batch

    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=128, max_seq_len=32, d_model=32, n_layers=2, n_heads=4, qkv_bias=False)
    model = GPT(cfg)
    config = gx.GeminiConfig(device="sim", precision="fp32", chunk_config_dict={"chunk_size": 4096},
                             max_norm=1.0)  # static: the parameters on the device, the optimizer on the host
    seen: list[str] = []

    def profile(frame, event, arg):
        name = frame.f_code.co_filename
        if event == "call" and "gemini_ext" in name and (not seen or seen[-1] != name):
            seen.append(name)

    with gx.enable(model, config) as engine:
        opt = engine.optimizer(torch.optim.AdamW, lr=1e-3, weight_decay=0.1)
        for it in range(WARM_ITERATIONS + 1):
            x, y = synthetic_batch(cfg, 4, 0, it, engine.compute_device)
            loss = model(x, y) * 100.0  # every step clips
            if it == WARM_ITERATIONS and stop_after == "forward":
                break
            if it == WARM_ITERATIONS:
                sys.setprofile(profile)
            loss.backward()
            opt.step()
            sys.setprofile(None)
            opt.zero_grad()
        print(json.dumps(opt.last_step_stats(), default=str)[:400])
    if python_files_out:
        root = os.path.dirname(os.path.dirname(os.path.abspath(gx.__file__)))
        turns = [os.path.relpath(f, root) for f in seen]
        with open(python_files_out, "w") as f:
            json.dump({"files": sorted(set(turns)), "turns": turns}, f, indent=1)


def line_counts(build_dir: str, gcda_dir: str) -> dict:
    """{source file: {line: count}} from the .gcda files copied to `gcda_dir`."""
    counts: dict = {}
    for gcda in glob.glob(os.path.join(gcda_dir, "**", "*.gcda"), recursive=True):
        rel = os.path.relpath(gcda, gcda_dir)
        gcno = os.path.join(build_dir, rel[:-5] + ".gcno")
        work = os.path.dirname(gcda)
        shutil.copy(gcno, work)
        out = subprocess.run(["gcov", "--json-format", "--stdout", os.path.basename(gcda)], cwd=work,
                             capture_output=True, text=True, check=True).stdout
        for doc in out.splitlines():
            for f in json.loads(doc)["files"]:
                per = counts.setdefault(os.path.normpath(f["file"]), {})
                for line in f["lines"]:
                    per[line["line_number"]] = per.get(line["line_number"], 0) + line["count"]
    return counts


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--build-dir", required=True, help="where the coverage build's objects (.gcno) are")
    ap.add_argument("--out", required=True)
    ap.add_argument("--child", choices=("forward", "step"))
    args = ap.parse_args()
    if args.child:
        train(args.child, os.path.join(args.out, "python.json") if args.child == "step" else None)
        return 0
    os.makedirs(args.out, exist_ok=True)
    runs = {}
    for stop in ("forward", "step"):
        for old in glob.glob(os.path.join(args.build_dir, "**", "*.gcda"), recursive=True):
            os.remove(old)
        subprocess.run([sys.executable, __file__, "--build-dir", args.build_dir, "--out", args.out, "--child", stop],
                       check=True)
        copy = os.path.join(args.out, stop)
        shutil.rmtree(copy, ignore_errors=True)
        shutil.copytree(args.build_dir, copy, ignore=shutil.ignore_patterns("*.o", "*.so", "*.gcno"))
        runs[stop] = line_counts(args.build_dir, copy)
    cpp = sorted(f for f, lines in runs["step"].items() if "csrc" in f and any(
        n > runs["forward"].get(f, {}).get(line, 0) for line, n in lines.items()))
    cpp = [f[f.index("csrc"):] for f in cpp]
    with open(os.path.join(args.out, "python.json")) as f:
        python = json.load(f)["files"]
    print(f"{len(python)} Python files, {len(cpp)} C++ files, {len(python) + len(cpp)} in all")
    for name in python + cpp:
        print("  " + name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
