"""gx.estimate: the plan, the memory and a predicted step time of training a model under the
engine, before any device memory is touched (the model may be built on meta).

What it does: the chunk layout enable() would build (on a simulated device, nothing allocated),
the placement policy's plan before the first iteration, then the policy's decision after it from
predicted figures in place of measured ones (the activations' memory and the passes' times), and
the step time from the rates below. The placement is the policy's own code: what it plans is
what enable() would plan, given the predicted activations.

[Note: the step-time model]
A step is the GPU's work plus what the GPU waits for:
  step = gpu + device_optimizer + gradients_tail + optimizer_wait + fetch_stall
- gpu: the model's FLOPs per step (2 N forward, 2 N of recomputation under activation
  checkpointing, 2 N + 2 N_trainable backward) at the GPU's dense 16-bit peak times an efficiency
  that grows with the tokens per step (GPU_EFFICIENCY: those FLOPs over the measured forward and
  backward time of GPT blocks of d 4096-5120 at 1024-token sequences on the H200, so attention's
  work is inside it: 0.58 of peak at 1024 tokens, 0.67 from 16k). At few tokens per step the
  host's dispatch of each pass (torch's operators and the engine's hooks) takes longer than the
  GPU's work and bounds it: HOST_DISPATCH_S_PER_TENSOR_PASS per parameter tensor and pass
  (forward, the recomputed forward, backward), from the wall time of the forward and backward of
  the 6.7B GPT at 1024 tokens on the H200's host (0.168 s over 389 tensors and three passes).
  `gpu_flops_per_s=` replaces peak x efficiency with a rate measured for the model at hand (its
  forward and backward alone on the GPU: another implementation of the same blocks, transformers'
  eager Llama say, runs at another fraction of the peak).
  Longer sequences add attention-score work that grows with their length and that the efficiency,
  taken at 1024-token sequences, does not hold: per token, layer and causal forward 2 d s FLOPs
  (QK^T and AV over s/2 keys on average), of which what lies beyond s = ATTENTION_BASE_SEQ is
  added, in the forward, the recomputed forward and the backward (ATTENTION_BACKWARD_PER_FORWARD
  times the forward: a fused attention kernel's backward recomputes the scores). `seq_len=` gives
  s; without it the sequences are taken as ATTENTION_BASE_SEQ long.
- device_optimizer: the fused Adam kernel over the device-held state, on the compute stream
  between backward and the next forward: 28 bytes per element (20 with bf16 moments, 14 with
  the 8-byte state) at
  DEVICE_OPTIMIZER_BYTES_PER_S.
- optimizer_wait: with GeminiConfig.optimizer_step_in_backward the host sets are stepped by the CPU
  from the backward pass on, each once its gradients are complete (the back of the execution
  order first), and what runs past the backward's end overlaps the next forward, which waits
  wherever it reaches a set before its step ended. Otherwise the host-held
  optimizer state is stepped from step() on, by the CPU and where
  the policy gives it sets by the link lane, and the next forward, which reaches those sets last
  (the back of the execution order), waits wherever it arrives before a set's step ended:
  list-scheduled as placement/optimizer_lanes.py does, with the forward's share of `gpu` as the
  window. The CPU rate is measured here (the kernel over PROBE_ELEMENTS, host memory only), the
  link lane's is LINK_ELEMENTS_PER_S; with both lanes each runs at the share of its rate the
  H200's host gave them together (placement/optimizer_lanes.py, which splits with the same shares).
- gradients_tail: step() starts the host steps once every gradient is on the host; the host
  sets' gradients leave during backward, and what their copy (at the link's rate) takes beyond
  the backward pass comes first (a few tokens per step of a model with most state on the host).
- fetch_stall: parameter chunks the device budget cannot hold beside the device-held state are
  evicted and fetched again; the fetch of those bytes at the link's rate is counted once.
PCIe traffic (host sets' parameters up, their gradients down) overlaps compute on this machine;
it is reported as a bound, not added. Activation memory, per token: under checkpointing each
block's input (L d bf16) and the larger of the loss's logits (LOGIT_BYTES_PER_VOCAB x V: bf16
logits, their fp32 copy, its fp32 and bf16 gradients; measured 897 and 665 kB per token at 15.4B
and 6.7B, where the formula gives 895 and 665; only one piece of tokens where the loss is computed
in checkpointed pieces, GPTConfig.loss_chunk_tokens) and one block's recomputed activations, which
its backward holds after the loss (with the loss in pieces of a long step, the larger); without
checkpointing, 34 d bytes per layer (flash
attention, no s^2 term), or for a gated MLP of inner width i (Llama's SwiGLU) 30 d + 8 i bytes:
in bf16 the attention's inputs and outputs, q and k before and after the rotary embedding, two
RMSNorms' fp32 inputs, and the gate, up, activation and product of the MLP (transformers'
LLaMA-7B on an H100: the engine counted 52.6 d per token, the formula gives 51.5 d). torch's
allocator holds about ACTIVATION_RESERVE_RATIO of its peak, and DEVICE_OTHER_BYTES sits outside it.
With activation_offload="on" the blocks' inputs but two wait in host memory (counted there), and
the part of their copies that a block's forward or backward does not hide is added (activation_copies).
With activation_checkpointing="auto" the placement is the first iteration's and the step is the
plan's: the core's per-block choice over the room the chunks leave (activation_plan), its kept
blocks' recompute saved. The first iteration runs every block recomputed (inputs offloaded unless
activation_offload is "off"; block 0's activations counted by a forward of its own, dropped at
once): one recomputed block's activations beside the inputs, which the placement plans around.

[Note: what the map of LLaMA-7B on an H100 taught] (8k to 64k tokens, 24 GiB to the whole device)
- The first iteration's peak decides the chunk budget. Counting only the inputs and the logits,
  the estimate gave the chunks 33.9 GiB at 40 GiB and 32k tokens where the engine measured a
  non-model peak of 14.1 GiB and gave them 21.7 GiB (3 optimizer sets on the device, not 9). That
  engine kept block 0's activations through its first iteration to measure them; it now counts
  them by a forward of their own, and the estimate's first iteration holds one recomputed block.
- Where that budget is below the parameters (64k tokens at 24 and 40 GiB) the engine streams
  them: every chunk fetched in the forward and again in the backward, each fetch waited for.
  fetch_stall counts the displaced bytes once; the steps measured 0.7-4.8 s above the GPU alone
  there (-37% at 24 GiB and 32 x 2048 tokens, -18% for one 65,536-token sequence): not modelled.
- Host-bound steps (8k tokens) come out 13-14% short: the optimizer's wait is predicted within
  0.1 s, but the engine's forward and backward took 0.15-0.17 s beyond the GPU alone's and step()
  itself 0.03-0.15 s, neither counted. In the step the host's lanes kept 0.62-0.95 (CPU) and
  0.42-0.67 (link) of their probed rates, against the 0.84 and 0.70 of RATE_SHARES_WHILE_BOTH_RUN.
"""

