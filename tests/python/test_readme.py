"""The README's Python code runs as written: every ```python block, in order, in one namespace,
in a scratch directory (the Quick start trains on sim here and on cuda on a GPU machine)."""

import os
import re

import torch

from conftest import REPO


def _python_blocks(path):
    with open(path) as f:
        text = f.read()
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def test_the_readme_code_blocks_run_verbatim(tmp_path, monkeypatch):
    blocks = _python_blocks(os.path.join(REPO, "README.md"))
    assert blocks, "the README has a Quick start in Python"
    monkeypatch.chdir(tmp_path)
    namespace = {"__name__": "__readme__"}
    for block in blocks:
        exec(compile(block, "README.md", "exec"), namespace)
    model, loss = namespace["model"], namespace["loss"]
    assert all(p.dtype == torch.float32 and p.grad is None for p in model.parameters()), "ordinary parameters again"
    assert torch.isfinite(loss).item()
    assert os.path.isdir(tmp_path / "ckpt"), "the checkpoint was written"
