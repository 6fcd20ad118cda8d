"""transformers' causal LMs built from configs (no weights downloaded), trained by one system in
one process under torchrun: gemini_ext, FSDP2 + CPU offload, DeepSpeed ZeRO-3 offload or plain
PyTorch. bench/hf_models.py runs them side by side; this file is one row.

    torchrun --nproc-per-node 1 bench/hf_train.py --model llama-7b --system gemini --budget 24GiB
    torchrun --nproc-per-node 1 bench/hf_train.py --model llama-7b --system fsdp2-offload --budget 24GiB
    torchrun --nproc-per-node 1 bench/hf_train.py --model tiny-mixtral --system gemini --device sim

Every system: the model from its transformers config with SDPA attention and HF's own gradient
checkpointing (`gradient_checkpointing_enable(use_reentrant=False)`), bf16 compute, AdamW (lr 1e-4,
betas (0.9, 0.999), eps 1e-8, weight decay 0.1) with fp32 master weights and moments, clipping at
--max-norm for every system alike (0: off; DeepSpeed's `gradient_clipping` is set to it), random
token sequences with labels equal to the inputs. The budget caps torch's allocator for the peers
(set_per_process_memory_fraction, set once the model is sharded or offloaded) and is gemini_ext's
gpu_memory_limit. Every system builds the model on the GPU where its fp32 weights take less than
60% of the device, else (the GPU alone and gemini_ext's 8-byte state, which keep bf16 parameters only)
on the GPU in bf16 where that takes less, else on the CPU: where it is built does not change the step.

Systems:
  gemini                   gemini_ext (--policy, --step-in-backward, --activation-offload, --checkpointing;
                           --no-speculation to diagnose)
  fsdp2-offload            FSDP2 per decoder layer and at the root, CPUOffloadPolicy(pin_memory=True),
                           fp32 parameters with bf16 compute, fused CPU AdamW
  deepspeed-offload-optim  DeepSpeed ZeRO-3, the optimizer offloaded (DeepSpeedCPUAdam), bf16
  deepspeed-offload        DeepSpeed ZeRO-3, parameters and optimizer offloaded (both DeepSpeed systems:
                           --activation-offload on checkpoints the layers with DeepSpeed's own checkpoint,
                           its inputs in CPU memory: cpu_checkpointing)
  plain                    the model on the GPU, bf16 autocast, fused AdamW on the GPU (fsdp2-offload and
                           plain: --activation-offload on wraps the forward in torch's save_on_cpu)
  gpu-alone                forward and backward only: bf16 parameters on the GPU, no optimizer, the whole
                           device (--budget ignored)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import sys
import time

import torch
import torch.distributed as dist
import torch.utils.checkpoint

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fsdp2_train import cap_device_memory, clipped_step, exit_without_teardown  # noqa: E402
from peers_train import BETAS, EPS, WEIGHT_DECAY, deepspeed_config  # noqa: E402

SYSTEMS = ("gemini", "fsdp2-offload", "deepspeed-offload-optim", "deepspeed-offload", "plain", "gpu-alone")
LR = 1e-4  # AdamW's other settings are peers_train.py's, for every system
GRAD_NORMS: list = []  # per step, where the system reports it (gemini_ext; the peers when clipping)

# (transformers config class, its fields): the published shapes, vocabularies included
MODELS = {
    "llama-7b": ("LlamaConfig", dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                                     num_attention_heads=32, num_key_value_heads=32, vocab_size=32000)),
    "llama-13b": ("LlamaConfig", dict(hidden_size=5120, intermediate_size=13824, num_hidden_layers=40,
                                      num_attention_heads=40, num_key_value_heads=40, vocab_size=32000)),
    "mistral-7b": ("MistralConfig", dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                         num_attention_heads=32, num_key_value_heads=8, vocab_size=32000)),
    "qwen2-7b": ("Qwen2Config", dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                                     num_attention_heads=28, num_key_value_heads=4, vocab_size=152064)),
    "qwen3-8b": ("Qwen3Config", dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936)),
    # a Mixtral-style MoE of 1.6B parameters: 8 experts per layer, 2 per token
    "mixtral-1.6b": ("MixtralConfig", dict(hidden_size=1024, intermediate_size=3584, num_hidden_layers=16,
                                           num_attention_heads=16, num_key_value_heads=8, num_local_experts=8,
                                           num_experts_per_tok=2, vocab_size=32000)),
    "tiny-llama": ("LlamaConfig", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=4, vocab_size=256)),
    "tiny-mixtral": ("MixtralConfig", dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                           num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                           num_experts_per_tok=2, vocab_size=256)),
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=sorted(MODELS), default="llama-7b")
    p.add_argument("--system", choices=SYSTEMS, default="gemini")
    p.add_argument("--device", choices=["cuda", "sim"], default="cuda", help="sim: gemini_ext only, on the CPU")
    p.add_argument("--budget", default=None, help="device bytes, e.g. 24GiB (default: the whole device)")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--max-norm", type=float, default=0.0, help="gradient-norm clipping for every system (0: off)")
    p.add_argument("--policy", default="auto", help="gemini: GeminiConfig.placement_policy")
    p.add_argument("--step-in-backward", action="store_true", help="gemini: optimizer_step_in_backward=True")
    p.add_argument("--no-speculation", action="store_true",
                   help="gemini, for diagnosis: host_step_speculation='off' (every host step from step())")
    p.add_argument("--cpu-lane-only", action="store_true",
                   help="gemini, for diagnosis: auto never weighs the link lane (every host set on the CPU), to "
                        "compare its lanes' split with the CPU alone")
    p.add_argument("--speculation", choices=["in-place", "spares"], default="in-place",
                   help="gemini: AdamW's host steps during backward in place (the default), or with spare copies "
                        "as rules without a correction do (the previous default, for comparison)")
    p.add_argument("--loss-scale", type=float, default=1.0,
                   help="every system: backward from the loss times this. Adam's step does not depend on the "
                        "gradient's scale (but for eps), so this is the same training with the gradient norm "
                        "scaled: with 1/64 the random data's norm stays within --max-norm 1.0, unscaled every step "
                        "clips")
    p.add_argument("--activation-offload", choices=["off", "on", "auto"], default="off",
                   help="gemini: GeminiConfig.activation_offload; fsdp2-offload and plain: 'on' is torch's "
                        "save_on_cpu; deepspeed: 'on' is DeepSpeed's checkpointing with cpu_checkpointing")
    p.add_argument("--checkpointing", choices=["hf", "engine-on", "engine-auto"], default="hf",
                   help="gemini: HF's gradient checkpointing, or the engine's (activation_checkpointing 'on' / 'auto')")
    p.add_argument("--loss-chunk-tokens", type=int, default=0,
                   help="every system: the LM head and loss over this many tokens at a time, each piece "
                        "checkpointed (0: HF's own loss over the whole batch)")
    p.add_argument("--state", choices=["fp32", "8-byte"], default="fp32",
                   help="gemini: fp32 masters and AdamW moments, or the 8-byte state (bf16 parameters and "
                        "moments: optimizer_state_dtype='bf16', master_weights=False); the peers: fp32 only")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json-out", default=None)
    p.add_argument("--timeline", default=None, metavar="DIR",
                   help="one more step under torch.profiler, untimed: DIR/trace.json and DIR/timeline.png "
                        "(bench/timeline.py)")
    return p.parse_args(argv)


def build_model(name: str, seq: int, device: str, hf_checkpointing: bool = True, dtype: torch.dtype = torch.float32):
    """The transformers model of `name` on `device`, in `dtype`, with HF's gradient checkpointing
    unless told otherwise."""
    import transformers

    cls_name, fields = MODELS[name]
    cfg = getattr(transformers, cls_name)(**fields, max_position_embeddings=max(seq, 128), use_cache=False)
    cfg._attn_implementation = "sdpa"
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    if hf_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    return model


def chunk_the_loss(model, chunk_tokens: int) -> None:
    """The LM head and the loss over `chunk_tokens` tokens at a time, each piece checkpointed, so
    the whole logits (tokens x vocabulary, in bf16 and fp32, and their gradients: 20 GB at 65,536
    tokens of a 32,000 vocabulary) never exist at once. The head moves to `loss_head`, a child of
    the model as before (every system shards, offloads and fetches it alike), `lm_head` becomes the
    identity and HF's loss function gets the hidden states."""
    model.loss_head = model.lm_head
    model.lm_head = torch.nn.Identity()

    def piece(hidden, targets):
        return torch.nn.functional.cross_entropy(model.loss_head(hidden).float(), targets, reduction="sum")

    def loss(logits, labels, vocab_size=None, **kwargs):
        hidden = logits[..., :-1, :].reshape(-1, logits.shape[-1])
        targets = labels[..., 1:].reshape(-1).to(hidden.device)
        total = sum(torch.utils.checkpoint.checkpoint(piece, hidden[i:i + chunk_tokens], targets[i:i + chunk_tokens],
                                                      use_reentrant=False)
                    for i in range(0, hidden.shape[0], chunk_tokens))
        return total / (targets != -100).sum()

    model.loss_function = loss


