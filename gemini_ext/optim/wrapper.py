"""GeminiOptimizer: a torch optimizer over the engine's fp32 master chunks (HybridOptimizer in C++).

The optimizer family's math (hyperparameters, state kinds, kernels) is a rule (rules.py); what
follows is common to every rule.

[Note: what a step does]
1. Gradients still on the device (accumulated under no_sync) go to their optimizer's tier.
2. When clipping (`max_norm` > 0) or fp16 loss scaling needs it, the global gradient norm is
   computed over the gradient chunks: one host synchronisation per step, none per chunk.
3. fp16: a non-finite norm means overflow: the step is skipped (parameters, moments and step
   counts untouched) and the loss scaler backs off.
4. One factor, 1/loss_scale times the clipping coefficient max_norm / (norm + 1e-6) when that
   is below 1 (torch.nn.utils.clip_grad_norm_'s rule), is folded into every gradient read.
5. HybridOptimizer steps every chunk where its state lives with the rule's kernels (Adam: our
   fused CPU Adam on the host, our device Adam kernel, which computes the same bits, on the
   device); the 16-bit parameters are rewritten from the masters. With
   `overlap_optimizer` (the default) host chunks are stepped on a background thread and step()
   returns; the next forward waits per chunk.
6. Speculation: when a backward pass begins, `backward_started` hands C++ the hyperparameters
   of that moment, so that each host chunk's step can start as soon as its gradients reach the
   host, guessing a multiplier of exactly 1 (no fp16 loss scaler). Where the rule corrects its
   own step (Adam / AdamW with fp32 state) the step is taken in place and step() confirms it,
   corrects it when clipping scaled the gradients, or undoes and redoes it (the Note in
   csrc/torch/optim/hybrid_optimizer_in_place.cpp); C++'s policy decides per backward
   (csrc/core/early_step.h: not after a clipped step, only on the backward expected to be
   the last of an accumulation). Other rules step out of place into spare buffers, which step()
   confirms or drops (hybrid_optimizer_speculation.cpp), armed only where clipping is off or the
   last norm was within max_norm, for the host sets whose spares fit in half of the host budget
   (placement/host_memory.py): those whose gradients arrive first, where there is room for some.
7. The step in backward (GeminiConfig.optimizer_step_in_backward): armed at every backward with
   the hyperparameters of that moment, each host chunk's step runs in place once its gradients
   reach the host, and step() steps the others. Nothing can undo it, so what would make it differ
   from step()'s is refused: the config refuses clipping and fp16, engine.clip_grad_norm_ raises
   where it would scale, a second backward or zero_grad() before step() raises, and step() with
   other hyperparameters than the backward's completes the step with the backward's and raises.
`param_groups` hold the same Parameter objects the model uses, so LR schedulers edit `lr` as
usual; hyperparameters are read from the groups at every step. Gradients live in chunks, not on
`p.grad` (which stays None), and `zero_grad()` clears them.
"""

from __future__ import annotations

import math
import time

import torch

from .._engine import registry
from .._engine.sharded_state import options_are_sharded
from ..placement.host_memory import host_available_bytes
from .generic import GenericStepper
from .lion import Lion  # noqa: F401  (gx.optim.Lion)
from .rules import ADAM, MAX_STATE_KINDS, rule_for

_TORCH_ADD_PARAM_GROUP = getattr(torch.optim.Optimizer.add_param_group, "__wrapped__",
                                 torch.optim.Optimizer.add_param_group)

def _as_param_list(params) -> list:
    """torch.optim's `params` argument taken once: a generator (model.parameters()) is read here,
    before anything else iterates it, and a lone tensor is refused as torch refuses it."""
    if isinstance(params, torch.Tensor):
        raise TypeError("gemini_ext optimizer: params must be an iterable of tensors or of dicts (parameter groups), "
                        f"got a single {type(params).__name__}; pass [tensor] or model.parameters().")
    try:
        return list(params)
    except TypeError:
        raise TypeError("gemini_ext optimizer: params must be an iterable of tensors or of dicts (parameter groups), "
                        f"got {type(params).__name__}; pass model.parameters() or a list of groups.") from None