from __future__ import annotations

import bisect
import dataclasses
import time

import torch

from ._native import _C
from ._engine.activations.offload import LOOKAHEAD
from ._engine.layout import COMPUTE_DTYPES, STATE_DTYPES, ChunkLayout, check_parameters, choose_chunk_size
from ._engine.throughput import PEAK_16BIT_TFLOPS
from ._units import parse_bytes
from .config import GeminiConfig
from .optim.rules import MAX_STATE_KINDS
from .placement.costs import set_bytes_per_element
from .placement.host_memory import host_budget
from .placement.optimizer_lanes import lanes_wait_seconds
from .placement.optimizer_split import predicted_exposed_optimizer_seconds
from .placement.policies import Measurements, make_policy
from .search import unique_parameters

# (tokens per step, fraction of the dense 16-bit peak) measured on the H200, interpolated
GPU_EFFICIENCY = ((1024, 0.58), (4096, 0.65), (8192, 0.665), (16384, 0.672))
H2D_BYTES_PER_S = 55e9          # pinned copies over PCIe 5 x16, either direction (the H200 machine)
OFFLOAD_IN_FLIGHT = LOOKAHEAD    # offloaded block inputs on the device at once (fetched ahead in backward)
LINK_ELEMENTS_PER_S = 2.8e9     # the device's Adam kernel over mapped host state (bench/link_adam.py)
BLOCK_BYTES_PER_WIDTH = 34      # a block's saved tensors per token and unit of width (GPT: GELU MLP of 4 d)
GATED_BLOCK_BYTES_PER_WIDTH = 30  # a gated-MLP block's (Llama): attention, two RMSNorms kept in fp32, rotary
GATED_BYTES_PER_MLP_WIDTH = 8      # ... and per unit of the MLP's inner width: gate, up, their activation, product
ACTIVATION_RESERVE_RATIO = 1.22  # torch's reserved / peak allocated at the end of an iteration
LOGIT_BYTES_PER_VOCAB = 12.6  # per token: bf16 logits, fp32 copy, fp32 and bf16 gradients (H200, 6.7B and 15.4B)
DEVICE_OTHER_BYTES = 1536 << 20  # CUDA context and libraries, outside torch and the chunks
HOST_DISPATCH_S_PER_TENSOR_PASS = 1.45e-4  # the host's share of a pass, per parameter tensor (H200 host)
DEVICE_OPTIMIZER_BYTES_PER_S = 3.5e12  # the device Adam kernel's HBM traffic rate (H200: 4.8 TB/s peak)
PROBE_ELEMENTS = 1 << 26
ATTENTION_BASE_SEQ = 1024  # GPU_EFFICIENCY's sequences: their attention-score work is inside it
ATTENTION_BACKWARD_PER_FORWARD = 2.5  # a fused attention kernel's backward: scores recomputed, four products
SIM_CAPACITY = 1 << 50  # the layout's simulated device: nothing is allocated on it


