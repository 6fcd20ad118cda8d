"""gx.estimate: the engine's plan for a model (engine_plan.py), its memory and its predicted step time
(step_time.py) on a target machine (target.py), before any device memory is touched."""

from __future__ import annotations

import torch

from .._engine.activations import budget
from .._engine.activations.offload import LOOKAHEAD
from .._engine.layout import COMPUTE_DTYPES, check_parameters, choose_chunk_size
from .._units import parse_bytes
from ..config import GeminiConfig
from ..placement.host_memory import host_budget
from ..search import unique_parameters
from . import engine_plan, shape as shapes, step_time, target


def estimate(model: torch.nn.Module, config: GeminiConfig | None = None, *, tokens_per_step: int,
             world_size: int = 1, checkpointing: bool = True, loss_chunk_tokens: int | None = None,
             activation_bytes_per_token_override: int | None = None, device_bytes=None, host_bytes=None,
             peak_tflops: float | None = None, device_name: str | None = None,
             cpu_optimizer_elements_per_s: float | None = None, seq_len: int | None = None,
             gpu_flops_per_s: float | None = None, recorded: dict | None = None) -> dict:
    """The plan, device and host bytes and the predicted step time of training `model` under `config`
    with `tokens_per_step` tokens per optimizer step over `world_size` ranks (one host). Nothing is
    allocated on the device; the model may be on meta. device_bytes, host_bytes, peak_tflops,
    device_name and cpu_optimizer_elements_per_s (the CPU Adam kernel's rate there, e.g. from
    bench/cpu_adam.py) describe another machine. checkpointing: whether the model checkpoints its
    blocks itself (the engine's activation_checkpointing counts too). loss_chunk_tokens: the loss's
    logits this many tokens at a time (None reads `model.cfg.loss_chunk_tokens` where there is one,
    0 is the whole batch). seq_len: tokens per sequence (None: 1024). gpu_flops_per_s: the GPU's
    achieved rate on this model. recorded: figures an engine measured in a run of this model and
    config (engine_plan.RECORDED_FIGURES), which replace their predictions."""
    config = config or GeminiConfig(placement_policy="auto")
    _check_arguments(config, tokens_per_step, world_size, gpu_flops_per_s, seq_len, recorded)
    loss_chunk = shapes.loss_chunk_tokens_of(model, loss_chunk_tokens)
    capacity, total, peak, name = target.device_figures(config.gpu_memory_limit, device_bytes, peak_tflops,
                                                        device_name)
    compute_dtype = COMPUTE_DTYPES[config.precision]
    named = unique_parameters(model)
    check_parameters(model, named, config, compute_dtype)
    chunk_size = choose_chunk_size(model, named, config, world_size)
    if (unsupported := config.unsupported_without_masters()) is not None:
        raise NotImplementedError(unsupported)
    layout = engine_plan.build_layout(named, config, compute_dtype, chunk_size, world_size)
    available, source = _host_available(host_bytes, world_size)
    machine = engine_plan.Machine(capacity, total, world_size, available, source)
    releasable = sum(p.numel() * p.element_size() for _, p in named if p.device.type == "cpu")

    n_total = sum(p.numel() for _, p in named)
    n_trainable = sum(p.numel() for _, p in named if p.requires_grad)
    shape = shapes.model_shape(model)
    rank_tokens = tokens_per_step // world_size
    checkpointing = checkpointing or config.activation_checkpointing != "off"
    gpu_rate = gpu_flops_per_s or peak * 1e12 * target.gpu_efficiency(rank_tokens)
    attention = step_time.attention_forward_flops(shape, rank_tokens, seq_len)
    gpu_s, forward_s = step_time.gpu_seconds(rank_tokens, n_total, n_trainable, float(checkpointing), gpu_rate,
                                             len(named), attention)
    acts, fixed_peak = _activations(config, shape, checkpointing, rank_tokens, loss_chunk,
                                    activation_bytes_per_token_override, forward_s, recorded or {})
    cpu_rate, cpu_source = target.cpu_rate(cpu_optimizer_elements_per_s)
    passes = dict(forward_seconds=forward_s, backward_seconds=gpu_s - forward_s,
                  cpu_optimizer_elements_per_s=cpu_rate)
    decided = engine_plan.plan(config, layout, machine, releasable, acts, passes, fixed_peak)
    steady = _steady_activations(acts, decided, fixed_peak, forward_s)
    gpu_s -= steady["recompute_saved_s"]
    m, chosen = decided["measured"], decided["chosen"]
    parts = step_time.step_parts(config, m, chosen, gpu_s, forward_s, cpu_rate, steady["exposed_copy_s"])
    memory = step_time.memory(m, chosen, decided["host_chunk_bytes"], steady["bytes"], steady["host_bytes"])
    if decided["warm_up"] and decided["warm_up"]["refused"]:
        memory["fits"]["device"] = False  # the first forward would refuse (activations/budget.py)
    step = sum(parts.values())
    facts = dict(tokens_per_step=tokens_per_step, world_size=world_size, rank_tokens=rank_tokens,
                 activation_bytes_per_token=steady["bytes"] // max(rank_tokens, 1), peak_tflops=peak,
                 device_name=name, n_total=n_total, n_trainable=n_trainable, chunk_size=chunk_size,
                 gpu_flops_per_s=gpu_rate)
    return _summary(config, decided, parts, step, memory, steady, facts, cpu_rate, cpu_source)


