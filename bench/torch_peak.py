"""torch's peak-memory counter after training under the engine (cuda): what a user reads with
torch.cuda.max_memory_allocated() beside the engine's own per-iteration non-model peaks, which
it measures in a window of its own instead of resetting torch's counter.

    python3 bench/torch_peak.py        # gpt-1.3b, bf16, auto, 8 x 1024 tokens, 4 steps
"""
import time
import torch
import gemini_ext as gx
from gemini_ext.models import GPT, GPT_PRESETS, synthetic_batch

torch.manual_seed(0)
cfg = GPT_PRESETS["1.3b"]
model = GPT(cfg)
torch.cuda.reset_peak_memory_stats()
with gx.enable(model, gx.GeminiConfig(precision="bf16", placement_policy="auto")) as engine:
    opt = engine.optimizer(torch.optim.AdamW, lr=3e-4)
    times = []
    for step in range(4):
        t = time.perf_counter()
        x, y = synthetic_batch(cfg, 8, 1024, step, "cuda")
        model(x, y).backward()
        opt.step()
        opt.zero_grad()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    engine.synchronize()
    steps = engine.stats()["steps"]
    user_peak = torch.cuda.max_memory_allocated()
    print(f"torch.cuda.max_memory_allocated() after 4 steps: {user_peak / 2**30:.2f} GiB")
    print("engine non_model_peak_bytes per iteration (GiB):",
          [round(s["non_model_peak_bytes"] / 2**30, 2) for s in steps])
    print("step seconds:", [round(t, 3) for t in times])
    assert user_peak >= max(s["non_model_peak_bytes"] for s in steps)