@dataclasses.dataclass(frozen=True)
class Shape:
    """What the activation and FLOP models read from a model: layers, width, vocabulary, and the
    width of a gated MLP's inner projections (0: not gated)."""
    layers: int
    width: int
    vocab: int
    gated_mlp_width: int = 0

    def block_activation_bytes_per_token(self) -> int:
        """A block's saved tensors per token without checkpointing (the module's note)."""
        if self.gated_mlp_width:
            return GATED_BLOCK_BYTES_PER_WIDTH * self.width + GATED_BYTES_PER_MLP_WIDTH * self.gated_mlp_width
        return BLOCK_BYTES_PER_WIDTH * self.width


def model_shape(model: torch.nn.Module) -> Shape | None:
    """Layers (the longest ModuleList), width and vocabulary (the largest embedding), or None; the
    MLP is gated where two Linear layers of the first block share the widest output, wider than the
    width (gate and up projections)."""
    embeddings = [m for m in model.modules() if isinstance(m, torch.nn.Embedding)]
    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList)]
    if not embeddings or not lists:
        return None
    vocab = max(embeddings, key=lambda e: e.num_embeddings)
    blocks = max(lists, key=len)
    outs = [m.out_features for m in blocks[0].modules() if isinstance(m, torch.nn.Linear)] if len(blocks) else []
    inner = max(outs, default=0)  # an MLP wider than the model; two of that width: gated
    gated = inner if inner > vocab.embedding_dim and outs.count(inner) >= 2 else 0
    return Shape(len(blocks), vocab.embedding_dim, vocab.num_embeddings, gated)


def activation_bytes(shape: Shape, checkpointing: bool, tokens: int, loss_chunk_tokens: int = 0) -> int:
    """The activations' peak bytes of `tokens` tokens per step; the logits' part counts only the
    loss's piece of `loss_chunk_tokens` tokens where the loss is computed that many at a time.
    Under checkpointing the peak is the blocks' inputs and the larger of the loss's logits and one
    block's recomputed activations (its backward, after the loss)."""
    logits = int(logits_bytes(shape, tokens, loss_chunk_tokens))
    if not checkpointing:
        return tokens * shape.layers * shape.block_activation_bytes_per_token() + logits
    return tokens * shape.layers * shape.width * 2 + max(logits, tokens * shape.block_activation_bytes_per_token())


def logits_bytes(shape: Shape, tokens: int, loss_chunk_tokens: int = 0) -> float:
    """The loss's logits and their gradients: its piece of `loss_chunk_tokens` tokens, or every token."""
    logit_tokens = min(tokens, loss_chunk_tokens) if loss_chunk_tokens > 0 else tokens
    return logit_tokens * shape.vocab * LOGIT_BYTES_PER_VOCAB


def _loss_chunk_tokens(model: torch.nn.Module, given: int | None) -> int:
    """`given`, else the chunk of gemini_ext's GPT (GPTConfig.loss_chunk_tokens), else 0."""
    if given is not None:
        if not isinstance(given, int) or given < 0:
            raise ValueError(f"gx.estimate: loss_chunk_tokens must be an int >= 0 (0: the loss over the whole batch "
                             f"at once), got {given!r}.")
        return given
    from .models.gpt import GPT
    return model.cfg.loss_chunk_tokens if isinstance(model, GPT) else 0