def build_place(fp32_model_bytes: int, device_bytes: int, bf16_parameters_only: bool) -> tuple[str, torch.dtype]:
    """Where and in which dtype a system builds the model: on the GPU in fp32 where that takes less
    than 60% of the device; where the system keeps bf16 parameters only (the GPU alone, gemini_ext
    with the 8-byte state) on the GPU in bf16 where that does; else on the CPU in fp32. The CPU's
    initialisation is slow (LLaMA-13B's took longer than a row's two minutes on the H100's host)."""
    if fp32_model_bytes < 0.6 * device_bytes:
        return "cuda", torch.float32
    if bf16_parameters_only and fp32_model_bytes // 2 < 0.6 * device_bytes:
        return "cuda", torch.bfloat16
    return "cpu", torch.float32


def fp32_bytes(name: str) -> int:
    """The model's fp32 weights, counted on the meta device."""
    return 4 * sum(p.numel() for p in build_model(name, 128, "meta").parameters())


def active_parameters(name: str) -> int:
    """Parameters one token computes with: every parameter, less the experts a token is not routed
    to (an MoE's expert weights count num_experts_per_tok / num_experts of theirs), on meta."""
    model = build_model(name, 128, "meta")
    cfg = model.config
    experts = getattr(cfg, "num_local_experts", None) or getattr(cfg, "num_experts", None)
    per_token = getattr(cfg, "num_experts_per_tok", None)
    total = sum(p.numel() for p in model.parameters())
    if not (experts and per_token):
        return total
    expert_params = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    return total - expert_params + expert_params * per_token // experts