def _check_arguments(config: GeminiConfig, tokens_per_step, world_size: int, gpu_flops_per_s, seq_len,
                     recorded) -> None:
    if config.precision not in COMPUTE_DTYPES or config.precision == "fp32":
        raise ValueError(f"gx.estimate: precision={config.precision!r}: the step-time model is for bf16/fp16 compute.")
    if not isinstance(tokens_per_step, int) or tokens_per_step <= 0:
        raise ValueError(f"gx.estimate: tokens_per_step must be a positive int, got {tokens_per_step!r}.")
    if world_size < 1:
        raise ValueError(f"gx.estimate: world_size must be >= 1, got {world_size}.")
    if gpu_flops_per_s is not None and not gpu_flops_per_s > 0:
        raise ValueError(f"gx.estimate: gpu_flops_per_s must be > 0 (FLOP/s), got {gpu_flops_per_s!r}.")
    if seq_len is not None and (not isinstance(seq_len, int) or seq_len <= 0):
        raise ValueError(f"gx.estimate: seq_len must be a positive int (tokens per sequence), got {seq_len!r}.")
    unknown = sorted(set(recorded or {}) - set(engine_plan.RECORDED_FIGURES))
    if unknown:
        raise ValueError(f"gx.estimate: recorded= has unknown figures {unknown}; it takes "
                         f"{list(engine_plan.RECORDED_FIGURES)} (as engine.stats() reports them).")


def _host_available(host_bytes, world_size: int) -> tuple:
    """(the host bytes each rank may use, where the figure comes from): given, or this host's."""
    if host_bytes is not None:
        return parse_bytes(host_bytes, "gx.estimate(host_bytes=...)") // world_size, "given"
    found = host_budget(world_size)
    return (found.bytes, found.source) if found is not None else (None, None)


def _fixed_choice(config, checkpointing: bool) -> str | None:
    """Every block's choice where the config fixes it; None where the engine plans it."""
    if "auto" in (config.activation_checkpointing, config.activation_offload):
        return None
    if not checkpointing:
        return "keep"
    return "offload" if config.activation_offload == "on" else "recompute"


def _activations(config, shape, checkpointing: bool, tokens: int, loss_chunk: int, per_token, forward_s: float,
                 recorded: dict):
    """(the first iteration's activations as engine_plan takes them, or None with the non-model peak
    given per token)."""
    if per_token is not None:
        return None, tokens * int(per_token)
    if shape is None:
        raise ValueError("gx.estimate: the model has no embedding and ModuleList of blocks to read its shape from; "
                         "pass activation_bytes_per_token_override= (bytes of activations per token).")
    fixed = _fixed_choice(config, checkpointing)
    outside = int(shapes.logits_bytes(shape, tokens, loss_chunk)) if fixed == "keep" else \
        shapes.outside_blocks_bytes(shape, tokens, loss_chunk)
    allowed = None if fixed is not None else budget.Allowed.of(config.activation_checkpointing,
                                                                config.activation_offload)
    return engine_plan.Activations(shapes.probed_blocks(shape, tokens, forward_s), outside, fixed, allowed,
                                   recorded), 0


