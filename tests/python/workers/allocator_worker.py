"""One allocator scenario in a fresh process (GEMINI_EXT_ALLOCATOR is read at import, so each mode
needs its own interpreter); prints one JSON line with what the test asserts on.

    python tests/python/workers/allocator_worker.py parity|rescue|stats
"""

import faulthandler
import json
import os
import sys

faulthandler.enable()  # a crash prints the Python stack of every thread

import gemini_ext as gx  # noqa: E402  # first: under GEMINI_EXT_ALLOCATOR=chunk it installs the allocator here
import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/python: the shared helpers
from parity_utils import (LR, WD, batch, chunk_cap, config, make_models, max_relative_difference,  # noqa: E402
                          train_reference)


def parity() -> dict:
    model, reference = make_models()
    ref_losses = train_reference(reference, 4, torch.device("cuda"))
    losses = []
    with gx.enable(model, config("cuda", **chunk_cap("cuda", 8 * 4096 * 4))) as engine:
        opt = engine.optimizer(torch.optim.AdamW, lr=LR, weight_decay=WD)
        for step in range(4):
            x, y = batch(model.cfg, step, engine.compute_device)
            loss = model(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        stats = engine.stats()
        # what an out-of-memory note and the info log after enable() print
        figures = engine.internal.tracer.memory_figures()
    diffs = max_relative_difference(model, reference)
    return {"losses": losses, "ref_losses": ref_losses, "max_param_diff": max(diffs.values()),
            "evictions": stats["counters"]["evictions"],
            "non_model_peak": [s["non_model_peak_bytes"] for s in stats["steps"]],
            "memory_stats": gx.memory_stats(), "memory_figures": figures}


class Stack(torch.nn.Module):
    def __init__(self, width: int, depth: int):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width, bias=False) for _ in range(depth))
        for layer in self.layers:  # keeps the activations' scale through the ReLUs: a loss of order one
            torch.nn.init.kaiming_normal_(layer.weight, nonlinearity="relu")

    def forward(self, x):
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x.float().pow(2).mean()


def rescue() -> dict:
    """Chunks fill most of what is free on the device; the step's activations need more than what
    is left. Under `chunk` the allocator evicts chunks no layer computes on and the step completes;
    under `default` torch's allocator runs out of memory (the engine adds its note)."""
    width, depth, rows = 8192, 16, 4096
    layer_bytes = width * width * 4  # fp32 chunks: 256 MiB per layer, 4 GiB in all
    act_bytes = rows * width * 4     # one saved activation: 128 MiB, 2 GiB over the step
    torch.cuda.init()
    free, _ = torch.cuda.mem_get_info()
    # Room for every chunk plus half of the activations the step saves, and 1 GiB: the default
    # allocator runs out halfway through forward. With chunks evicted on demand the step needs
    # the activations and a working set of about 1.2 GiB (a layer's parameter and gradient chunks,
    # its weight gradient, the gradients flowing between layers): about 3.2 GiB of the 5 GiB.
    leave = depth * layer_bytes + (depth * act_bytes) // 2 + (1 << 30)
    blocker = torch.empty(max(0, free - leave), dtype=torch.uint8, device="cuda")  # noqa: F841
    torch.manual_seed(0)
    model = Stack(width, depth)
    cfg = gx.GeminiConfig(device="cuda", precision="fp32", placement_policy="const",
                          const_gpu_budget=depth * layer_bytes + (64 << 20),
                          offload_optim_frac=1.0, chunk_config_dict={"chunk_size": width * width})
    out = {"mode": gx.memory_stats()["mode"], "leave_bytes": leave}
    with gx.enable(model, cfg) as engine:
        opt = engine.optimizer(torch.optim.AdamW, lr=1e-4)
        out["losses"] = []
        for _ in range(2):  # the second step brings the evicted chunks back and evicts again
            x = torch.randn(rows, width, device="cuda")
            loss = model(x)
            loss.backward()
            opt.step()
            opt.zero_grad()
            out["losses"].append(loss.item())
        out["counters"] = engine.stats()["counters"]
    out["memory_stats"] = gx.memory_stats()
    return out


def stats() -> dict:
    """Exact accounting, record_stream and empty_cache under the active mode."""
    before = gx.memory_stats()
    x = torch.empty(3 << 20, dtype=torch.uint8, device="cuda")
    during = gx.memory_stats()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        y = x.view(torch.int32).add_(1)
    x.record_stream(side)
    del x, y
    torch.cuda.synchronize()
    after = gx.memory_stats()
    released = gx.empty_cache()
    return {"before": before, "during": during, "after": after, "released": released,
            "after_empty": gx.memory_stats(), "info": gx.info()["allocator mode"]}


if __name__ == "__main__":
    print(json.dumps({"parity": parity, "rescue": rescue, "stats": stats}[sys.argv[1]]()))