def gpu_efficiency(tokens: int) -> float:
    keys = [t for t, _ in GPU_EFFICIENCY]
    i = bisect.bisect_left(keys, tokens)
    if i == 0:
        return GPU_EFFICIENCY[0][1]
    if i == len(keys):
        return GPU_EFFICIENCY[-1][1]
    (t0, e0), (t1, e1) = GPU_EFFICIENCY[i - 1], GPU_EFFICIENCY[i]
    return e0 + (e1 - e0) * (tokens - t0) / (t1 - t0)


def cpu_elements_per_s() -> float:
    """The CPU Adam kernel over PROBE_ELEMENTS (host memory only), best of three."""
    n = PROBE_ELEMENTS
    master, m, v = torch.zeros(n), torch.zeros(n), torch.zeros(n)
    grad = torch.full((n,), 1e-3, dtype=torch.bfloat16)
    copy = torch.empty(n, dtype=torch.bfloat16)
    best = float("inf")
    for step in range(1, 4):
        started = time.perf_counter()
        _C.cpu_adam_step(master, m, v, grad, param16=copy, step=step, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
                         weight_decay=0.0)
        best = min(best, time.perf_counter() - started)
    return n / best


def _device_figures(config: GeminiConfig, device_bytes, peak_tflops, device_name):
    """(device bytes planned for, peak TFLOP/s, name) without touching device memory."""
    name = device_name
    if device_bytes is None and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(torch.cuda.current_device())  # no allocation
        device_bytes, name = props.total_memory, name or props.name
    if device_bytes is None:
        raise ValueError("gx.estimate: no GPU here to read the device memory from; pass device_bytes= (e.g. "
                         "'141GB') and peak_tflops= (or device_name=, e.g. 'H200') of the machine to estimate.")
    device_bytes = parse_bytes(int(device_bytes) if isinstance(device_bytes, float) else device_bytes,
                               "gx.estimate(device_bytes=...)")
    if config.gpu_memory_limit:
        device_bytes = min(device_bytes, int(config.gpu_memory_limit))
    if peak_tflops is None and name is not None:
        peak_tflops = next((t for key, t in PEAK_16BIT_TFLOPS if key in name), None)
    if peak_tflops is None:
        raise ValueError(f"gx.estimate: the 16-bit peak of device {name!r} is not in the table; pass peak_tflops=.")
    return device_bytes, float(peak_tflops), name


