"""enable() and GeminiEngine: the model's parameters live in chunks for the life of the engine.

[Note: what enable() builds]
1. Parameters (tied ones once) are registered, in definition order, into chunk groups that
   share one layout: `param` (the compute dtype of `precision`), `grad` (same dtype), `master`
   (fp32; absent for fp32 precision, where the parameter chunk is the master), `exp_avg` and
   `exp_avg_sq` (fp32). Frozen parameters (requires_grad=False at enable) go to a `frozen`
   group without companions. Every group starts on the host; the host copies are filled from
   the parameters' current values.
2. The placement policy decides, per parameter chunk, where its optimizer state lives and
   whether its home is the host (static policy: core/static_placement.h); the C++
   GeminiManager carries that out and binds one torch storage per parameter chunk to the
   chunk's device copy (see csrc/torch/param_storage.h).
3. Each parameter, still the same Python object, gets `.data` = a view into its chunk storage
   (dtype = compute dtype, device = the compute device: cuda, or cpu for the sim device).
   Buffers move to the compute device, keeping their dtype unless cast_buffers (_buffers.py).
4. Hooks are registered (gemini_ext/_hooks.py); their bodies are C++. Parameters touched from
   outside the hooks are served by _param_access.py; _guards.py catches foreign optimizers and
   torch's clipping on managed parameters while the engine is open.
Closing (or leaving the `with` block) gives every parameter back an ordinary tensor of its
original dtype and device holding the current fp32 master value, restores buffers, removes the
hooks and frees the chunk pools.
"""

from __future__ import annotations

import contextlib
import logging
import time
import warnings

import torch

from . import _C, _guards, allocator, checkpoint
from ._buffers import BufferPlacement
from ._clipping import GradClipper
from ._env import SETTINGS, logger
from ._hooks import HookSet
from ._materialize import MetaMaterializer
from ._param_access import ParamAccess
from ._units import format_bytes
from .amp import DynamicLossScaler
from .config import DEFAULT_SIM_CAPACITY_BYTES, GeminiConfig
from .optim import SUPPORTED_OPTIMIZERS, GeminiOptimizer  # noqa: F401  (re-exported)
from .policy import host_available_bytes, make_policy, mem_available_bytes, process_rss_bytes
from .search import ALIGNMENT_NUMEL, search_chunk_configuration, unique_parameters, wider_search

COMPUTE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
CHUNK_SOURCE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # parameter dtypes enable() takes

def cuda_available() -> bool:
    """A CUDA build of the extension on a machine where torch sees a GPU."""
    return bool(_C.build_info()["cuda"]) and torch.cuda.is_available()


def resolve_device(config: GeminiConfig) -> str:
    device = config.device if config.device != "auto" else SETTINGS.device
    if device == "auto":
        return "cuda" if cuda_available() else "sim"
    if device == "cuda" and not cuda_available():
        info = _C.build_info()
        why = "this gemini_ext build has no CUDA support" if not info["cuda"] else "torch sees no CUDA device"
        raise RuntimeError(f"device='cuda' requested, but {why}. Use device='sim' (or GEMINI_EXT_DEVICE=sim) on "
                           "machines without a GPU, or rebuild against a CUDA torch.")
    return device


def resolve_process_group(process_group):
    """The ZeRO group: the one passed, else the default group when torch.distributed is
    initialised with more than one rank; None (one unsharded process) otherwise. Passing a
    group of one rank explicitly runs the sharded path over it (its collectives included)."""
    if process_group is not None:
        if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
            raise RuntimeError("enable(process_group=...): torch.distributed is not initialised; call "
                               "torch.distributed.init_process_group() first (torchrun sets up its environment).")
        return process_group
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        if torch.distributed.get_world_size() > 1:
            return torch.distributed.group.WORLD
    return None


def split_groups(group, extra_dp_size: int):
    """(ZeRO group, replica group, replica index) of this rank within the data-parallel `group`.

    With W ranks and extra_dp_size E, the ZeRO groups are E blocks of Z = W / E consecutive
    ranks (neighbours, e.g. the GPUs of one node, share the all-gathers), and replica group i
    holds the i-th rank of every block. Every rank creates every group, in the same order, as
    torch.distributed.new_group requires. Without extra replicas the ZeRO group is `group`."""
    if group is None or extra_dp_size == 1:
        return group, None, 0
    ranks = torch.distributed.get_process_group_ranks(group)
    zero_size = len(ranks) // extra_dp_size
    me = torch.distributed.get_rank()
    zero = replica = None
    index = 0
    for k in range(extra_dp_size):
        members = ranks[k * zero_size:(k + 1) * zero_size]
        g = torch.distributed.new_group(members)
        if me in members:
            zero, index = g, k
    for i in range(zero_size):
        members = ranks[i::zero_size]
        g = torch.distributed.new_group(members)
        if me in members:
            replica = g
    return zero, replica, index


def held_exactly(orig: torch.dtype, chunk: torch.dtype) -> bool:
    """Whether a chunk of dtype `chunk` represents every value of dtype `orig` exactly."""
    return orig == chunk or (chunk == torch.float32 and orig in (torch.bfloat16, torch.float16))