def batch_of(model, args, step: int, dev: torch.device) -> torch.Tensor:
    g = torch.Generator().manual_seed(args.seed * 100003 + step)
    return torch.randint(0, model.config.vocab_size, (args.batch, args.seq), generator=g).to(dev)


def gemini_system(args, dev_kind: str):
    """(model, compute device, train_step, final stats): gemini_ext over the model built where it fits."""
    import gemini_ext as gx

    place, dtype = build_place(fp32_bytes(args.model), torch.cuda.get_device_properties(0).total_memory,
                               args.state == "8-byte") if dev_kind == "cuda" else ("cpu", torch.float32)
    model = build_model(args.model, args.seq, place, hf_checkpointing=args.checkpointing == "hf", dtype=dtype)
    if args.loss_chunk_tokens:
        chunk_the_loss(model, args.loss_chunk_tokens)
    budget = {"gpu_memory_limit": args.budget} if args.budget and dev_kind == "cuda" else {}
    if dev_kind == "sim":
        budget = {"sim_capacity": args.budget or "2GiB"}
    speculation = "off" if args.no_speculation else {"in-place": "in_place", "spares": "spares"}[args.speculation]
    state = {"optimizer_state_dtype": "bf16", "master_weights": False} if args.state == "8-byte" else {}
    cfg = gx.GeminiConfig(device=dev_kind, precision="bf16", placement_policy=args.policy, max_norm=args.max_norm,
                          optimizer_step_in_backward=args.step_in_backward, activation_offload=args.activation_offload,
                          host_step_speculation=speculation,
                          activation_checkpointing={"hf": "off", "engine-on": "on",
                                                    "engine-auto": "auto"}[args.checkpointing], **budget, **state)
    if args.cpu_lane_only:  # a diagnosis, not a setting: the decision that would weigh the lane answers "none"
        from gemini_ext.placement.policies import auto
        auto.link_lane_sets = lambda measured, on_host: ((), {})
    engine = gx.enable(model, cfg).__enter__()
    opt = engine.optimizer(torch.optim.AdamW, model.parameters(), lr=LR, betas=BETAS, eps=EPS,
                           weight_decay=WEIGHT_DECAY)

    def train_step(x):
        with torch.profiler.record_function("bench.forward"):
            loss = model(input_ids=x, labels=x).loss
        with torch.profiler.record_function("bench.backward"):
            (loss * args.loss_scale).backward()
        before = time.perf_counter()
        with torch.profiler.record_function("bench.step"):
            opt.step()
        if opt.last_grad_norm is not None:
            GRAD_NORMS.append(opt.last_grad_norm)
        opt.zero_grad(set_to_none=True)
        return loss, before

    def stats():
        s = engine.stats()
        engine.close()
        return {k: s.get(k) for k in ("placement", "last_step", "counters", "traffic", "throughput", "lanes",
                                      "num_param_chunks", "chunk_size", "tier_bytes", "activations", "speculation")}

    return model, engine.compute_device, train_step, stats


