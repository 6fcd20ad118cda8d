"""Run as a script by test_integration_lightning with `devices=2`: Lightning's launcher runs this
file again as rank 1. Both ranks fit and resume the small GPT under DDP, then under
GeminiStrategy (sharded over Lightning's gloo group); rank 0 writes how far apart they are to
OUT/report.json."""

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/python: the shared helpers

import torch

from gemini_ext.integrations.lightning import ENGINE_SUFFIX, GeminiStrategy
from parity_utils import max_relative_difference
from test_integration_lightning import _config, _fit_then_resume


def main(out: str) -> None:
    torch.set_num_threads(1)  # the two ranks share the machine's cores
    root = Path(out)
    ddp_first, ddp_resumed, _ = _fit_then_resume(lambda: "ddp", root / "ddp", devices=2)
    strategies = []

    def gemini():
        strategies.append(GeminiStrategy(_config(sim_capacity=None)))  # the sim default: room for the gathered chunks
        return strategies[-1]

    gx_first, gx_resumed, ckpt = _fit_then_resume(gemini, root / "gx", devices=2)
    if strategies[-1].global_rank != 0:
        return
    report = {
        "world_size": strategies[-1].world_size,
        "engine_world_size": strategies[-1].engine.world_size,
        "ranks_on_host": strategies[-1].engine.stats()["distributed"]["ranks_on_host"],
        "engine_files": len(list((ckpt.parent / (ckpt.name + ENGINE_SUFFIX)).iterdir())),
        "first": max(max_relative_difference(gx_first, ddp_first).values()),
        "resumed": max(max_relative_difference(gx_resumed, ddp_resumed).values()),
    }
    (root / "report.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main(sys.argv[1])