class GeminiEngine:
    """Owns the chunks and hooks of one model; see enable()."""

    def __init__(self, model: torch.nn.Module, config: GeminiConfig, process_group=None, param_init_fn=None):
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"enable(model): expected a torch.nn.Module, got {type(model).__name__}.")
        if getattr(model, "_gemini_engine", None) is not None:
            raise RuntimeError(f"enable(): this {type(model).__name__} is already managed by an open engine; "
                               "close it (leave its `with` block) first.")
        self._dp_group = resolve_process_group(process_group)  # every data-parallel rank
        world_size = torch.distributed.get_world_size(self._dp_group) if self._dp_group is not None else 1
        if not config.master_weights and config.precision != "fp32":
            raise NotImplementedError(f"master_weights=False with precision={config.precision!r}: stepping 16-bit "
                                      "parameters without fp32 masters is not supported; use master_weights=True.")
        if world_size % config.extra_dp_size != 0:
            raise ValueError(f"extra_dp_size={config.extra_dp_size}: it must divide the world size ({world_size}); "
                             "the ZeRO group is world_size / extra_dp_size ranks.")
        # ZeRO inside a group, replicas across groups (HSDP): process_group is the ZeRO group
        # (chunks are sharded over it), replica_group the ranks holding the same shard.
        self.process_group, self.replica_group, self.replica_index = split_groups(self._dp_group, config.extra_dp_size)
        self.world_size = torch.distributed.get_world_size(self.process_group) if self.process_group is not None else 1
        self.rank = torch.distributed.get_rank(self.process_group) if self.process_group is not None else 0
        self.model = model
        self.config = config
        self.device_kind = resolve_device(config)
        self.compute_dtype = COMPUTE_DTYPES[config.precision]
        self.scaler = DynamicLossScaler.from_config(config) if config.precision == "fp16" else None
        self.policy = make_policy(config)
        self._steps_log = []  # per iteration: traffic and scheduling deltas
        self._last_totals = None
        self._closed = False
        self._optimizer = None
        self._optimizers = []
        self._optimizer_steps = 0
        self._skipped_steps = 0
        self._clipper = GradClipper(self)
        start = time.perf_counter()
        # seconds per phase of enable(), for the log and stats(): where a large model's set-up goes
        self.setup_phases = {}
        last = [start]

        def phase_done(name: str) -> None:
            now = time.perf_counter()
            self.setup_phases[name] = now - last[0]
            last[0] = now

        named = unique_parameters(model)
        if not named:
            raise ValueError(f"enable(): {type(model).__name__} has no parameters to place in chunks.")
        for name, p in named:
            if p.dtype not in CHUNK_SOURCE_DTYPES:
                raise TypeError(f"enable(): parameter {name!r} has dtype {p.dtype}; gemini_ext trains float32, "
                                "bfloat16 and float16 parameters (fp32 masters, compute in `precision`), so a "
                                f"{p.dtype} parameter would silently lose precision or meaning. Convert the model "
                                "first (model.float()), or make a non-trainable tensor a buffer.")
        narrower = sorted({str(p.dtype) for _, p in named if p.dtype.itemsize < self.compute_dtype.itemsize})
        if narrower:
            warnings.warn(f"gemini_ext: the model has {', '.join(narrower)} parameters and precision="
                          f"{config.precision!r}: the fp32 masters start from those values (exactly), training "
                          f"computes in {self.compute_dtype}, and close() gives the parameters back in their own "
                          "dtype, rounded from the masters.", stacklevel=3)
        chunk_cfg = config.chunk_config_for(world_size)
        if chunk_cfg is None:
            found = search_chunk_configuration(model, config.search_range_m, config.min_chunk_size_m,
                                               precision=config.precision)
            chunk_size = found["chunk_size"]
            wider = wider_search(model, found, config.search_range_m, config.min_chunk_size_m, config.precision)
            if wider is not None:
                wider_range, better = wider
                warnings.warn(
                    f"gemini_ext: the chunk search over search_range_m={config.search_range_m:g} found chunks of "
                    f"{chunk_size:,} elements that waste {format_bytes(found['wasted_bytes'])} "
                    f"({found['wasted_frac']:.1%}) of the parameter chunks, and the same fraction of every gradient "
                    f"and optimizer-state chunk; search_range_m={wider_range:g} finds {better['chunk_size']:,} "
                    f"elements, wasting {better['wasted_frac']:.1%}. Pass search_range_m={wider_range:g} (or a "
                    "chunk_config_dict) to use that memory.", stacklevel=3)
            # A model smaller than the minimum chunk size needs no chunk larger than itself.
            aligned_total = sum(-(-p.numel() // ALIGNMENT_NUMEL) * ALIGNMENT_NUMEL for _, p in named)
            chunk_size = min(chunk_size, aligned_total)
        else:
            chunk_size = chunk_cfg["chunk_size"]
        self.chunk_size = chunk_size
        self._build_context()
        mgr = self._mgr
        host = mgr.host_tier
        meta = MetaMaterializer(model, self.compute_device, param_init_fn)  # empty unless built on meta

        dt = self.compute_dtype
        has_master = dt != torch.float32
        trainable = [(n, p) for n, p in named if p.requires_grad]
        frozen = [(n, p) for n, p in named if not p.requires_grad]
        kinds = ["param", "grad", "exp_avg", "exp_avg_sq"] + (["master"] if has_master else [])
        group_dtype = {"param": dt, "grad": dt, "master": torch.float32, "exp_avg": torch.float32,
                       "exp_avg_sq": torch.float32, "frozen": dt}
        if trainable:
            for kind in kinds:
                mgr.create_group(kind, group_dtype[kind], chunk_size, host, ALIGNMENT_NUMEL)
        if frozen:
            mgr.create_group("frozen", dt, chunk_size, host, ALIGNMENT_NUMEL)
        handles = {}  # (kind, parameter index) -> (chunk, slot)
        self._names, self._params, self._orig, self._numels = [], [], [], []
        for name, p in trainable + frozen:
            idx = len(self._params)
            self._names.append(name)
            self._params.append(p)
            self._numels.append(p.numel())
            self._orig.append((p.dtype, self.compute_device if p.is_meta else p.device))
            for kind in (kinds if p.requires_grad else ["frozen"]):
                handles[(kind, idx)] = mgr.register_tensor(kind, name, p.numel(), list(p.shape))
        mgr.close_chunks()  # the layouts are known from here: plan before any memory is taken
        sets = self._plan_sets(mgr, has_master)
        # Optimizer state planned for the device is allocated there directly (never on the host);
        # the gradient chunk of such a set gets no copy yet: its gradients are born on the device.
        device_sets = [s for s in sets if s["grad"] >= 0 and not s["optim_on_host"]]
        device_first = [s[k] for s in device_sets for k in ("master", "exp_avg", "exp_avg_sq") if s[k] >= 0]
        phase_done("plan")  # chunk size, layouts, placement plan
        mgr.finalize(device_first, [s["grad"] for s in device_sets])
        phase_done("allocate")  # every chunk's first copy, zeroed
        on_device = set(device_first)
        self._index = {id(p): i for i, p in enumerate(self._params)}
        # [Note: releasing the model's own tensors while filling the chunks]
        # A model that fills most of host memory cannot coexist with a second full copy of itself
        # in chunks. Unsharded, every parameter's exact value lands in a chunk of this process
        # (the fp32 master, or the parameter chunk itself under fp32), so the original tensor is
        # released right after it is copied. If enable() fails later, the values are read back
        # from those chunks (_restore_released) so the caller's model is intact. Sharded, each rank
        # keeps only its shard, and every rank holds a whole model to begin with (a 20B model in
        # fp32 is 81 GB per GPU): the originals are released too, but a failure cannot give them
        # back without the other ranks (a collective a failed rank may never join), so it says
        # that the model must be built again instead.
        exact_kind = "master" if has_master else "param"
        sharded = self.world_size > 1
        self._released = []
        self._released_sharded = 0
        # The fill phase in parts (stats()["setup_fill_seconds"]): materialising meta-built modules,
        # taking rank 0's values, writing the shards. The device is synchronised at each part's
        # end, so that asynchronous kernels are counted where they were launched.
        fill_parts = dict.fromkeys(("materialize", "from_rank0", "write"), 0.0)
        on_cuda = any(device.type == "cuda" for _, device in self._orig)
        sync = self.compute_device.type == "cuda"

        def part_done(name: str, since: float) -> float:
            if sync:
                torch.cuda.synchronize(self.compute_device)
            now = time.perf_counter()
            fill_parts[name] += now - since
            return now

        try:
            with torch.no_grad():
                for i, p in enumerate(self._params):
                    t = time.perf_counter()
                    meta.ensure(p)  # a meta-built model gets this parameter's module group now
                    t = part_done("materialize", t)
                    value = self._from_rank0(p.detach())
                    t = part_done("from_rank0", t)
                    # Each rank fills the part of each tensor that lies in its shard (all of it unsharded).
                    if p.requires_grad:
                        mgr.write_slot(handles[("param", i)], host, value)
                        if has_master:
                            tier = "device" if handles[("master", i)][0] in on_device else host
                            mgr.write_slot(handles[("master", i)], tier, value)
                        for kind in kinds:
                            mgr.transition(handles[(kind, i)], _C.TensorState.HOLD)
                    else:
                        mgr.write_slot(handles[("frozen", i)], host, value)
                        mgr.transition(handles[("frozen", i)], _C.TensorState.HOLD)
                    del value
                    part_done("write", t)
                    kind = exact_kind if p.requires_grad else "frozen"
                    if sharded:
                        p.data = torch.empty(0, dtype=p.dtype, device=p.device)
                        self._released_sharded += 1
                    elif held_exactly(p.dtype, torch.float32 if kind == "master" else dt):
                        self._released.append((i, handles[(kind, i)], tuple(p.shape)))
                        p.data = torch.empty(0, dtype=p.dtype, device=p.device)
                meta.materialize_rest()  # modules with meta buffers only
            if on_cuda:
                torch.cuda.empty_cache()  # released device originals: give their memory to the chunks
            self.setup_fill_parts = fill_parts
            phase_done("fill")  # the parameters' values into chunks (materialising a meta-built model)
            self._finish_init(model, config, mgr, sets, handles, dt)
            phase_done("place")  # the placement applied, parameter views, buffers, hooks
        except BaseException as exc:
            if self._released_sharded:
                exc.add_note(f"gemini_ext: enable() failed after taking {self._released_sharded} of the model's "
                             f"{len(self._params)} parameters into chunks sharded over {self.world_size} ranks; each "
                             "rank held only its shard, so those parameters are now empty tensors. Build the model "
                             "again before retrying.")
            if meta:
                exc.add_note(f"gemini_ext: the model was built on the meta device; enable() had given "
                             f"{meta.materialized_modules} of its modules storage on {self.compute_device} when it "
                             "failed, the others are still on the meta device. Build the model again before retrying.")
            self._restore_released(mgr)
            raise
        self._released = []
        self.setup_seconds = time.perf_counter() - start
        whole, room = self._whole_model_bytes(), self._restore_room_bytes()
        if room is not None and whole > room:
            warnings.warn(
                f"gemini_ext: the whole model ({format_bytes(whole)} in its original dtypes) is larger than this "
                f"rank's device and host memory ({format_bytes(room)}), so leaving the `with` block cannot give it "
                "back as ordinary tensors: close() will leave the parameters empty. Keep the trained values with "
                "engine.save_checkpoint(dir) (sharded; loads at any world size) or engine.state_dict() inside the "
                "block.", stacklevel=3)
        logger.info("enable: %d parameters in %d chunks of %d elements on %s (%s wasted), %.2f s (%s)",
                    len(self._params), mgr.num_chunks, chunk_size, self.device_kind,
                    format_bytes(mgr.wasted_bytes()), self.setup_seconds,
                    ", ".join(f"{k} {v:.2f} s" for k, v in self.setup_phases.items()))
        if logger.isEnabledFor(logging.INFO):  # /proc and the device are read only when it prints
            logger.info("enable: memory after set-up: %s", self._memory_figures())
        _guards.engine_opened(self)  # foreign optimizers and torch's clipping see managed parameters (_guards.py)

    def _restore_released(self, mgr) -> None:
        """enable() failed after releasing the model's tensors: give each its value back from the
        chunk holding it exactly (see the note in __init__)."""
        with torch.no_grad():
            for i, handle, shape in self._released:
                tiers = mgr.chunk_info(handle[0])["shard_tiers"]
                tier = next(t for t in ("device", "pinned_host", "pageable_host") if t in tiers)
                dtype, device = self._orig[i]
                self._params[i].data = mgr.tensor_view(handle, tier).reshape(shape).to(device=device, dtype=dtype,
                                                                                         copy=True)
        self._released = []

    def _finish_init(self, model, config, mgr, sets, handles, dt) -> None:
        pspecs = []
        for i, p in enumerate(self._params):
            chunk, slot = handles[("param", i) if p.requires_grad else ("frozen", i)]
            pspecs.append((chunk, slot, bool(p.requires_grad)))
        self._gm = _C.GeminiManager(mgr, sets, pspecs, config.placement_policy)
        self._set_chunks = [{k: s[k] for k in ("grad", "master", "exp_avg", "exp_avg_sq")} for s in sets]
        if self._replica_comm is not None:
            self._gm.set_replica_communicator(self._replica_comm)
        self._gm.set_device_budget(self.policy.device_budget(self))
        if self.device_kind == "cuda":  # per-iteration non-model peaks start here (see _end_iteration)
            allocator.begin_non_model_window(self.compute_device)
        self._gm.set_async_reduce(config.enable_async_reduce)
        self._gm.set_max_prefetch(config.max_prefetch)
        self._gm.set_overlap_optimizer(config.overlap_optimizer)
        if config.enable_gradient_accumulation:
            self._gm.set_no_sync(True)  # gradients accumulate on the device until the step
        self._slots = [(c, s) for c, s, _ in pspecs]
        views = self._gm.param_views()
        self._gm.apply_placement()
        for tier in ("pinned_host", "pageable_host"):  # groups that left the host give their arena back
            self._mgr.trim(tier)
        existing = []
        for i, (p, view) in enumerate(zip(self._params, views)):
            if p.grad is not None:
                if not p.requires_grad:
                    warnings.warn(f"gemini_ext: frozen parameter {self._names[i]!r} has a .grad; frozen parameters "
                                  "have no gradient chunk, so it is dropped.", stacklevel=4)
                else:
                    existing.append((i, p.grad.detach()))
            p.data = view
            p.grad = None  # gradients live in chunks from now on
        if existing:  # an existing gradient follows its parameter into its chunk
            with torch.no_grad():
                for i, g in existing:
                    p = self._params[i]
                    p.grad = g.to(device=p.device, dtype=p.dtype)
                    self._gm.post_accumulate_grad(i, p)
            self._gm.end_backward()
        self._buffers = BufferPlacement(model, self.compute_device, dt, config.cast_buffers,
                                        self._from_rank0)  # see _buffers.py
        self._hooks = HookSet(self._gm, model, self._params,
                              scale_fn=(lambda: self.scaler.scale) if self.scaler is not None else None,
                              on_backward_start=self._on_backward_start,
                              on_forward_start=self._on_forward_start)
        self._access = ParamAccess(self, model, self._params, self._orig, dt)
        model._gemini_engine = self

    def _build_context(self) -> None:
        config = self.config
        if self.device_kind == "cuda":
            limit = config.gpu_memory_limit or SETTINGS.gpu_limit_bytes or 0
            index = torch.cuda.current_device()
            self._ctx = _C.DeviceContext("cuda", device_index=index, capacity_bytes=limit)
            self.compute_device = torch.device("cuda", index)
        else:
            # gpu_memory_limit is the budget the engine plans for on sim as on cuda: within a sim
            # device of sim_capacity bytes (the config refuses a limit above it).
            capacity = (config.gpu_memory_limit or config.sim_capacity or SETTINGS.gpu_limit_bytes
                        or DEFAULT_SIM_CAPACITY_BYTES)
            self._ctx = _C.DeviceContext("sim", capacity_bytes=capacity,
                                         sim_max_copy_delay_us=SETTINGS.sim_copy_delay_us, sim_seed=1)
            self.compute_device = torch.device("cpu")
        self._replica_comm = None
        self._mgr = _C.ChunkManager(self._ctx, world_size=self.world_size, rank=self.rank,
                                    pin_memory=self.config.pin_memory)
        if self.process_group is not None:
            if self.device_kind == "cuda" and torch.distributed.get_backend(self.process_group) != "nccl":
                warnings.warn("gemini_ext: chunks on cuda with a non-NCCL process group; collectives on device "
                              "memory need a backend that supports CUDA tensors (nccl).", stacklevel=4)
            self._comm = _C.ProcessGroupCommunicator(self.process_group, self._ctx)
            self._mgr.set_communicator(self._comm)
            self._replica_comm = (_C.ProcessGroupCommunicator(self.replica_group, self._ctx)
                                  if self.replica_group is not None else None)

    def _plan_sets(self, mgr, has_master: bool) -> list[dict]:
        """One dict per parameter chunk: its companions and the static policy's placement."""
        config = self.config
        sets = []
        try:
            p_ids = mgr.group_chunk_ids("param")
        except ValueError:
            p_ids = []
        if p_ids:
            ids = {k: mgr.group_chunk_ids(k) for k in ("grad", "exp_avg", "exp_avg_sq")}
            ids["master"] = mgr.group_chunk_ids("master") if has_master else [-1] * len(p_ids)
            for k, v in ids.items():
                if len(v) != len(p_ids):
                    raise _C.InternalError(f"gemini_ext internal error (this is a bug, please report it): group {k} "
                                           f"has {len(v)} chunks, the parameter group {len(p_ids)}")
            sizes = [mgr.chunk_info(c)["shard_numel"] * self.compute_dtype.itemsize for c in p_ids]
            param_frac, optim_frac = self.policy.initial_fractions(self, sizes)
            host_bound = self.policy.min_device_sets > 0  # the plan's device sets are there for the host
            plan = _C.static_placement(sizes, param_frac, optim_frac)
            reshard = self._reshard_plan(sizes)
            for k, c in enumerate(p_ids):
                sets.append({"param": c, "grad": ids["grad"][k], "master": ids["master"][k],
                             "exp_avg": ids["exp_avg"][k], "exp_avg_sq": ids["exp_avg_sq"][k],
                             "param_home_on_host": plan[k][0], "optim_on_host": plan[k][1],
                             "keep_gathered": not reshard[k],
                             # state on the device because the host cannot hold it: nor its gradients
                             "grad_stays_on_device": host_bound and not plan[k][1]})
        try:
            f_ids = mgr.group_chunk_ids("frozen")
        except ValueError:
            f_ids = []
        if f_ids:
            sizes = [mgr.chunk_info(c)["shard_numel"] * self.compute_dtype.itemsize for c in f_ids]
            plan = _C.static_placement(sizes, self.policy.fractions()[0], 0.0)
            reshard = self._reshard_plan(sizes)
            for k, c in enumerate(f_ids):
                sets.append({"param": c, "grad": -1, "master": -1, "exp_avg": -1, "exp_avg_sq": -1,
                             "param_home_on_host": plan[k][0], "optim_on_host": False,
                             "keep_gathered": not reshard[k]})
        return sets

    def _from_rank0(self, value: torch.Tensor) -> torch.Tensor:
        """Several ranks: rank 0's value, as DistributedDataParallel does at construction, so that
        ranks that initialised their models differently still train one model. Itself otherwise."""
        if self._dp_group is None:
            return value
        device = self.compute_device if self.device_kind == "cuda" else torch.device("cpu")
        buf = value.detach().to(device, copy=True).contiguous()
        torch.distributed.broadcast(buf, src=torch.distributed.get_global_rank(self._dp_group, 0),
                                    group=self._dp_group)
        return buf

    def _reshard_plan(self, sizes: list[int]) -> list[bool]:
        """shard_param_frac (sharded only): which parameter chunks are re-sharded after each use,
        in exact bytes from the front of the execution order: the chunks used first in forward
        are needed last in backward, so keeping them gathered would hold their memory longest.
        The others stay gathered from forward until their gradients are reduced."""
        if self.process_group is None:
            return [True] * len(sizes)
        return [home for home, _ in _C.static_placement(sizes, self.config.shard_param_frac, 0.0)]

    # --- parameters --------------------------------------------------------------------------
    @property
    def num_parameters(self) -> int:
        return len(self._params)

    def parameters(self):
        """The managed parameters (each shared parameter once), in chunk order."""
        return list(self._params)

    def find_parameter(self, param) -> int | None:
        """The index of `param` among the managed parameters, or None if this engine does not manage it."""
        idx = self._index.get(id(param))
        return idx if idx is not None and self._params[idx] is param else None

    def parameter_index(self, param) -> int:
        idx = self.find_parameter(param)
        if idx is None:
            raise ValueError("gemini_ext: the tensor is not a parameter managed by this engine (pass parameters of "
                             "the model given to gx.enable).")
        return idx

    def parameter_slot(self, param) -> tuple[int, int]:
        """(chunk id, slot index) of `param`'s 16-bit (compute dtype) copy."""
        return self._slots[self.parameter_index(param)]

    def parameter_name(self, index: int) -> str:
        return self._names[index]

    def parameter_numel(self, index: int) -> int:
        return self._params[index].numel()

    # --- public API ----------------------------------------------------------------------------
    def optimizer(self, cls, params=None, **kwargs) -> GeminiOptimizer:
        """A GeminiOptimizer (Adam or AdamW semantics) over the fp32 master chunks."""
        self._check_open("optimizer")
        return GeminiOptimizer(self, cls, params, **kwargs)

    def _register_optimizer(self, opt: GeminiOptimizer) -> None:
        if self._optimizer is not None:
            raise RuntimeError("engine.optimizer(): this engine already has an optimizer; the optimizer state lives "
                               "in the engine's chunks, so there can be only one. Reuse the first one.")
        self._optimizer = opt

    def _on_forward_start(self) -> None:
        self._access.absorb_writes()

    def _on_backward_start(self) -> None:
        if self._optimizer is not None:
            self._optimizer._arm_for_backward()

    def backward(self, loss: torch.Tensor) -> None:
        """Same as loss.backward() (the fp16 loss scale is applied by the engine's hooks)."""
        self._check_open("backward")
        loss.backward()

    @contextlib.contextmanager
    def no_sync(self):
        """Gradient accumulation: backward passes inside keep their gradients on the device and do
        not send them to the optimizer's tier; the first backward outside (or the step) does."""
        self._check_open("no_sync")
        previous = self._gm.no_sync
        self._gm.set_no_sync(True)
        try:
            yield
        finally:
            self._gm.set_no_sync(previous)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False,
                        foreach=None) -> torch.Tensor:
        """torch.nn.utils.clip_grad_norm_ over every gradient of the model: returns the total norm
        (before clipping) and clips exactly as torch does, folded into the next step's gradient
        factor (see _clipping.py). Call it after the last backward, before optimizer.step().
        `foreach` is accepted for torch's signature and changes nothing."""
        self._check_open("clip_grad_norm_")
        return self._clipper.clip(max_norm, norm_type, error_if_nonfinite)

    def gathered(self, params=None, writable: bool = False):
        """`with engine.gathered(params=None, writable=False):` the listed parameters (default all)
        whole and current on the compute device, their chunks held there until the block ends;
        with writable=True, in-place edits made inside reach the fp32 masters on exit. Collective
        when sharded: every rank enters with the same list (see _param_access.py)."""
        self._check_open("gathered")
        return self._access.gathered(params, writable)

    def grad(self, param) -> torch.Tensor | None:
        """The accumulated gradient of `param` (fp32, CPU) as it is in its chunk, or None."""
        self._check_open("grad")
        idx = self.parameter_index(param)
        if not param.requires_grad or not self._gm.has_grad(idx):
            return None
        return self._gm.read_grad(idx)

    def _end_iteration(self) -> None:
        """Called by the optimizer step: closes the access trace, logs the iteration's scheduling
        figures and lets the policy act on what it measured."""
        self._gm.end_iteration()
        totals = self._totals()
        last = self._last_totals or {k: 0 for k in totals}
        entry = {k: totals[k] - last[k] for k in totals}
        entry["prefetch_misses"] = entry["sync_fetches"]  # a chunk compute needed that was not fetched ahead
        entry["device_bytes_peak"] = self._iteration_device_peak()  # model data: chunk bytes on the device
        entry["host_bytes"] = sum(self._mgr.tier_bytes(t)["current"] for t in ("pinned_host", "pageable_host"))
        if self.device_kind == "cuda":
            # non-model data: torch's allocator (activations, temporaries) over this iteration,
            # measured in a window of our own (torch's peak statistics stay the user's)
            entry["non_model_peak_bytes"] = allocator.non_model_peak_bytes(self.compute_device)
            allocator.begin_non_model_window(self.compute_device)
        else:
            entry["non_model_peak_bytes"] = 0  # on sim, activations live in host memory
        self._steps_log.append(entry)
        if len(self._steps_log) > 10_000:  # a bounded history: the last 10,000 iterations
            del self._steps_log[:-10_000]
        self._last_totals = totals
        self.policy.after_iteration(self)

    def _totals(self) -> dict:
        self._mgr.poll()  # collects the copy waits measured so far
        t, c = self._mgr.traffic(), self._gm.counters()
        return {"h2d_bytes": t["h2d_bytes"], "d2h_bytes": t["d2h_bytes"], "evictions": c["evictions"],
                "prefetches": t["prefetches"], "prefetch_hits": t["prefetch_hits"],
                "prefetch_wasted": t["prefetch_wasted"], "sync_fetches": c["sync_fetch_waits"],
                "wait_seconds": c["wait_seconds"], "copy_wait_seconds": t["copy_wait_seconds"],
                "copy_waits": t["copy_waits"]}

    def _iteration_device_peak(self) -> int:
        events = self._gm.timeline()
        peak = 0
        for t, kind, chunk, device_bytes in reversed(events[:-1]):  # back to the previous iteration end
            if kind == "S":
                break
            peak = max(peak, device_bytes)
        return peak

    def memory_timeline(self) -> dict:
        """Scheduling events (fetch 'F', prefetch 'P', evict 'E', iteration end 'S') with the chunk
        bytes on the device after each, and the per-iteration figures of stats()["steps"]."""
        self._check_open("memory_timeline")
        events = [{"t": t, "kind": kind, "chunk": chunk, "device_bytes": b} for t, kind, chunk, b in self._gm.timeline()]
        return {"events": events, "steps": list(self._steps_log), "device_budget_bytes": self._gm.device_budget}

    def _check_no_stray_grads(self) -> None:
        for name, p in zip(self._names, self._params):
            if p.grad is not None:
                raise RuntimeError(f"gemini_ext: parameter {name!r} has a .grad that did not go into its chunk (was "
                                   "requires_grad changed after gx.enable, or .grad assigned by hand?). Set "
                                   "requires_grad before gx.enable; gradients must come from backward.")

    def stats(self) -> dict:
        """Chunk layout, bytes per tier, traffic and counters so far; after close(), as of the close."""
        if self._closed:
            return self._stats_at_close
        mgr, gm = self._mgr, self._gm
        tiers = {t: mgr.tier_bytes(t) for t in ("device", "pinned_host", "pageable_host")}
        placements = gm.set_placements()
        out = {
            "device": self.device_kind,
            "precision": self.config.precision,
            "num_chunks": mgr.num_chunks,
            "num_param_chunks": len(placements),
            "chunk_size": self.chunk_size,
            "wasted_bytes": self._param_wasted_bytes(),  # padding of the parameter chunks
            "wasted_bytes_all_groups": mgr.wasted_bytes(),
            "tier_bytes": tiers,
            "peak_device_bytes": tiers["device"]["peak"],
            "host_bytes": tiers["pinned_host"]["current"] + tiers["pageable_host"]["current"],
            "traffic": mgr.traffic(),
            "counters": gm.counters(),
            # the chunk pools: a reserved arena per tier, slots reused after their last uses
            "pools": {t: mgr.pool_stats(t) for t in tiers},
            "optimizer_steps": self._optimizer_steps,
            "skipped_steps": self._skipped_steps,
            "loss_scale": self.scaler.scale if self.scaler is not None else None,
            "steps": list(self._steps_log[-100:]),
            "setup_seconds": {"total": self.setup_seconds, **self.setup_phases},
            "setup_fill_seconds": dict(self.setup_fill_parts),  # the fill phase in parts
            "device_budget_bytes": gm.device_budget,
            "trace": {k: v for k, v in gm.trace_info().items() if k != "recorded"},
            "distributed": {"zero_world_size": self.world_size, "zero_rank": self.rank,
                            "replicas": self.config.extra_dp_size if self.process_group is not None else 1,
                            "replica_index": self.replica_index,
                            "backend": torch.distributed.get_backend(self.process_group)
                            if self.process_group is not None else None},
            "placement": {
                "policy": self.policy.name,
                "decision": dict(self.policy.decision),
                "param_chunks_home_host": sum(p["param_home_on_host"] for p in placements),
                "optim_chunks_on_host": sum(p["trainable"] and p["optim_on_host"] for p in placements),
                "optim_chunks_on_device": sum(p["trainable"] and not p["optim_on_host"] for p in placements),
            },
        }
        if self._optimizer is not None:
            out["last_step"] = self._optimizer.last_step_stats()
        return out

    def _param_wasted_bytes(self) -> int:
        total = 0
        for group in ("param", "frozen"):
            try:
                ids = self._mgr.group_chunk_ids(group)
            except ValueError:
                continue
            for c in ids:
                info = self._mgr.chunk_info(c)
                total += (info["padded_numel"] - info["payload_numel"]) * self.compute_dtype.itemsize
        return total

    def synchronize(self) -> None:
        """Waits for every CPU optimizer step still running (overlap_optimizer) and for the device.
        Afterwards a parameter read outside the hooks holds the last step's values wherever its
        chunk is on the device (the next forward, state_dict() and checkpoints do this themselves)."""
        self._check_open("synchronize")
        self._gm.synchronize()

    def state_dict(self) -> dict:
        """The full model state: fp32 tensors on the CPU under the model's own keys (trainable
        parameters from their fp32 masters)."""
        self._check_open("state_dict")
        self._access.absorb_writes()
        out = {}
        for key, value in self.model.state_dict(keep_vars=True).items():
            idx = self._index.get(id(value))
            if idx is not None and self._params[idx] is value:
                out[key] = self._gm.read("param", idx)
            else:
                v = value.detach()
                out[key] = (v.float() if v.is_floating_point() else v).cpu().clone()
        self._gm.release_read_cache()  # the last chunk gathered for the reads (sharded)
        return out

    def load_state_dict(self, state_dict: dict, strict: bool = True):
        """Loads a full (plain) state dict into the chunks: masters, their 16-bit copies, buffers."""
        self._check_open("load_state_dict")
        self._access.absorb_writes()
        own = self.model.state_dict(keep_vars=True)
        missing = [k for k in own if k not in state_dict]
        unexpected = [k for k in state_dict if k not in own]
        if strict and (missing or unexpected):
            raise RuntimeError(f"engine.load_state_dict: missing keys {missing[:5]}{'...' if len(missing) > 5 else ''},"
                               f" unexpected keys {unexpected[:5]}{'...' if len(unexpected) > 5 else ''}; pass "
                               "strict=False to load the matching subset.")
        with torch.no_grad():
            for key, target in own.items():
                if key not in state_dict:
                    continue
                value = state_dict[key]
                if tuple(value.shape) != tuple(target.shape):
                    raise ValueError(f"engine.load_state_dict: {key!r} has shape {tuple(value.shape)}, the model "
                                     f"expects {tuple(target.shape)}.")
                idx = self._index.get(id(target))
                if idx is not None and self._params[idx] is target:
                    self._gm.write("param", idx, value.detach().float().cpu())
                else:
                    target.copy_(value)
        self._gm.synchronize()
        self._gm.note_param_versions()
        return torch.nn.modules.module._IncompatibleKeys(missing, unexpected)

    def save_checkpoint(self, path: str) -> None:
        """Model masters, optimizer, loss scaler, step counts and RNG states (see checkpoint.py)."""
        self._check_open("save_checkpoint")
        self._access.absorb_writes()
        checkpoint.save(self, path)

    def load_checkpoint(self, path: str) -> None:
        self._check_open("load_checkpoint")
        self._access.absorb_writes()
        checkpoint.load(self, path)
        self._gm.note_param_versions()

    def chunk_info(self, chunk_id: int) -> dict:
        return self._mgr.chunk_info(chunk_id)

    def close(self) -> None:
        """Restores ordinary parameters holding the current values and frees the chunks (idempotent)."""
        if self._closed:
            return
        self._access.absorb_writes()  # in-place writes since the last step reach the masters first
        self._gm.stop_reclaiming()  # memory pressure no longer reaches this engine's chunks
        self._gm.synchronize()
        self._stats_at_close = self.stats()
        with torch.no_grad():
            # [Note: closing a model that fills memory]
            # A model that needed chunks split over host and device has no room for its restored
            # tensors beside all of its chunks (13B: 52 GB of fp32 parameters going back to the
            # GPU while the optimizer state of 38 of 62 chunk sets fills it). The optimizer is
            # detached at close, so its moments, the gradients and the speculative
            # spares are dropped first and their memory (whole arena extents: one per chunk
            # group and tier) goes back to the system before any tensor is restored. Parameters
            # then come back a chunk set at a time, the sets whose master is on the device first,
            # each set's master dropped right after, so memory is given back as it is taken.
            placements = self._gm.set_placements()
            set_of_chunk = {p["param_chunk"]: s for s, p in enumerate(placements)}
            params_of_set = {}
            for i, (chunk, _) in enumerate(self._slots):
                params_of_set.setdefault(set_of_chunk[chunk], []).append(i)
            # Sharded, every rank does the same drops in the same order (reads below are
            # all-gathers); a model sharded because it did not fit one GPU needs the room most.
            if self._optimizer is not None:
                self._optimizer._hybrid.release_spares()
            for chunks in self._set_chunks:
                self._drop_set_state(chunks, ("grad", "exp_avg", "exp_avg_sq"))
            self._trim_chunk_memory()
            # A model sharded because no device holds it may not fit this rank's device and host
            # even once the chunks are freed (80B in fp32 is 324 GB, on every rank). The reads
            # below are collective, so every rank skips them if any rank lacks the room. The
            # remaining chunks count as room (masters go set by set as parameters come back):
            # only a model that cannot fit at all is refused.
            whole, room = self._whole_model_bytes(), self._restore_room_bytes()
            if not self._all_ranks_agree(room is None or whole <= room):
                self._close_without_values(whole, room)
                return
            # Values go straight from their chunk to their device (read_to: no round trip through
            # pageable host memory). What does not fit on the device (arena extents that other
            # groups' chunks keep partly in use) waits on the host until every chunk is freed
            # below. Sharded, each read all-gathers its chunk on the device: a parameter goes to
            # the device only while the device's free memory leaves room for the next gather
            # after it, or that collective fails on a full device (30B over 2 GPUs did, at
            # 876 MiB). Blocks torch caches unused do not count: they may lie between live
            # tensors (there, 8.7 GiB cached, in pieces too small for the gather).
            staged = []
            reserve = self._close_gather_reserve_bytes(placements)
            cpu = torch.device("cpu")
            for s in sorted(params_of_set, key=lambda s: placements[s]["optim_on_host"]):
                for i in params_of_set[s]:
                    dtype, device = self._orig[i]
                    value = None
                    if device.type != "cuda" or torch.cuda.mem_get_info(device)[0] >= (
                            self._numels[i] * (dtype.itemsize + 4) + reserve):
                        try:
                            value = self._gm.read_to("param", i, device, dtype)
                        except torch.OutOfMemoryError:  # after the gather (cached): reading again is local
                            pass
                    if value is None:
                        value = self._gm.read_to("param", i, cpu, dtype)
                        staged.append(i)
                    self._params[i].data = value
                    self._params[i].grad = None
                self._drop_set_state(self._set_chunks[s], ("master",))
            self._gm.release_read_cache()
        self._release_engine()
        self._close_staged_params = len(staged)  # for tests and logs
        self._close_params_left_on_host = 0
        if staged:
            logger.info("close: %d parameters waited on the host for device memory held by chunks", len(staged))
            self._move_staged_params(staged)

    def _close_gather_reserve_bytes(self, placements: list[dict]) -> int:
        """Device bytes a sharded read at close may take: the largest chunk read, gathered whole,
        beside its shard copied to the device (0 unsharded: reads copy their slot only)."""
        if not self._mgr.sharded:
            return 0
        reserve = 0
        for chunks, placement in zip(self._set_chunks, placements):
            read = chunks["master"] if chunks["master"] >= 0 else placement["param_chunk"]
            info = self._mgr.chunk_info(read)
            item = 4 if read == chunks["master"] else self.compute_dtype.itemsize
            reserve = max(reserve, (info["padded_numel"] + info["shard_numel"]) * item)
        return reserve + (64 << 20)  # and the collective's own workspace

    def _whole_model_bytes(self) -> int:
        return sum(p_numel * dtype.itemsize for p_numel, (dtype, _) in zip(self._numels, self._orig))

    def _restore_room_bytes(self) -> int | None:
        """Memory this rank can give the whole model at close: host MemAvailable over the ranks of
        this node and what the host chunks hold, plus, on cuda, the device's free memory and what
        the chunks hold there (all freed as the parameters come back, or after). None where host
        memory cannot be read."""
        host = host_available_bytes()
        if host is None:
            return None
        room = host + sum(self._mgr.tier_bytes(t)["current"] for t in ("pinned_host", "pageable_host"))
        if self.device_kind == "cuda":
            room += torch.cuda.mem_get_info(self.compute_device)[0] + self._mgr.tier_bytes("device")["current"]
        return room

    def _all_ranks_agree(self, ok: bool) -> bool:
        """True when `ok` holds on every rank of the data-parallel group (itself unsharded)."""
        if self._dp_group is None:
            return ok
        device = self.compute_device if self.device_kind == "cuda" else torch.device("cpu")
        flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=device)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN, group=self._dp_group)
        return bool(flag.item())

    def _close_without_values(self, whole: int, room: int | None) -> None:
        """close() for a model no rank has room for: the chunks are freed and each parameter is
        left an empty tensor of its original dtype and device (see the warning at enable)."""
        with torch.no_grad():
            for i, p in enumerate(self._params):
                dtype, device = self._orig[i]
                p.data = torch.empty(0, dtype=dtype, device=device)
                p.grad = None
        here = f"{format_bytes(room)} here" if room is not None else "unknown here"
        warnings.warn(
            f"gemini_ext close(): the whole model ({format_bytes(whole)}) does not fit the device and host memory of "
            f"every rank once its chunks are freed ({here}); the {len(self._params)} parameters are left empty and "
            "their trained values were not kept by close(). Save them inside the `with` block with "
            "engine.save_checkpoint(dir) (sharded; loads at any world size), then load that checkpoint into a "
            "model built on the meta device.", stacklevel=3)
        self._close_params_left_on_host = 0
        self._close_staged_params = 0
        self._release_engine()

    def _release_engine(self) -> None:
        """The end of close(): buffers back to their dtype and device, hooks off, and the chunks
        freed with the engine's last references to the manager."""
        self._buffers.restore()
        self._hooks.remove()
        self._access.remove()
        self._hooks.gm = None  # the manager (and every chunk) goes with the engine's references below
        self._closed = True
        _guards.engine_closed(self)
        self.model._gemini_engine = None
        for opt in ([self._optimizer] if self._optimizer is not None else []):
            opt._hybrid = None
        del self._gm  # unbinds the parameter storages; then the pools go
        del self._mgr
        del self._ctx

    def _move_staged_params(self, staged: list[int]) -> None:
        """The last step of close(): parameters that waited on the host go to their device now
        that the chunks are freed. A model sharded because one GPU cannot hold it cannot come
        back whole onto one GPU: what does not fit stays on the host, holding its values, and a
        warning says so (nothing is lost; raising here would leave the model half-moved)."""
        left = []
        with torch.no_grad():
            for i in staged:
                try:
                    self._params[i].data = self._params[i].data.to(self._orig[i][1])
                except torch.OutOfMemoryError:
                    left.append(i)
        self._close_params_left_on_host = len(left)
        if left:
            nbytes = sum(self._params[i].numel() * self._params[i].element_size() for i in left)
            device = self._orig[left[0]][1]
            warnings.warn(
                f"gemini_ext close(): {len(left)} of {len(self._params)} parameters ({format_bytes(nbytes)}) stay on "
                f"the host: {device} has no room for the whole model once its chunks are freed (sharded over "
                f"{self.world_size} rank(s), the model did not have to fit one device). They hold the trained values; "
                "to keep a model this size, call engine.save_checkpoint() or engine.state_dict() inside the `with` "
                "block, or move the parameters yourself where they fit.", stacklevel=3)

    def _drop_set_state(self, chunks: dict, kinds: tuple[str, ...]) -> None:
        """Frees every copy of the given kinds of a chunk set's gradient and optimizer-state
        chunks (at close)."""
        for kind in kinds:
            cid = chunks[kind]
            if cid < 0:
                continue
            self._mgr.wait(cid)  # a move in flight (a gradient offload) finishes first
            tiers = self._mgr.chunk_info(cid)["shard_tiers"]
            for tier in ("device", "pinned_host", "pageable_host"):
                if tier in tiers:
                    self._mgr.discard_copy(cid, tier)

    def _trim_chunk_memory(self) -> None:
        """Gives the chunk pools' free slots and wholly free arena extents back to the system."""
        self._gm.synchronize()  # the freed slots' last uses are complete
        for tier in ("device", "pinned_host", "pageable_host"):
            self._mgr.trim(tier)

    def __enter__(self) -> "GeminiEngine":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if isinstance(exc, torch.OutOfMemoryError) and self.device_kind == "cuda" and allocator.mode() == "default":
            exc.add_note(f"gemini_ext: torch's allocator ran out of device memory with "
                         f"{format_bytes(self._mgr.tier_bytes('device')['current'])} of chunks on the device "
                         f"(placement_policy={self.config.placement_policy!r}). Under GEMINI_EXT_ALLOCATOR=default chunks "
                         "are not evicted for torch's allocations: set GEMINI_EXT_ALLOCATOR=chunk (before importing "
                         "gemini_ext) so that chunks go to the host on demand, or lower gpu_memory_limit / "
                         "const_gpu_budget, the batch size, or use activation checkpointing.")
        if isinstance(exc, (torch.OutOfMemoryError, _C.OutOfMemoryError)):
            exc.add_note(f"gemini_ext: memory when it ran out: {self._memory_figures()}.")
        self.close()

    def _memory_figures(self) -> str:
        """Where memory stands: chunks against everything else, on the device and on the host (an
        out-of-memory error leaving the `with` block carries it, so that a plan that missed
        something shows it)."""
        host = self._mgr.host_tier
        pool = self._mgr.pool_stats(host)
        rss, available = process_rss_bytes(), mem_available_bytes()
        parts = [f"chunks on the device {format_bytes(self._mgr.tier_bytes('device')['current'])}",
                 f"chunks on the host ({host}) {format_bytes(pool['in_use_bytes']['current'])} in use, "
                 f"{format_bytes(pool['reserved_bytes']['current'])} reserved by the pool"]
        if rss is not None:
            parts.append(f"this process's resident memory {format_bytes(rss)}")
        if available is not None:
            parts.append(f"the host's MemAvailable {format_bytes(available)}")
        if self.device_kind == "cuda":
            free, total = torch.cuda.mem_get_info(self.compute_device)
            parts.append(f"the device's free memory {format_bytes(free)} of {format_bytes(total)}, "
                         f"{format_bytes(allocator.torch_allocated_bytes(self.compute_device))} allocated by torch")
        return "; ".join(parts)

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise RuntimeError(f"engine.{what}(): the engine is closed (its `with` block has ended); call "
                               "gx.enable(model, config) again.")


def enable(model: torch.nn.Module, config: GeminiConfig | None = None, *, process_group=None, param_init_fn=None,
           **overrides) -> GeminiEngine:
    """Places `model`'s parameters in chunks; use as `with gx.enable(model, cfg) as engine:`.

    A model built under `torch.device("meta")` gets storage on the compute device one module
    group at a time as its values go into chunks (see gemini_ext/_materialize.py):
    `param_init_fn(module)` initialises each module that owns meta tensors (default: the module's
    reset_parameters())."""
    if config is not None and not isinstance(config, GeminiConfig):
        raise TypeError(f"enable(config=...): expected a GeminiConfig, got {type(config).__name__}.")
    config = config or GeminiConfig()
    if overrides:
        config = config.replace(**overrides)
    return GeminiEngine(model, config, process_group, param_init_fn)