def peer_system(args):
    """(model, device, train_step, stats) for FSDP2, DeepSpeed or plain PyTorch."""
    dev = torch.device("cuda", torch.cuda.current_device())
    total = torch.cuda.get_device_properties(dev).total_memory
    place, dtype = build_place(fp32_bytes(args.model), total, args.system == "gpu-alone")
    model = build_model(args.model, args.seq, place, dtype=dtype)
    if args.loss_chunk_tokens:
        chunk_the_loss(model, args.loss_chunk_tokens)

    def cap():  # once the model is sharded or offloaded: the build's fp32 copy does not count
        torch.cuda.empty_cache()
        if args.budget:
            cap_device_memory(dev, args.budget)
    if args.system.startswith("deepspeed"):
        import deepspeed

        config = deepspeed_config(args.system, args.batch, LR, args.max_norm)
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
        if args.activation_offload == "on":  # the layers' checkpoints through DeepSpeed, inputs to the CPU (its
            # cpu_checkpointing; without partition_activations, 0.19.8 recomputed HF's layers from
            # inputs of the wrong shape in a trial on the CPU accelerator)
            deepspeed.checkpointing.configure(None, partition_activations=True, checkpoint_in_cpu=True)
            model._set_gradient_checkpointing(enable=True,
                                              gradient_checkpointing_func=deepspeed.checkpointing.checkpoint)
        cap()

        def train_step(x):
            loss = engine(input_ids=x, labels=x).loss
            engine.backward(loss * args.loss_scale)
            torch.cuda.synchronize()
            before = time.perf_counter()
            engine.step()
            return loss, before

        return model, dev, train_step, dict
    if args.system == "gpu-alone":
        return _gpu_alone(model, dev, args.loss_scale)
    if args.system == "plain":
        cap()
        model.to(dev)
        autocast = torch.autocast("cuda", dtype=torch.bfloat16)
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh("cuda", (dist.get_world_size(),))
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh, mp_policy=mp, offload_policy=CPUOffloadPolicy(pin_memory=True))
        fully_shard(model, mesh=mesh, mp_policy=mp, offload_policy=CPUOffloadPolicy(pin_memory=True))
        cap()
        autocast = torch.autocast("cuda", enabled=False)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY, fused=True)

    saved = torch.autograd.graph.save_on_cpu(pin_memory=True) if args.activation_offload == "on" else \
        contextlib.nullcontext()

    def train_step(x):
        with autocast, saved:
            loss = model(input_ids=x, labels=x).loss
        (loss * args.loss_scale).backward()
        torch.cuda.synchronize()
        return loss, clipped_step(model, opt, args.max_norm, GRAD_NORMS)

    return model, dev, train_step, dict


def _gpu_alone(model, dev, loss_scale: float):
    """The GPU's own time for the same forward and backward: bf16 parameters resident, the same
    checkpointing, no optimizer (the bound offloaded training is measured against). The whole
    device, whatever --budget says: the parameters and their gradients alone may exceed it."""
    model.to(dev, torch.bfloat16)
    torch.cuda.empty_cache()

    def train_step(x):
        loss = model(input_ids=x, labels=x).loss
        (loss * loss_scale).backward()
        torch.cuda.synchronize()
        before = time.perf_counter()
        model.zero_grad(set_to_none=True)
        return loss, before

    return model, dev, train_step, dict


def profiled_step(model, args, train_step, dev) -> dict:
    """One more step under torch.profiler (untimed), its trace and its picture in args.timeline."""
    from torch.profiler import ProfilerActivity, profile

    import timeline
    os.makedirs(args.timeline, exist_ok=True)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    x = batch_of(model, args, args.steps, dev)
    with profile(activities=activities) as prof:
        train_step(x)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
    trace = os.path.join(args.timeline, "trace.json")
    prof.export_chrome_trace(trace)
    with open(trace) as f:
        busy = timeline.draw(json.load(f), os.path.join(args.timeline, "timeline.png"),
                             f"{args.model}, {args.batch} x {args.seq}, {args.budget or 'whole device'}: one step")
    return {"trace": trace, "png": os.path.join(args.timeline, "timeline.png"), "busy_seconds": busy}


