"""`GeminiTrainerMixin`: any `transformers.Trainer` (or subclass: TRL's trainers) with the model under a
gemini_ext engine; `GeminiTrainer` is the mixin over `transformers.Trainer`.

`class MyTrainer(GeminiTrainerMixin, trl.SFTTrainer)` puts the mixin first in the bases; it takes
`gemini_config=` beside the trainer's own arguments.

[Note: what the Trainer hands to the engine]
The Trainer keeps its loop, data loading, scheduler, evaluation, callbacks and logging; the engine
takes what concerns the parameters:
- the model is enabled before the Trainer sees it, so it never lands on the device whole, and is
  never wrapped in DistributedDataParallel (the engine shards and reduces itself); `deepspeed=`
  and `fsdp=` in the arguments are refused (they would shard the same parameters a second way);
- `gradient_checkpointing=True` checkpoints non-reentrantly (`use_reentrant=False`, transformers
  5's default; the engine refuses the reentrant form at backward); asking for it reentrant is an
  error; `torch_compile=True` compiles the model with the arguments' backend and mode;
- precision: `bf16` / `fp16` in the TrainingArguments choose the engine's `precision`, neither
  means fp32 as for a plain Trainer (with a warning when the GeminiConfig was left at its default
  bf16); the Trainer's own autocast is turned off; a GeminiConfig asking for another precision is
  an error, as is `fp16_full_eval` / `bf16_full_eval` in another dtype than the precision;
- the optimizer is the engine's AdamW with the arguments' lr, betas, eps and weight decay, in the
  Trainer's two parameter groups (no decay for biases and norms); `optim="sgd"` or `"adagrad"`
  give torch's SGD or Adagrad with the arguments' lr (native kernels too); the scheduler is the
  Trainer's;
- `max_grad_norm` clips through the engine (torch's clip_grad_norm_ over every parameter is
  routed there); gradient accumulation, sharded over ranks, runs the micro-batches before the
  last under `no_sync()` (no reduce-scatter until the last; in one process too under
  `optimizer_step_in_backward`, whose steps must see the whole step's gradients); otherwise in one
  process the gradients accumulate through their host copies, so each gradient chunk leaves the
  device once its backward is done rather than waiting there for the last micro-batch;
- `save_model` writes an ordinary `save_pretrained` directory (safetensors, fp32 masters) that
  `from_pretrained` loads without gemini_ext; checkpoints add the engine's own checkpoint
  (`gemini/` in the checkpoint folder: masters, optimizer state, loss scale, RNG), from which
  `resume_from_checkpoint` continues bit-exactly;
- `log` adds the engine's traffic of the logging interval: H2D/D2H bytes, evictions, time
  waited for copies.
The engine stays open while the trainer lives (evaluate and predict after train() use it);
`trainer.close()` gives the model back as ordinary parameters holding the trained values.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import warnings

import torch
import transformers

from ..config import GeminiConfig
from ..engine import enable
from ._precision import agreed_precision
from .accelerate import clip_grad_norm_in_chunks

ENGINE_CHECKPOINT = "gemini"  # the engine's checkpoint inside a Trainer checkpoint folder
ADAMW_NAMES = ("adamw_torch", "adamw_torch_fused", "adamw_hf")
OTHER_OPTIMIZERS = {"sgd": torch.optim.SGD, "adagrad": torch.optim.Adagrad}  # TrainingArguments.optim -> class


# transformers' name for the weights' dtype (the config attribute and from_pretrained's argument):
# `dtype` since transformers 4.56 (where `torch_dtype` became an alias property), `torch_dtype` before.
DTYPE_NAME = "dtype" if isinstance(getattr(transformers.PretrainedConfig, "torch_dtype", None), property) \
    else "torch_dtype"


# TrainingArguments' activation checkpointing switch and options: `activation_checkpointing*` in the
# transformers releases that renamed them (the `gradient_checkpointing*` names remain as aliases).
CHECKPOINTING = (("activation_checkpointing", "activation_checkpointing_kwargs")
                 if "activation_checkpointing_kwargs" in transformers.TrainingArguments.__dataclass_fields__
                 else ("gradient_checkpointing", "gradient_checkpointing_kwargs"))


def _optim_name(args) -> str:
    return str(getattr(args.optim, "value", args.optim))


def _checked_args(args, who: str):
    """The arguments with what the engine replaces turned off (the Trainer's autocast) and
    gradient checkpointing made non-reentrant; ValueError for what conflicts with the engine."""
    if _optim_name(args) not in ADAMW_NAMES + tuple(OTHER_OPTIMIZERS):
        raise ValueError(f"{who}: optim={_optim_name(args)!r}; the engine steps "
                         f"{', '.join(ADAMW_NAMES + tuple(OTHER_OPTIMIZERS))} with its own kernels (another "
                         "torch optimizer: pass optimizer_cls_and_kwargs is not supported, subclass and override "
                         "create_optimizer with self.engine.optimizer(cls, ...)).")
    for field in ("deepspeed", "fsdp"):
        if getattr(args, field, None):
            raise ValueError(f"{who}: {field}={getattr(args, field)!r} in the TrainingArguments; the engine shards, "
                             f"offloads and reduces the parameters itself, so {field} cannot manage them too. Leave "
                             f"{field} out (unset it) when training with gemini_ext.")
    replaced = {"bf16": False, "fp16": False}  # the engine computes in its precision: no autocast on top
    if getattr(args, CHECKPOINTING[0], False) or args.gradient_checkpointing:
        kwargs = dict(getattr(args, CHECKPOINTING[1], None) or args.gradient_checkpointing_kwargs or {})
        if kwargs.get("use_reentrant", False):
            raise ValueError(f"{who}: {CHECKPOINTING[1]}={kwargs}; the engine's hooks need non-reentrant "
                             "activation checkpointing (the reentrant form runs backward outside autograd's "
                             "graph). Pass use_reentrant=False or leave it out.")
        replaced[CHECKPOINTING[1]] = {**kwargs, "use_reentrant": False}
    if getattr(args, "steps_per_generation", None) is not None and \
            getattr(args, "generation_batch_size", None) is not None:
        # TRL's GRPOConfig derives one from the other in __post_init__, which replace() runs again and
        # which refuses both given: the derived one is derived again, to the same value
        replaced["generation_batch_size"] = None
    return dataclasses.replace(args, **replaced)


def _trainer_precision(args, config: GeminiConfig, who: str) -> str:
    """The engine's precision from the TrainingArguments, as a plain Trainer would train: `bf16`,
    `fp16`, else fp32. A config asking for another precision is refused, and a config left at
    its default bf16 while the arguments ask for neither is told that fp32 wins. The `*_full_eval`
    casts would convert the managed parameters, so one that differs from the precision is refused."""
    wanted = "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32"
    precision = agreed_precision(config, wanted, who, "TrainingArguments")  # a non-default config must agree
    if precision == "fp32" and config.precision != "fp32":
        warnings.warn(f"{who}: the TrainingArguments set neither bf16 nor fp16, so the model trains in fp32 as a "
                      f"plain Trainer would (GeminiConfig's default precision={config.precision!r} yields to them). "
                      "Pass bf16=True (or fp16=True) in the TrainingArguments to compute in 16 bits.", stacklevel=3)
    for flag, dtype in (("fp16_full_eval", "fp16"), ("bf16_full_eval", "bf16")):
        if getattr(args, flag, False) and dtype != precision:
            raise ValueError(f"{who}: {flag}=True casts the whole model to {dtype} for evaluation, and the engine's "
                             f"parameters compute in {precision} from their chunks (a cast would be undone). Leave "
                             f"{flag} out (evaluation runs in {precision}), or train in {dtype} "
                             f"({'fp16' if dtype == 'fp16' else 'bf16'}=True in the TrainingArguments).")
    return precision


class GeminiTrainerMixin:
    """Put first in the bases of a `transformers.Trainer` subclass; takes `gemini_config=gx.GeminiConfig(...)`
    beside the trainer's own arguments (the model and the arguments by name or in the Trainer's order)."""

    def __init__(self, *args, gemini_config: GeminiConfig | None = None, **kwargs):
        # see [Note: what the Trainer hands to the engine]
        who = type(self).__name__
        if not isinstance(self, transformers.Trainer):
            raise TypeError(f"{who}: GeminiTrainerMixin goes first in the bases of a transformers.Trainer subclass, "
                            f"e.g. class {who}(GeminiTrainerMixin, transformers.Trainer).")
        names = ("model", "args")
        for name, value in zip(names, args[:2]):
            if name in kwargs:
                raise TypeError(f"{who}: got {name} twice (positionally and by name).")
            kwargs[name] = value
        args = args[2:]
        model = kwargs.get("model")
        if model is None or isinstance(model, str):
            raise ValueError(f"{who}: pass the model as a torch.nn.Module (model_init and model names are not "
                             "supported: the engine owns one model, built before the trainer).")
        if (kwargs.get("optimizers") or (None, None))[0] is not None:
            raise ValueError(f"{who}: the optimizer comes from the engine (AdamW with the arguments' "
                             "hyperparameters); leave `optimizers` out.")
        train_args = kwargs.get("args") or transformers.TrainingArguments(output_dir="trainer_output")
        config = gemini_config if gemini_config is not None else GeminiConfig()
        config = dataclasses.replace(config, precision=_trainer_precision(train_args, config, who))
        train_args = _checked_args(train_args, who)
        _ = train_args.device  # under torchrun the Trainer's process group exists before the engine shards over it
        kwargs["args"] = train_args
        self.engine = enable(model, config)
        try:
            super().__init__(*args, **kwargs)
        except BaseException:
            self.engine.close()
            raise
        self._traffic_mark = self._traffic()

    # --- the parameters are the engine's --------------------------------------------------
    def _move_model_to_device(self, model, device):
        pass  # the engine placed the parameters (in chunks) and the buffers on its compute device

    def _wrap_model(self, model, training=True, dataloader=None):
        return model  # no DistributedDataParallel: the engine reduces gradients itself

    def create_accelerator_and_postprocess(self):
        super().create_accelerator_and_postprocess()
        # accelerate would move the model to its device and wrap it in DistributedDataParallel:
        # the engine owns both placement and gradient reduction, so the model passes unchanged.
        self.accelerator.prepare_model = self._model_as_is
        # accelerate (from 1.x) takes the norm from p.grad itself, which is None for managed
        # parameters: it would report 0 and clip nothing. torch's clip_grad_norm_ is the engine's
        # while it is open (it checks that the parameters are the model's, then clips in the chunks).
        self.accelerator.clip_grad_norm_ = clip_grad_norm_in_chunks

    def _model_as_is(self, model, device_placement=None, evaluation_mode=False):
        if self.args.torch_compile and not isinstance(model, torch._dynamo.eval_frame.OptimizedModule):
            # what accelerate's prepare_model would do with the arguments' dynamo settings
            return torch.compile(model, backend=self.args.torch_compile_backend or "inductor",
                                 mode=self.args.torch_compile_mode)
        return model

    def create_optimizer(self, model=None):
        if self.optimizer is None:
            opt_model = self.model if model is None else model
            decay = set(self.get_decay_parameter_names(opt_model))
            named = [(n, p) for n, p in opt_model.named_parameters() if p.requires_grad]
            groups = [{"params": [p for n, p in named if n in decay], "weight_decay": self.args.weight_decay},
                      {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0}]
            groups = [g for g in groups if g["params"]]
            name = _optim_name(self.args)
            if name in OTHER_OPTIMIZERS:
                self.optimizer = self.engine.optimizer(OTHER_OPTIMIZERS[name], params=groups,
                                                       lr=self.args.learning_rate)
            else:
                self.optimizer = self.engine.optimizer(torch.optim.AdamW, params=groups, lr=self.args.learning_rate,
                                                       betas=(self.args.adam_beta1, self.args.adam_beta2),
                                                       eps=self.args.adam_epsilon)
            self.optimizer.expect_backwards_per_step(max(1, int(self.args.gradient_accumulation_steps)))
        return self.optimizer

    def training_step(self, model, inputs, num_items_in_batch=None):
        last = self.accelerator.sync_gradients  # the micro-batch whose backward completes the step
        # sharded, or stepping in backward (which must see the whole step's gradients at once)
        hold = self.engine.world_size > 1 or self.engine.config.optimizer_step_in_backward
        with self.engine.no_sync() if hold and not last else contextlib.nullcontext():
            return super().training_step(model, inputs, num_items_in_batch)

    def _generate_single_turn(self, prompt_ids, *args, **kwargs):
        """TRL's generation through transformers (GRPOTrainer's `model.generate()`) inside
        engine.generating(): the room of a KV cache for these prompts and `max_completion_length`
        new tokens kept from the chunks (see [Note: room for the KV cache], _engine/generation.py)."""
        parent = getattr(super(), "_generate_single_turn", None)
        if parent is None:
            raise AttributeError(f"{type(self).__name__} has no _generate_single_turn (not a TRL trainer).")
        if getattr(self, "use_vllm", False):  # vLLM generates outside the engine
            return parent(prompt_ids, *args, **kwargs)
        longest = max((len(p) for p in prompt_ids), default=0) + int(getattr(self, "max_completion_length", 0) or 0)
        with self.engine.generating(batch_size=len(prompt_ids), max_length=longest):
            return parent(prompt_ids, *args, **kwargs)

    # --- saving and resuming ----------------------------------------------------------------
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False):
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        from torch.distributed.checkpoint.state_dict import StateDictOptions
        # Collective when sharded: every rank takes part; unless each node saves, only the first
        # rank (the one that writes) keeps the dictionary, the others hold one chunk at a time.
        state_dict = self.engine.state_dict(StateDictOptions(full_state_dict=True,
                                                             cpu_offload=not self.args.save_on_each_node))
        if self.args.should_save:
            os.makedirs(output_dir, exist_ok=True)
            # save_pretrained records the parameters' dtype, which inside the engine is the compute
            # dtype; the files hold the masters in the model's own dtypes, and from_pretrained must
            # load them as such. (save_pretrained may consume the state dict: look first.)
            floating = [v.dtype for v in state_dict.values() if v.is_floating_point()]
            self.model.save_pretrained(output_dir, state_dict=state_dict, safe_serialization=True)
            if floating:
                setattr(self.model.config, DTYPE_NAME, str(floating[0]).split(".")[1])
                self.model.config.save_pretrained(output_dir)
            if self.processing_class is not None:
                self.processing_class.save_pretrained(output_dir)
            torch.save(self.args, os.path.join(output_dir, transformers.trainer.TRAINING_ARGS_NAME))

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        self.engine.save_checkpoint(os.path.join(output_dir, ENGINE_CHECKPOINT))
        if self.args.should_save and self.lr_scheduler is not None:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, transformers.trainer.SCHEDULER_NAME))

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        # The masters come with the engine's checkpoint (_load_optimizer_and_scheduler), exactly.
        if not os.path.isdir(os.path.join(resume_from_checkpoint, ENGINE_CHECKPOINT)):
            raise ValueError(f"{type(self).__name__}: {resume_from_checkpoint} has no {ENGINE_CHECKPOINT}/ engine "
                             "checkpoint; resume from a checkpoint a GeminiTrainer saved.")

    def _load_optimizer_and_scheduler(self, checkpoint):
        if checkpoint is None:
            return
        self.engine.load_checkpoint(os.path.join(checkpoint, ENGINE_CHECKPOINT))
        path = os.path.join(checkpoint, transformers.trainer.SCHEDULER_NAME)
        if self.lr_scheduler is not None and os.path.isfile(path):
            self.lr_scheduler.load_state_dict(torch.load(path, weights_only=True))

    # --- logging ------------------------------------------------------------------------------
    def _traffic(self) -> dict:
        stats = self.engine.stats()
        traffic, counters = stats["traffic"], stats["counters"]
        return {"gemini/h2d_bytes": traffic["h2d_bytes"], "gemini/d2h_bytes": traffic["d2h_bytes"],
                "gemini/evictions": counters["evictions"], "gemini/copy_wait_s": traffic["copy_wait_seconds"]}

    def log(self, logs, start_time=None):
        if "loss" in logs:  # a training log: the engine's traffic since the last one
            now = self._traffic()
            logs.update({k: v - self._traffic_mark[k] for k, v in now.items()})
            self._traffic_mark = now
            stats = self.engine.stats()
            if stats["loss_scale"] is not None:  # fp16: the scale now and the steps skipped so far
                logs.update({"gemini/loss_scale": stats["loss_scale"], "gemini/skipped_steps": stats["skipped_steps"]})
        super().log(logs, start_time)

    def close(self) -> None:
        """Closes the engine: the model holds the trained values as ordinary parameters."""
        self.engine.close()


class GeminiTrainer(GeminiTrainerMixin, transformers.Trainer):
    """`transformers.Trainer(model=..., args=..., ...)` plus `gemini_config=gx.GeminiConfig(...)`."""