def estimate(model: torch.nn.Module, config: GeminiConfig | None = None, *, tokens_per_step: int,
             world_size: int = 1, checkpointing: bool = True, loss_chunk_tokens: int | None = None,
             activation_bytes_per_token_override: int | None = None, device_bytes=None, host_bytes=None,
             peak_tflops: float | None = None, device_name: str | None = None,
             cpu_optimizer_elements_per_s: float | None = None, seq_len: int | None = None,
             gpu_flops_per_s: float | None = None) -> dict:
    """The plan, device and host bytes and the predicted step time (the module's note) of
    training `model` under `config` with `tokens_per_step` tokens per optimizer step over
    `world_size` ranks (one host). Nothing is allocated on the device; the model may be on meta.
    device_bytes, host_bytes, peak_tflops, device_name and cpu_optimizer_elements_per_s (the CPU
    Adam kernel's rate there, e.g. from bench/cpu_adam.py) describe another machine. loss_chunk_tokens:
    the loss's logits this many tokens at a time (checkpointed pieces); None reads it from gemini_ext's
    GPT, 0 is the whole batch. seq_len: tokens per sequence (the module's note; None: 1024).
    gpu_flops_per_s: the GPU's achieved rate on this model (e.g. its measured forward and backward)."""
    config = config or GeminiConfig(placement_policy="auto")
    _check_arguments(config, tokens_per_step, world_size, gpu_flops_per_s)
    loss_chunk_tokens = _loss_chunk_tokens(model, loss_chunk_tokens)
    capacity, peak, name = _device_figures(config, device_bytes, peak_tflops, device_name)
    compute_dtype = COMPUTE_DTYPES[config.precision]
    named = unique_parameters(model)
    check_parameters(model, named, config, compute_dtype)
    chunk_size = choose_chunk_size(model, named, config, world_size)
    context = _C.DeviceContext("sim", capacity_bytes=SIM_CAPACITY, sim_max_copy_delay_us=0, sim_seed=1)
    chunks = _C.ChunkManager(context, world_size=world_size, rank=0, pin_memory=False)
    if (unsupported := config.unsupported_without_masters()) is not None:
        raise NotImplementedError(unsupported)
    layout = ChunkLayout(chunks, named, compute_dtype, torch.device("cpu"), MAX_STATE_KINDS, chunk_size,
                         STATE_DTYPES[config.optimizer_state_dtype], config.master_weights)
    available, source = _host_available(host_bytes, world_size)
    releasable = sum(p.numel() * p.element_size() for _, p in named if p.device.type == "cpu")
    base = dict(device_kind="cuda", allocator_mode="default", device_capacity_bytes=capacity,
                device_total_bytes=capacity, set_shard_bytes=tuple(layout.shard_bytes),
                trainable=tuple(s.trainable for s in layout.sets),
                set_bytes_per_element=set_bytes_per_element(compute_dtype, layout.planned_state_kinds,
                                                            layout.state_dtype, layout.has_master),
                master_itemsize=4 if layout.has_master else 0,
                compute_itemsize=compute_dtype.itemsize, sharded=world_size > 1, world_size=world_size,
                host_available_bytes=available, host_budget_source=source, host_releasable_bytes=releasable,
                frozen_master_bytes=layout.frozen_master_shard_bytes())
    policy = make_policy(config)
    initial = _initial_placement(policy, base)

    # The first iteration, predicted (see [Note: what the map of LLaMA-7B on an H100 taught]).
    n_total = sum(p.numel() for _, p in named)
    n_trainable = sum(p.numel() for _, p in named if p.requires_grad)
    shape = model_shape(model)
    rank_tokens = tokens_per_step // world_size
    checkpointing = checkpointing or config.activation_checkpointing != "off"  # the engine's, where it checkpoints
    activations = _activations(shape, checkpointing, rank_tokens, loss_chunk_tokens,
                               activation_bytes_per_token_override)
    gpu_rate = gpu_flops_per_s or peak * 1e12 * gpu_efficiency(rank_tokens)
    gpu_seconds, forward_seconds = _gpu_seconds(rank_tokens, n_total, n_trainable, checkpointing, gpu_rate,
                                                len(named), _attention_forward_flops(shape, rank_tokens, seq_len))
    offload = _activation_offload(config, checkpointing, shape, rank_tokens, forward_seconds, gpu_seconds)
    activations -= offload["device_bytes_freed"]
    per_token = activations // max(rank_tokens, 1)
    planned = config.activation_checkpointing == "auto" and shape is not None
    warm = activations  # the planner's first forward: every block recomputed, the least the plan allows
    cpu_rate, cpu_source = _cpu_rate(cpu_optimizer_elements_per_s)
    measured = Measurements(**base, non_model_peak_bytes=warm, device_other_bytes=DEVICE_OTHER_BYTES,
                            non_model_reserved_bytes=int(warm * ACTIVATION_RESERVE_RATIO),
                            forward_seconds=forward_seconds,
                            backward_seconds=gpu_seconds - forward_seconds, cpu_optimizer_elements_per_s=cpu_rate,
                            h2d_bytes_per_s=H2D_BYTES_PER_S, link_optimizer_elements_per_s=LINK_ELEMENTS_PER_S,
                            optimizer_steps_during_backward=config.optimizer_step_in_backward)
    chosen = policy.after_iteration(measured, initial) if policy.decides_after_iterations("cuda") else initial
    if planned:  # the plan made after the first iteration
        chunk_bytes = _chunk_device_bytes(measured, chosen)
        plan = _activation_plan(config, shape, rank_tokens, loss_chunk_tokens, chunk_bytes, capacity,
                                forward_seconds, gpu_seconds)
        activations, offload, gpu_seconds = plan["activations"], plan, gpu_seconds - plan["recompute_saved_s"]
    return _summary(config, layout, measured, initial, chosen, gpu_seconds, forward_seconds, cpu_rate, cpu_source,
                    dict(tokens_per_step=tokens_per_step, world_size=world_size, rank_tokens=rank_tokens,
                         activation_bytes=activations, activation_offload=offload, activation_bytes_per_token=per_token,
                         peak_tflops=peak, device_name=name, n_total=n_total, n_trainable=n_trainable,
                         chunk_size=chunk_size, gpu_flops_per_s=gpu_rate))