def main(argv=None) -> dict:
    args = parse_args(argv)
    if "WORLD_SIZE" not in os.environ:
        raise SystemExit("hf_train.py: launch it with torchrun (--nproc-per-node 1 for one GPU).")
    if args.state != "fp32" and args.system not in ("gemini", "gpu-alone"):
        raise SystemExit(f"hf_train.py --state {args.state}: gemini_ext's option; {args.system} trains fp32 state.")
    if args.device == "sim" and args.system != "gemini":
        raise SystemExit(f"hf_train.py --device sim: only --system gemini runs there, not {args.system}.")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("hf_train.py --device cuda: this machine has no CUDA device; use --device sim.")
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("cuda:nccl,cpu:gloo" if args.device == "cuda" else "gloo")
    torch.manual_seed(args.seed)
    started = time.perf_counter()
    if args.system == "gemini":
        model, dev, train_step, final_stats = gemini_system(args, args.device)
    else:
        model, dev, train_step, final_stats = peer_system(args)
    setup_s = time.perf_counter() - started
    n_params = sum(p.numel() for p in model.parameters()) if args.system == "gemini" else \
        sum(getattr(p, "ds_numel", 0) or p.numel() for p in model.parameters())
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    losses, step_s, optimizer_s, reserved = [], [], [], []
    for step in range(args.steps):
        x = batch_of(model, args, step, dev)
        start = time.perf_counter()
        loss, before_opt = train_step(x)
        losses.append(loss.item())
        step_s.append(time.perf_counter() - start)
        optimizer_s.append(time.perf_counter() - before_opt)
        if dev.type == "cuda":  # what torch's allocator holds after each step: does the first step's hold persist?
            reserved.append(torch.cuda.memory_reserved(dev))
        print(f"step {step}: loss {losses[-1]:.4f}, {step_s[-1]:.3f} s", flush=True)
    timed = step_s[2:] if len(step_s) > 3 else step_s[1:] or step_s
    summary = {
        "system": args.system + (" + step in backward" if args.step_in_backward else "") +
        (", no speculation" if args.no_speculation else "") + (", CPU lane only" if args.cpu_lane_only else "") +
        (", spare-copy speculation" if args.speculation == "spares" else "") +
        (f", loss scaled by {args.loss_scale:g}" if args.loss_scale != 1.0 else "") +
        (f", checkpointing {args.checkpointing}" if args.checkpointing != "hf" else "") +
        (f", activation offload {args.activation_offload}" if args.activation_offload != "off" else "") +
        (f", {args.state} state" if args.state != "fp32" else ""),
        "model": args.model,
        "parameters": n_params, "active_parameters": active_parameters(args.model), "budget": args.budget,
        "batch": args.batch, "seq_len": args.seq,
        "tokens_per_step": args.batch * args.seq, "max_norm": args.max_norm, "steps": args.steps,
        "losses": losses, "step_seconds": step_s, "grad_norms": list(GRAD_NORMS), "loss_scale": args.loss_scale,
        "step_s_median": sorted(timed)[len(timed) // 2],
        "exposed_optimizer_s_median": sorted(optimizer_s[2:] or optimizer_s)[len(optimizer_s[2:] or optimizer_s) // 2],
        "setup_s": setup_s,
        "peak_torch_device_bytes": torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else None,
        # what torch's allocator held at its most (its cached segments, fragmentation included)
        "peak_torch_reserved_bytes": torch.cuda.max_memory_reserved(dev) if dev.type == "cuda" else None,
        "torch_reserved_bytes_after_each_step": reserved,
        "peak_host_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }
    if args.timeline:
        summary.update(timeline=profiled_step(model, args, train_step, dev))
    summary.update(engine=final_stats())
    print(f"== {summary['system']}: {args.model} ({n_params / 1e9:.2f}B) {args.batch} x {args.seq}, budget "
          f"{args.budget or 'whole device'}: loss {losses[0]:.4f} -> {losses[-1]:.4f}, median step "
          f"{summary['step_s_median']:.3f} s", flush=True)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(summary, f, indent=2, default=str)
    return summary


if __name__ == "__main__":
    main()
    exit_without_teardown()