def _as_groups(params) -> list[dict]:
    """torch.optim's `params` argument (tensors, or dicts of options with "params") as group dicts."""
    params = list(params)
    if not params:
        raise ValueError("gemini_ext optimizer: got an empty parameter list.")
    if not isinstance(params[0], dict):
        params = [{"params": params}]
    out = []
    for g in params:
        entry = dict(g)
        entry["params"] = [entry["params"]] if isinstance(entry["params"], torch.Tensor) else list(entry["params"])
        out.append(entry)
    return out


class GeminiOptimizer(torch.optim.Optimizer):
    """Built by `engine.optimizer(cls, **kw)`, or as `GeminiOptimizer(torch_optimizer, model)`."""

    _early_form = _last_form = None  # how host steps started during backward: "in_place", "spares", "in_backward"

    def __init__(self, optimizer_or_engine, model_or_cls=None, params=None, **kwargs):
        shared_groups = None
        self._wrapped = None
        if isinstance(optimizer_or_engine, torch.optim.Optimizer):
            # Seed-compatible form: GeminiOptimizer(torch.optim.AdamW(model.parameters(), ...), model)
            torch_opt = optimizer_or_engine
            engine = registry.engine_of(model_or_cls)
            if engine is None:
                raise ValueError("GeminiOptimizer(optimizer, model): `model` must be a module managed by gemini_ext "
                                 "(wrap it with gx.GeminiDDP(model) or gx.enable(model) first).")
            opt_cls = type(torch_opt)
            params = [dict(g) for g in torch_opt.param_groups]
            kwargs = {}
            shared_groups = torch_opt.param_groups
            self._wrapped = torch_opt
        elif registry.is_open_engine(optimizer_or_engine):
            engine, opt_cls = optimizer_or_engine, model_or_cls
        else:
            raise TypeError("GeminiOptimizer: expected (engine, optimizer class) or (torch optimizer, model), got "
                            f"{type(optimizer_or_engine).__name__}.")
        if isinstance(opt_cls, type) and issubclass(opt_cls, GeminiOptimizer):
            raise TypeError("gemini_ext optimizer: GeminiOptimizer wraps an optimizer class; pass the class itself, "
                            "e.g. engine.optimizer(torch.optim.AdamW, lr=3e-4).")
        parts = registry.parts_of(engine)  # the engine's parts (_engine/contract.py): this optimizer uses nothing else
        rule = rule_for(opt_cls)
        state_dtype = parts.config.optimizer_state_dtype
        if state_dtype != "fp32" and rule is not ADAM:
            raise ValueError(f"gemini_ext optimizer: optimizer_state_dtype={state_dtype!r} keeps Adam's moments in "
                             f"{state_dtype}; {getattr(opt_cls, '__name__', opt_cls)} has no such kernel. Use "
                             "torch.optim.Adam or AdamW, or optimizer_state_dtype='fp32'.")
        if parts.config.optimizer_step_in_backward and not rule.native:
            raise ValueError(f"gemini_ext optimizer: optimizer_step_in_backward=True runs the engine's own kernels in "
                             f"backward; {getattr(opt_cls, '__name__', opt_cls)} has none (Adam, AdamW, SGD, Adagrad "
                             "and gx.optim.Lion do). Use one of those, or optimizer_step_in_backward=False.")
        params = [p for p in parts.layout.params if p.requires_grad] if params is None else _as_param_list(params)
        self.engine, self._parts = engine, parts  # the engine (public attribute) and the parts this uses
        self.opt_class = opt_cls
        self.rule = rule
        self._generic = None
        if rule.native:
            defaults = self._native_defaults(rule, opt_cls, params, kwargs)
        else:
            groups = _as_groups(params)
            if self._wrapped is not None:
                kwargs = dict(self._wrapped.defaults)
            self._generic = GenericStepper(parts, opt_cls, groups, kwargs)
            params, defaults = groups, dict(self._generic.defaults)
        super().__init__(params, defaults)
        if shared_groups is not None:
            # The wrapped optimizer's group dicts themselves: an LR scheduler built on it edits ours.
            self.param_groups = shared_groups
        for i, g in enumerate(self.param_groups):
            if rule.native:
                rule.check_group(g, f"param_groups[{i}]")
                if shared_groups is None:
                    for flag in rule.refused_flags + rule.ignored_flags:
                        g.pop(flag, None)
        group_of = [-1] * len(parts.layout.params)
        for gi, g in enumerate(self.param_groups):
            for p in g["params"]:
                idx = parts.layout.index(p)
                if p.requires_grad:  # a frozen one stays in its group and is never stepped, as in torch.optim
                    group_of[idx] = gi
        kinds = rule.kinds_for(self.param_groups)
        if rule.native:  # the state chunks get memory below: the host must hold them (placement/host_fit.py)
            parts.placer.check_host_holds_optimizer_state(parts.runtime, len(kinds))
        parts.attach_optimizer(self)  # raises if the engine has one already
        try:
            parts.runtime.attach_optimizer(rule.name, list(kinds), group_of, parts.layout.state_chunks_for(kinds),
                                            self._generic.step_set if self._generic is not None else None)
        except BaseException:
            parts.detach_optimizer(self)
            raise
        # Placement plans for the kinds that now exist; a generic optimizer's state is torch's and
        # does not move, so the placement stays as it is.
        parts.layout.bind_states(kinds, len(kinds) if rule.native else MAX_STATE_KINDS)
        if not rule.native:
            parts.placer.freeze()
        self.last_grad_norm = None
        self._in_backward_hyper = None  # the hyperparameters armed for the step in backward

    @staticmethod
    def _native_defaults(rule, opt_cls, params, kwargs) -> dict:
        for flag in rule.refused_flags:
            if kwargs.get(flag, False) or any(g.get(flag, False) for g in (params or []) if isinstance(g, dict)):
                raise ValueError(f"gemini_ext optimizer: {flag}=True is not supported (the engine's step has no such "
                                 f"mode); pass {flag}=False or leave it out.")
        defaults = rule.defaults(opt_cls)
        for key, value in kwargs.items():
            if key in defaults:
                defaults[key] = value
            elif key not in rule.ignored_flags + rule.refused_flags:
                accepted = ", ".join(k for k in defaults if k != "decoupled_weight_decay")
                raise TypeError(f"gemini_ext optimizer: unexpected argument {key!r} for {opt_cls.__name__}; "
                                f"accepted: {accepted}.")
        rule.check_group(defaults, "defaults")
        return defaults

    def _hyper(self) -> list[dict]:
        if self._generic is not None:
            return [{} for _ in self.param_groups]  # the optimizer reads its own groups
        return [self.rule.kernel_hyper(g, self.opt_class) for g in self.param_groups]

    @torch.no_grad()
    def step(self, closure=None):
        # see [Note: what a step does]
        # see [Note: the manager calls of a step]
        # see [Note: the overlapped CPU step] (csrc/torch/optim/hybrid_optimizer.cpp]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        began = time.perf_counter()
        # [Note: the manager calls of a step] At most four: the parameters written outside the
        # hooks (absorb_writes), the iteration end (one report for the tracer, the placer and the
        # clipping check), the global norm when clipping or fp16 needs it, and the step itself
        # (which flushes gradients still on the device first and guards the parameters of CPU
        # steps still running). The placer calls the manager again only when it re-places.
        parts = self._parts
        parts.check_open("optimizer.step")
        parts.phases.check_resident("optimizer.step()")
        parts.generation.check_outside("optimizer.step()")
        parts.check_no_stray_grads()
        if parts.loss_scale is not None:
            parts.loss_scale.check_step()  # a backward left unscaled gradients (fp16)
        parts.access.absorb_writes()  # in-place writes to parameters reach the masters before the step
        report = parts.end_iteration()  # the access trace of forward + backward is complete
        multiplier = self._grad_multiplier(report["counters"]["backward_passes"])
        if multiplier is None:  # fp16 overflow: the step is skipped (the loss scaler counts it)
            return loss
        if self._generic is not None:
            self._generic.sync_hyperparameters(self.param_groups)
        hyper, changed = self._hyper(), None
        if self._in_backward_hyper is not None:  # steps ran during backward with these: the rest must match
            if hyper != self._in_backward_hyper:
                changed, hyper = hyper, self._in_backward_hyper
            self._in_backward_hyper = None
        parts.runtime.optimizer_step(hyper, multiplier)
        self._last_form, self._early_form = self._early_form, None
        if changed is not None:
            raise RuntimeError(
                "optimizer.step(): the hyperparameters changed after backward began (now "
                f"{changed}, at backward's start {hyper}). Under GeminiConfig(optimizer_step_in_backward=True) the "
                "host-held state was stepped during backward with the earlier values, so this step used them for "
                "every parameter. Change learning rates and other hyperparameters after optimizer.step() (an LR "
                "scheduler's step() there), or set optimizer_step_in_backward=False.")
        parts.counters.optimizer_steps += 1
        parts.counters.step_call_seconds = time.perf_counter() - began
        if self._wrapped is not None:
            self._wrapped._opt_called = True  # what an LR scheduler built on the wrapped optimizer checks
        return loss

    def _grad_multiplier(self, backward_passes: int) -> float | None:
        """The one factor folded into every gradient read: 1/loss_scale times the clipping
        coefficients (engine.clip_grad_norm_ since the last step, then `max_norm`); None when the
        fp16 loss scaler found an overflow. `backward_passes`: the manager's count at this step."""
        parts = self._parts
        scaler = parts.scaler
        scale = scaler.scale if scaler is not None else 1.0
        clipped = parts.clipper.take(backward_passes)  # engine.clip_grad_norm_ since the last step (1.0: none)
        multiplier = clipped / scale
        max_norm = parts.config.max_norm
        if max_norm > 0 or scaler is not None:
            norm = math.sqrt(parts.runtime.grad_norm_sq()) / scale * clipped
            self.last_grad_norm = norm
            if scaler is not None:
                found_inf = not math.isfinite(norm)
                scaler.update(found_inf)
                if found_inf:
                    return None
            if max_norm > 0:
                coef = max_norm / (norm + 1e-6)
                if coef < 1.0:
                    multiplier *= coef
        return multiplier

    # --- what the engine calls ----------------------------------------------------------------
    def backward_started(self) -> None:
        """A backward pass began: C++'s early-step policy (csrc/core/early_step.h) decides when this
        backward's host steps start and arms them; the placement hears which did and why
        (stats()["placement"]["host_steps"])."""
        parts = self._parts
        cfg = parts.config
        parts.placer.note_backward_start(parts.runtime)  # the last step's lanes, before arming
        hyper = self._hyper()
        if cfg.optimizer_step_in_backward:
            stepped = parts.runtime.sets_stepped_in_backward()
            if stepped:
                raise RuntimeError(
                    f"gemini_ext: a backward pass began while {stepped} chunk sets that the previous backward stepped "
                    "(GeminiConfig(optimizer_step_in_backward=True)) wait for optimizer.step(): call optimizer.step() "
                    "after every backward. To accumulate gradients over several backward passes, run all but the "
                    "last under engine.no_sync() or set enable_gradient_accumulation=True.")
            self._in_backward_hyper = hyper  # step() completes the step with these
        # the host's free bytes only where the policy may take spares (in place guesses need none)
        spares_possible = self.rule.native and (cfg.host_steps == "spares" or (
            cfg.host_steps == "in_place" and not parts.runtime.guess_supported()))
        decision = parts.runtime.backward_started(
            hyper, host_steps=cfg.host_steps, optimizer_name=self.opt_class.__name__, rule_native=self.rule.native,
            loss_scaled=parts.scaler is not None, max_norm=float(cfg.max_norm),
            user_clipped_last=parts.clipper.clipped_last, last_norm=self.last_grad_norm,
            placement_decides_now=parts.placer.decides_at_iteration_end(parts.runtime),
            host_available_bytes=host_available_bytes(parts.groups.ranks_on_host()) if spares_possible else None)
        self._early_form = decision["mode"] if decision["cover"] != "none" else None
        parts.placer.note_host_steps(decision["cover"], decision["reason"], decision["planned_cover"])

    def expect_backwards_per_step(self, backwards: int) -> None:
        """Integrations that know the gradient accumulation (the Trainer's
        gradient_accumulation_steps, Lightning's accumulate_grad_batches) say so before the first
        step: the host steps then start during the last backward from the first step on, instead of
        after every backward of the first step, taken back when the next adds to the gradients."""
        if not isinstance(backwards, int) or backwards < 1:
            raise ValueError(f"expect_backwards_per_step: expected an int >= 1, got {backwards!r}.")
        memory = self._parts.runtime.speculation_memory()
        if self._parts.counters.optimizer_steps == 0:
            self._parts.runtime.restore_speculation_memory(backwards, memory["last_step_scaled"])

    def steps_started_in_backward(self) -> int:
        """Host chunk sets stepped during the last backward and not yet followed by step()."""
        return self._parts.runtime.sets_stepped_in_backward()

    def grad_norm_sq(self) -> float:
        """The sum of squares of every gradient in the chunks (over every rank when sharded)."""
        return self._parts.runtime.grad_norm_sq()

    def release_spares(self) -> None:
        self._parts.runtime.release_spares()

    def speculation_stats(self) -> dict:
        """Speculative host steps so far: with spares, confirmed and dropped and the spare bytes
        held; in place, the steps, those clipped and the guesses undone (and the backward passes
        per step the policy expects)."""
        runtime = self._parts.runtime
        return {**runtime.speculations(), "spare_bytes": runtime.spare_bytes(), "in_place": runtime.guess_counts()}

    def speculation_summary(self) -> dict:
        """For stats()["speculation"]: the last step's host sets whose step started during backward, in
        its `form` ("in_place", "spares", "in_backward"): how many, whether every one held as guessed,
        how many were corrected, stepped again or left alone, the corrective passes' seconds; and the
        fraction of steps whose gradients clipping scaled."""
        last = self._parts.runtime.last_step()
        counts = self._parts.runtime.guess_counts()
        steps = counts["steps"]
        return {
            "last_step": {
                "form": self._last_form if last["guessed_sets"] else None,
                "guessed_sets": last["guessed_sets"],
                "held": last["guessed_sets"] > 0 and last["corrected_sets"] + last["redone_sets"]
                + last["skipped_sets"] == 0,
                "corrected_sets": last["corrected_sets"],
                "redone_sets": last["redone_sets"],
                "skipped_sets": last["skipped_sets"],
                "correction_seconds": last["correction_seconds"],
            },
            "steps": steps,
            "steps_clipped": counts["steps_clipped"],
            "clip_fraction": counts["steps_clipped"] / steps if steps else 0.0,
            "guesses_undone": counts["undone"],
            "reads_before_guesses": counts["reads_before_guesses"],
            "spare_bytes": self._parts.runtime.spare_bytes(),
        }

    def add_param_group(self, param_group: dict) -> None:
        # torch's own, unwrapped: torch wraps it so that dynamo does not trace it, and the wrapper's
        # first call imports torch._dynamo (over a second of CPU in every process that builds an
        # optimizer). This optimizer is never traced: its step is the engine's.
        _TORCH_ADD_PARAM_GROUP(self, param_group)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._parts.check_open("optimizer.zero_grad")
        self._parts.zero_grad()

    def last_step_stats(self) -> dict:
        return self._parts.runtime.last_step()

    # --- state ------------------------------------------------------------------------------
    def _ordered_params(self):
        """(global position, engine index) in the order torch.optim numbers parameters."""
        pos = 0
        for g in self.param_groups:
            for p in g["params"]:
                yield pos, self._parts.layout.index(p)
                pos += 1

    def state_dict(self, options=None) -> dict:
        """The torch optimizer's format: per parameter each state kind of the rule (fp32, CPU) and
        its step where torch's own optimizer keeps one; a generic optimizer's own state_dict().
        With StateDictOptions(full_state_dict=False) (torch.distributed.checkpoint.state_dict):
        this rank's share for DCP, keyed by parameter name, each state a DTensor when sharded
        (see _engine/sharded_state.py); load_state_dict() takes either."""
        if options_are_sharded(options) and self._generic is None:
            return self._parts.sharded_state.optimizer_state_dict(self)
        if self._generic is not None:
            self._generic.sync_hyperparameters(self.param_groups)
            return self._generic.state_dict()
        gm = self._parts.runtime
        kinds = self._parts.layout.state_kinds
        state = {}
        for pos, idx in self._ordered_params():
            step = gm.step_of(idx)
            if step == 0 or not (kinds or self.rule.state_has_step):
                continue  # never stepped (or stateless, as plain SGD): torch has no state for it either
            entry = {"step": torch.tensor(float(step))} if self.rule.state_has_step else {}
            state[pos] = {**entry, **{kind: gm.read(kind, idx) for kind in kinds}}
        gm.release_read_cache()  # the last chunk gathered for the reads (sharded)
        groups = []
        pos = 0
        for g in self.param_groups:
            entry = {k: v for k, v in g.items() if k != "params"}
            entry.update(self.rule.state_dict_extras())
            entry["params"] = list(range(pos, pos + len(g["params"])))
            pos += len(g["params"])
            groups.append(entry)
        # What the in-place speculation's next decision depends on: a run resumed from this state
        # then takes the same path, and computes the same bits (torch's optimizers ignore the key).
        return {"state": state, "param_groups": groups, "speculation": self._parts.runtime.speculation_memory()}

    def load_state_dict(self, state_dict: dict) -> None:
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups):
            raise ValueError(f"optimizer.load_state_dict: {len(groups)} param groups in the state dict, this "
                             f"optimizer has {len(self.param_groups)}; build the optimizer with the same groups.")
        for i, (saved, mine) in enumerate(zip(groups, self.param_groups)):
            if len(saved["params"]) != len(mine["params"]):
                raise ValueError(f"optimizer.load_state_dict: param group {i} has {len(saved['params'])} parameters "
                                 f"in the state dict and {len(mine['params'])} here.")
        by_name = any(isinstance(pid, str) for g in groups for pid in g["params"])
        if self._generic is not None:
            self._generic.load_state_dict(state_dict)
        elif by_name:  # the sharded layout (state_dict(options)), after dcp.load
            self._parts.sharded_state.load_optimizer_state(self, groups, state_dict["state"])
        else:
            self._load_native_state(groups, state_dict["state"])
        if self._generic is None and "speculation" in state_dict:
            self._parts.runtime.restore_speculation_memory(**state_dict["speculation"])
        skipped = ("params",) + self.rule.refused_flags + self.rule.ignored_flags
        for saved, mine in zip(groups, self.param_groups):
            for k, v in saved.items():
                if k not in skipped:
                    mine[k] = v

    def _load_native_state(self, groups: list, state: dict) -> None:
        gm = self._parts.runtime
        kinds = self._parts.layout.state_kinds
        saved_ids = [pid for g in groups for pid in g["params"]]
        for (pos, idx), saved_id in zip(self._ordered_params(), saved_ids):
            if not self._parts.layout.params[idx].requires_grad:
                continue  # frozen: no state (torch's optimizer has none for it either)
            entry = state.get(saved_id)
            if entry is None:
                gm.set_step(idx, 0)
                zero = torch.zeros(self._parts.layout.numels[idx])
                for kind in kinds:
                    gm.write(kind, idx, zero)
                continue
            missing = [kind for kind in kinds if kind not in entry]
            if missing:
                raise ValueError(f"optimizer.load_state_dict: the state of parameter "
                                 f"{self._parts.layout.names[idx]!r} has {sorted(entry)}, {self.opt_class.__name__} "
                                 f"needs {list(kinds)}; load a state dict saved from the same optimizer class.")
            step = entry.get("step", 1)  # torch's SGD and our Lion keep no step: the state exists, so >= 1
            gm.set_step(idx, int(step.item() if isinstance(step, torch.Tensor) else step))
            for kind in kinds:
                gm.write(kind, idx, entry[kind].detach().float().cpu())