def _initial_placement(policy, base: dict):
    """The policy's plan before the first iteration. Where the host is too small for what the device
    cannot take either (enable() would raise), the plan of a host with room, which the summary then
    reports as not fitting this one (fits["host"] is False)."""
    try:
        return policy.initial(Measurements(**base))
    except _C.OutOfMemoryError:
        if base["host_available_bytes"] is None:
            raise
        return policy.initial(Measurements(**{**base, "host_available_bytes": None}))


def _check_arguments(config: GeminiConfig, tokens_per_step, world_size: int, gpu_flops_per_s) -> None:
    if config.precision not in COMPUTE_DTYPES or config.precision == "fp32":
        raise ValueError(f"gx.estimate: precision={config.precision!r}: the step-time model is for bf16/fp16 compute.")
    if not isinstance(tokens_per_step, int) or tokens_per_step <= 0:
        raise ValueError(f"gx.estimate: tokens_per_step must be a positive int, got {tokens_per_step!r}.")
    if world_size < 1:
        raise ValueError(f"gx.estimate: world_size must be >= 1, got {world_size}.")
    if gpu_flops_per_s is not None and not gpu_flops_per_s > 0:
        raise ValueError(f"gx.estimate: gpu_flops_per_s must be > 0 (FLOP/s), got {gpu_flops_per_s!r}.")


def _attention_forward_flops(shape, rank_tokens: int, seq_len: int | None) -> float:
    """The causal forward's attention-score FLOPs beyond ATTENTION_BASE_SEQ-token sequences (the
    module's note)."""
    if seq_len is None or shape is None:
        return 0.0
    if not isinstance(seq_len, int) or seq_len <= 0:
        raise ValueError(f"gx.estimate: seq_len must be a positive int (tokens per sequence), got {seq_len!r}.")
    return 2.0 * shape.width * max(0, seq_len - ATTENTION_BASE_SEQ) * rank_tokens * shape.layers


def _host_available(host_bytes, world_size: int) -> tuple:
    """(the host bytes each rank may use, where the figure comes from): given, or this host's."""
    if host_bytes is not None:
        return parse_bytes(host_bytes, "gx.estimate(host_bytes=...)") // world_size, "given"
    budget = host_budget(world_size)
    return (budget.bytes, budget.source) if budget is not None else (None, None)


def _gpu_seconds(rank_tokens: int, n_total: int, n_trainable: int, checkpointing: bool, rate: float,
                 tensors: int, attention_forward_flops: float = 0.0) -> tuple[float, float]:
    """The GPU's forward and backward (recompute included under checkpointing), and the forward
    alone: FLOPs at `rate` (FLOP/s), or the host's dispatch where that is longer."""
    forward_flops = rank_tokens * 2 * n_total + attention_forward_flops
    flops = (forward_flops * (2 if checkpointing else 1) + rank_tokens * (2 * n_total + 2 * n_trainable) +
             attention_forward_flops * ATTENTION_BACKWARD_PER_FORWARD)
    dispatch_per_pass = tensors * HOST_DISPATCH_S_PER_TENSOR_PASS
    return (max(flops / rate, (3 if checkpointing else 2) * dispatch_per_pass),
            max(forward_flops / rate, dispatch_per_pass))


def _activations(shape, checkpointing: bool, rank_tokens: int, loss_chunk_tokens: int, per_token_override) -> int:
    if per_token_override is not None:
        return rank_tokens * int(per_token_override)
    if shape is None:
        raise ValueError("gx.estimate: the model has no embedding and ModuleList of blocks to read its shape from; "
                         "pass activation_bytes_per_token_override= (bytes of activations per token).")
    return activation_bytes(shape, checkpointing, rank_tokens, loss_chunk_tokens)


def _activation_offload(config, checkpointing: bool, shape, rank_tokens: int, forward_seconds: float,
                        gpu_seconds: float) -> dict:
    """activation_offload="on" under checkpointing: each block's input (L d bf16 per token) leaves
    the device but for OFFLOAD_IN_FLIGHT of them and waits in host memory; each copy, either way,
    costs what a block's forward (down) or backward (up) beside it does not hide."""
    none = {"device_bytes_freed": 0, "host_bytes": 0, "exposed_copy_s": 0.0}
    if config.activation_offload == "off" or not checkpointing or shape is None:
        return none
    per_block = rank_tokens * shape.width * 2
    copy = per_block / H2D_BYTES_PER_S
    forward_block = forward_seconds / shape.layers
    backward_block = (gpu_seconds - forward_seconds) / shape.layers
    exposed = shape.layers * (max(0.0, copy - forward_block) + max(0.0, copy - backward_block))
    return {"device_bytes_freed": per_block * max(0, shape.layers - OFFLOAD_IN_FLIGHT),
            "host_bytes": per_block * shape.layers, "exposed_copy_s": exposed}