def _steady_activations(acts, decided: dict, fixed_peak: int, forward_s: float) -> dict:
    """The activations of the iterations after the first: bytes on the device, offloaded bytes on
    the host, the copies' exposed time and the recompute saved by blocks kept."""
    if acts is None:
        return {"bytes": fixed_peak, "host_bytes": 0, "freed_bytes": 0, "exposed_copy_s": 0.0,
                "recompute_saved_s": 0.0, "counts": None}
    forward_block, inputs = forward_s / len(acts.blocks), acts.blocks[0][1]
    plan = decided["activation_plan"]
    if plan is None:  # fixed by the config: the core's figures for those choices
        allowed = budget.Allowed(keep=acts.fixed_choice == "keep", recompute=acts.fixed_choice == "recompute",
                                 warm_choice=acts.fixed_choice)
        link = target.H2D_BYTES_PER_S if acts.fixed_choice == "offload" else 0.0
        plan = budget.plan(acts.blocks, 1 << 62, link, allowed, -1)
    counts = {c: plan["choices"].count(c) for c in ("keep", "recompute", "offload")}
    recomputed = counts["recompute"] + counts["offload"]
    return {"bytes": acts.outside_blocks_bytes + plan["device_bytes"], "host_bytes": counts["offload"] * inputs,
            "freed_bytes": max(0, counts["offload"] - LOOKAHEAD) * inputs,
            "exposed_copy_s": max(0.0, plan["added_seconds"] - recomputed * forward_block),
            "recompute_saved_s": counts["keep"] * forward_block if decided["activation_plan"] else 0.0,
            "counts": counts}


def _summary(config, decided: dict, parts: dict, step: float, memory: dict, steady: dict, facts: dict,
             cpu_rate: float, cpu_source: str) -> dict:
    m, chosen, initial = decided["measured"], decided["chosen"], decided["initial"]
    elements, on_host = engine_plan.device_state_elements(m, chosen)
    host_elements = sum(n for n, h in zip(elements, on_host) if h)
    budget_bytes = chosen.device_budget_bytes or m.device_capacity_bytes
    displaced = engine_plan.displaced_param_bytes(m, chosen)
    pcie = 2 * host_elements * m.compute_itemsize + 2 * displaced  # host sets' parameters up, gradients down
    model_flops = 6 * facts["n_trainable"] + 2 * (facts["n_total"] - facts["n_trainable"])
    plan = decided["activation_plan"]
    return {
        "plan": {"policy": config.placement_policy, "chunk_size": facts["chunk_size"], "chunk_sets": len(elements),
                 "optim_sets_on_device": sum(1 for h, t in zip(on_host, m.trainable) if t and not h),
                 "optim_sets_on_host": sum(on_host), "link_lane_sets": len(chosen.link_sets),
                 "host_stepped_parameters": host_elements, "params_born_on_device": initial.params_born_on_device,
                 "chunk_budget_bytes": budget_bytes, "evicted_param_bytes": displaced},
        **memory,
        "activation_bytes": steady["bytes"],
        "step_time_s": step,
        "step_parts_s": parts,
        "lanes": step_time.lanes(m, chosen, parts, cpu_rate),  # as engine.stats()["lanes"] measures them
        "activation_offload": {"host_bytes": steady["host_bytes"], "device_bytes_freed": steady["freed_bytes"]},
        # activation_checkpointing or activation_offload "auto": blocks kept, recomputed, offloaded
        "activation_plan": None if plan is None else {
            **steady["counts"], "device_free_bytes": plan["device_free_bytes"],
            "planned_device_bytes": plan["device_bytes"],
            "fits": plan["fits"], "host_free_bytes": plan["host_free_bytes"]},
        "warm_up": decided["warm_up"],
        "first_iteration": decided["first_figures"],
        "pcie_bytes_per_step": pcie, "pcie_bound_s": pcie / 2 / target.H2D_BYTES_PER_S,
        "tokens_per_s": facts["tokens_per_step"] / step,
        "mfu": facts["rank_tokens"] / step * model_flops / (facts["peak_tflops"] * 1e12),
        "rates": {"gpu_flops_per_s": facts["gpu_flops_per_s"], "cpu_optimizer_elements_per_s": cpu_rate,
                  "cpu_optimizer_source": cpu_source, "link_optimizer_elements_per_s": target.LINK_ELEMENTS_PER_S,
                  "h2d_bytes_per_s": target.H2D_BYTES_PER_S},
        "inputs": {k: facts[k] for k in ("tokens_per_step", "world_size", "activation_bytes_per_token", "peak_tflops",
                                         "device_name")},
    }
