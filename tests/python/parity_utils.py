"""Shared helpers of the parity and feature tests: a small GPT, the same batches for both sides."""

import copy

import torch

import gemini_ext as gx
from gemini_ext.models import GPT, GPTConfig, synthetic_batch

# Small enough for CI, big enough for several chunks of 4096 elements (36 tensors in 27 chunks).
SMALL = GPTConfig(vocab_size=128, max_seq_len=32, d_model=32, n_layers=2, n_heads=4, qkv_bias=False)
CHUNK = {"chunk_size": 4096}
LR, WD = 1e-3, 0.1


def torch_device(device: str) -> torch.device:
    return torch.device("cuda" if device == "cuda" else "cpu")


def make_models(cfg=SMALL, seed=0):
    torch.manual_seed(seed)
    model = GPT(cfg)
    return model, copy.deepcopy(model)


def config(device, **kw):
    kw.setdefault("chunk_config_dict", CHUNK)
    kw.setdefault("precision", "fp32")
    return gx.GeminiConfig(device=device, **kw)


def chunk_cap(device: str, nbytes: int) -> dict:
    """Config fields that cap the chunk bytes on the device at `nbytes`: the sim device's capacity
    on sim; on cuda the const policy's budget (gpu_memory_limit there covers activations too)."""
    if device == "cuda":
        return {"placement_policy": "const", "const_gpu_budget": nbytes}
    return {"sim_capacity": nbytes}


def host_sets_with_link_lane(engine, link_every: int) -> list[int]:
    """The chunk sets whose optimizer state is on the host; every `link_every`-th of them is
    given to the link lane (0: none)."""
    runtime = engine.internal.runtime
    host_sets = [k for k, p in enumerate(runtime.set_placements()) if p["trainable"] and p["optim_on_host"]]
    if link_every:
        runtime.set_link_sets(host_sets[::link_every])
    return host_sets


def batch(cfg, step, device, batch_size=4, seq=16):
    return synthetic_batch(cfg, batch_size, seq, step, device)


def train_step(model, opt, step, device) -> float:
    """One step on the batch of `step`: forward, plain backward, step, zero_grad; the loss."""
    x, y = batch(model.cfg, step, device)
    loss = model(x, y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def train_reference(model, steps, device, dtype=torch.float32, lr=LR, weight_decay=WD, max_norm=0.0,
                    opt_cls=torch.optim.AdamW, micro_batches=1, batch_size=4, slices=1):
    """Plain PyTorch: fp32 model (or autocast for 16-bit precisions) and torch.optim. `slices`:
    each batch's gradient accumulated over that many equal slices in order, as data-parallel ranks
    split it (the same gradient; each slice's kernels then run at the ranks' shapes)."""
    model.to(device)
    opt = opt_cls(model.parameters(), lr=lr, weight_decay=weight_decay)
    losses = []
    for step in range(steps):
        total = 0.0
        for micro in range(micro_batches):
            x, y = batch(model.cfg, step * micro_batches + micro, device, batch_size=batch_size)
            for xs, ys in zip(x.chunk(slices), y.chunk(slices)):
                with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
                    loss = model(xs, ys) / (micro_batches * slices)
                loss.backward()
                total += loss.item()
        if max_norm > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses


def train_gemini(model, steps, cfg, lr=LR, weight_decay=WD, opt_cls=torch.optim.AdamW, micro_batches=1,
                 use_no_sync=False, param_init_fn=None):
    losses = []
    with gx.enable(model, cfg, param_init_fn=param_init_fn) as engine:
        opt = engine.optimizer(opt_cls, lr=lr, weight_decay=weight_decay)
        for step in range(steps):
            total = 0.0
            for micro in range(micro_batches):
                x, y = batch(model.cfg, step * micro_batches + micro, engine.compute_device)
                last = micro == micro_batches - 1
                if use_no_sync and not last:
                    with engine.no_sync():
                        loss = model(x, y) / micro_batches
                        loss.backward()
                else:
                    loss = model(x, y) / micro_batches
                    loss.backward()
                total += loss.item()
            opt.step()
            opt.zero_grad()
            losses.append(total)
        stats = engine.stats()
    return losses, stats


def max_relative_difference(model, reference) -> dict:
    """Per parameter: max |a - b| / max |b| (compared on the CPU, fp32)."""
    out = {}
    for (name, a), (_, b) in zip(model.named_parameters(), reference.named_parameters()):
        a, b = a.detach().float().cpu(), b.detach().float().cpu()
        out[name] = ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()
    return out


def close_on_a_nearly_full_device(left_free_bytes: int, process_group=None):
    """close() of a 256 MiB fp32 model (16 frozen 2048x2048 Linear layers: no gradient or optimizer
    chunks whose dropping would make room) while another tensor fills the GPU, leaving
    `left_free_bytes` free. Returns (engine, model, the values before enable, on the CPU)."""
    torch.manual_seed(0)  # the same values on every rank (sharded, the chunks take rank 0's)
    model = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(16)]).cuda()
    model.requires_grad_(False)
    expected = {n: p.detach().clone().cpu() for n, p in model.named_parameters()}
    engine = gx.enable(model, gx.GeminiConfig(device="cuda", precision="fp32", min_chunk_size_m=4, search_range_m=8),
                       process_group=process_group)
    torch.cuda.empty_cache()
    filler = torch.empty(torch.cuda.mem_get_info()[0] - left_free_bytes, dtype=torch.uint8, device="cuda")
    try:
        engine.close()
    finally:
        del filler
        torch.cuda.empty_cache()  # the filler's block would stay in torch's cache, away from later tests
    return engine, model, expected