def _activation_plan(config, shape, rank_tokens: int, loss_chunk_tokens: int, chunk_bytes: int,
                     capacity: int, forward_seconds: float, gpu_seconds: float) -> dict:
    """activation_checkpointing="auto": the engine's per-block plan (core/activation_plan.h) over
    the room the chunks leave, from the first iteration's figures. Blocks alike: their activations
    per token as counted above, 2 d of input, the forward's time in equal parts, the backward twice
    the forward. The plan's bytes hold the inputs kept and a recomputed block's activations; beside
    them the loss's logits count where they are larger than that block's. Returns the steady
    iteration's activation bytes, host bytes and exposed copies, and the recompute it saves."""
    layers, per_block_input = shape.layers, rank_tokens * shape.width * 2
    forward_block = forward_seconds / layers
    block_bytes = rank_tokens * shape.block_activation_bytes_per_token()
    blocks = [(block_bytes, per_block_input, forward_block, 2 * forward_block)] * layers
    outside_blocks = max(0, int(logits_bytes(shape, rank_tokens, loss_chunk_tokens)) - block_bytes)
    # torch's allocator holds ACTIVATION_RESERVE_RATIO of the activations' peak
    room = int((capacity - chunk_bytes - DEVICE_OTHER_BYTES) / ACTIVATION_RESERVE_RATIO) - outside_blocks
    link = H2D_BYTES_PER_S if config.activation_offload != "off" else 0.0
    plan = _C.plan_activations(blocks, max(0, room), link, LOOKAHEAD, allow_keep=True,
                               allow_recompute=config.activation_offload != "on")
    counts = {c: plan["choices"].count(c) for c in ("keep", "recompute", "offload")}
    recomputed = counts["recompute"] + counts["offload"]
    return {"activations": outside_blocks + plan["device_bytes"], "host_bytes": counts["offload"] * per_block_input,
            "device_bytes_freed": per_block_input * layers - plan["device_bytes"],
            "exposed_copy_s": max(0.0, plan["added_seconds"] - recomputed * forward_block),  # no rounding below 0
            "recompute_saved_s": counts["keep"] * forward_block,
            "plan": {**counts, "room_bytes": room, "planned_device_bytes": plan["device_bytes"], "fits": plan["fits"]}}


def _chunk_device_bytes(m: Measurements, chosen) -> int:
    """The chunks' bytes on the device under `chosen`: parameters and the device-held state, within the budget."""
    itemsize = m.compute_itemsize
    on_host = [s.optim_on_host and t for s, t in zip(chosen.sets, m.trainable)]
    device_state = sum(b // itemsize for b, h, t in zip(m.set_shard_bytes, on_host, m.trainable) if t and not h) \
        * m.set_bytes_per_element
    return min(sum(m.set_shard_bytes) + device_state, chosen.device_budget_bytes or m.device_capacity_bytes)


def _cpu_rate(given: float | None) -> tuple[float, str]:
    """The CPU Adam rate (elements/s) the estimate uses, and where it comes from."""
    return (float(given), "given") if given else (cpu_elements_per_s(), "measured here")


def _summary(config, layout, m: Measurements, initial, chosen, gpu_seconds, forward_seconds, cpu_rate, cpu_source,
             facts) -> dict:
    itemsize = m.compute_itemsize
    elements = [b // itemsize for b in m.set_shard_bytes]
    on_host = [s.optim_on_host and t for s, t in zip(chosen.sets, m.trainable)]
    link = set(chosen.link_sets)
    host_elements = sum(n for n, h in zip(elements, on_host) if h)
    device_state = sum(n for n, h, t in zip(elements, on_host, m.trainable) if t and not h) * m.set_bytes_per_element
    param_bytes = sum(m.set_shard_bytes)
    budget = chosen.device_budget_bytes or m.device_capacity_bytes
    displaced = max(0, param_bytes + device_state - budget)
    # the optimizer's wait: list scheduling over the lanes, at their rates while both run
    if m.optimizer_steps_during_backward:  # from backward on, in the order the gradients complete
        waited = predicted_exposed_optimizer_seconds(elements, on_host, gpu_seconds - forward_seconds, cpu_rate,
                                                     during_backward=True, forward_seconds=forward_seconds)
    elif link:
        waited = lanes_wait_seconds(elements, on_host, link, forward_seconds, cpu_rate, LINK_ELEMENTS_PER_S)
    else:
        waited = predicted_exposed_optimizer_seconds(elements, on_host, forward_seconds, cpu_rate,
                                                     during_backward=False)
    stall = displaced / H2D_BYTES_PER_S
    # step() starts the host steps once every gradient is on the host: what of the host sets' copies
    # down a short backward pass cannot cover comes first (see [Note: the step-time model])
    grads_tail = 0.0 if m.optimizer_steps_during_backward else max(
        0.0, host_elements * itemsize / H2D_BYTES_PER_S - (gpu_seconds - forward_seconds))
    device_elements = sum(n for n, h, t in zip(elements, on_host, m.trainable) if t and not h)
    per_element = {"fp32": 28, "bf16": 20 if config.master_weights else 14}[config.optimizer_state_dtype]
    device_optimizer = device_elements * per_element / DEVICE_OPTIMIZER_BYTES_PER_S
    offload = facts["activation_offload"]
    step = gpu_seconds + device_optimizer + grads_tail + waited + stall + offload["exposed_copy_s"]
    pcie = 2 * host_elements * itemsize + 2 * displaced  # host sets' parameters up and gradients down
    host_bytes = host_elements * m.set_bytes_per_element + (
        host_elements * itemsize if initial.params_born_on_device else param_bytes) + offload["host_bytes"] \
        + m.frozen_master_bytes
    model_flops = 6 * facts["n_trainable"] + 2 * (facts["n_total"] - facts["n_trainable"])  # 4 N + 2 N_trainable
    rank_tokens_per_s = facts["rank_tokens"] / step
    device_bytes = _chunk_device_bytes(m, chosen) + int(facts["activation_bytes"] * ACTIVATION_RESERVE_RATIO) \
        + DEVICE_OTHER_BYTES
    return {
        "plan": {"policy": config.placement_policy, "chunk_size": facts["chunk_size"], "chunk_sets": len(elements),
                 "optim_sets_on_device": sum(1 for h, t in zip(on_host, m.trainable) if t and not h),
                 "optim_sets_on_host": sum(on_host), "link_lane_sets": len(link),
                 "host_stepped_parameters": host_elements, "params_born_on_device": initial.params_born_on_device,
                 "chunk_budget_bytes": budget, "evicted_param_bytes": displaced},
        "device_bytes": device_bytes,
        "host_bytes": host_bytes,
        # whether the plan fits the device (its capacity, or gpu_memory_limit) and the host (None: unknown)
        "fits": {"device": device_bytes <= m.device_capacity_bytes, "device_capacity_bytes": m.device_capacity_bytes,
                 "host": None if m.host_available_bytes is None else host_bytes <= m.host_available_bytes,
                 "host_available_bytes": m.host_available_bytes},
        "activation_bytes": facts["activation_bytes"],
        "step_time_s": step,
        "step_parts_s": {"gpu": gpu_seconds, "device_optimizer": device_optimizer, "gradients_tail": grads_tail,
                         "optimizer_wait": waited, "fetch_stall": stall,
                         "activation_copies": offload["exposed_copy_s"]},
        "activation_offload": {"host_bytes": offload["host_bytes"],
                               "device_bytes_freed": offload["device_bytes_freed"]},
        "activation_plan": offload.get("plan"),  # activation_checkpointing="auto": blocks kept, recomputed, offloaded
        "pcie_bytes_per_step": pcie, "pcie_bound_s": pcie / 2 / H2D_BYTES_PER_S,
        "tokens_per_s": facts["tokens_per_step"] / step,
        "mfu": rank_tokens_per_s * model_flops / (facts["peak_tflops"] * 1e12),
        "rates": {"gpu_flops_per_s": facts["gpu_flops_per_s"],
                  "cpu_optimizer_elements_per_s": cpu_rate, "cpu_optimizer_source": cpu_source,
                  "link_optimizer_elements_per_s": LINK_ELEMENTS_PER_S,
                  "h2d_bytes_per_s": H2D_BYTES_PER_S},
        "inputs": {k: facts[k] for k in ("tokens_per_step", "world_size", "activation_bytes_per_token", "peak_tflops",
                                         "device_name")},
    }
