"""GeminiTrainer against a plain transformers.Trainer: a tiny Llama from a config (no weights
downloaded), fp32, 20 optimizer steps with clipping, accumulation 2, a cosine schedule and a
budget that evicts; save_pretrained / from_pretrained without gemini_ext; bit-exact resume."""

import pytest
import torch

import gemini_ext as gx
from conftest import DEVICES
from dist_utils import run_torchrun
from parity_utils import chunk_cap

transformers = pytest.importorskip("transformers")
from gemini_ext.integrations.transformers import CHECKPOINTING, GeminiTrainer, GeminiTrainerMixin  # noqa: E402

STEPS, ACCUM, BATCH, SEQ = 20, 2, 4, 16


class Tokens(torch.utils.data.Dataset):
    """Synthetic token sequences (a repeating pattern with noise, so that the loss goes down)."""

    def __init__(self, n=STEPS * ACCUM * BATCH, vocab=128):
        g = torch.Generator().manual_seed(0)
        base = torch.arange(SEQ) * 7 % vocab
        self.ids = [(base + torch.randint(0, 3, (SEQ,), generator=g)) % vocab for _ in range(n)]

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _llama():
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)


def _args(out, device="sim", **kw):
    base = dict(output_dir=str(out), per_device_train_batch_size=BATCH, gradient_accumulation_steps=ACCUM,
                max_steps=STEPS, learning_rate=3e-3, weight_decay=0.1, lr_scheduler_type="cosine", warmup_steps=2,
                max_grad_norm=0.5, logging_steps=5, save_strategy="no", report_to=[], seed=0, optim="adamw_torch",
                use_cpu=device != "cuda", dataloader_num_workers=0, disable_tqdm=True)
    base.update(kw)
    return transformers.TrainingArguments(**base)


def _gemini_config(device="sim", **kw):
    # 27k parameters in chunks of 4096 elements; room for 6 chunks on the device: evictions every step
    kw.setdefault("chunk_config_dict", {"chunk_size": 4096})
    if "sim_capacity" not in kw:
        kw.update(chunk_cap(device, 6 * 4096 * 4))
    return gx.GeminiConfig(device=device, precision="fp32", **kw)


@pytest.mark.parametrize("device", DEVICES)
def test_trainer_matches_a_plain_trainer_and_saves_a_plain_model(tmp_path, device):
    plain = _llama()
    plain_trainer = transformers.Trainer(model=plain, args=_args(tmp_path / "plain", device),
                                         train_dataset=Tokens())
    plain_trainer.train()
    model = _llama()
    trainer = GeminiTrainer(model=model, args=_args(tmp_path / "gx", device), train_dataset=Tokens(),
                            gemini_config=_gemini_config(device))
    result = trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert logs[-1]["loss"] < logs[0]["loss"], "the loss goes down"
    assert all("gemini/h2d_bytes" in h and "gemini/evictions" in h for h in logs)
    assert sum(h["gemini/evictions"] for h in logs) > 0, "the budget evicts"
    # the norm the Trainer logs (and clips with) is the engine's, whichever way accelerate computes it
    plain_norms = [h["grad_norm"] for h in plain_trainer.state.log_history if "loss" in h]
    assert [h["grad_norm"] for h in logs] == pytest.approx(plain_norms, rel=1e-4) and min(plain_norms) > 0
    assert trainer.engine.stats()["optimizer_steps"] == STEPS
    metrics = trainer.evaluate(eval_dataset=Tokens(n=8))
    plain_metrics = plain_trainer.evaluate(eval_dataset=Tokens(n=8))
    assert metrics["eval_loss"] == pytest.approx(plain_metrics["eval_loss"], rel=1e-5)
    predicted = trainer.predict(Tokens(n=8)).predictions
    plain_predicted = plain_trainer.predict(Tokens(n=8)).predictions
    assert predicted.shape == plain_predicted.shape == (8, SEQ, 128)
    assert abs(predicted - plain_predicted).max() <= 1e-4 * abs(plain_predicted).max()
    trainer.save_model(str(tmp_path / "saved"))
    expected = trainer.engine.state_dict()
    trainer.close()
    # close() gives the parameters back on the device they had at enable(); the plain Trainer moved its model
    assert all(p.device.type == "cpu" for p in model.parameters())
    diffs = {n: ((a - b.cpu()).abs().max() / b.abs().max().clamp_min(1e-12)).item()
             for (n, a), (_, b) in zip(model.named_parameters(), plain.named_parameters())}
    worst = max(diffs, key=diffs.get)
    assert diffs[worst] <= 1e-5, (worst, diffs[worst], result)
    loaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "saved")
    for key, value in loaded.state_dict().items():
        assert torch.equal(value, expected[key].cpu()), key


def test_the_step_in_backward_under_the_trainer_with_accumulation_is_exact(tmp_path):
    """optimizer_step_in_backward with gradient accumulation in one process: the micro-batches
    before the last run under no_sync(), so the steps see the whole step's gradients, and the
    parameters equal those of the step from step(), bit for bit (no clipping: max_grad_norm=0)."""
    params = []
    for in_backward in (False, True):
        model = _llama()
        trainer = GeminiTrainer(model=model, args=_args(tmp_path / str(in_backward), max_grad_norm=0.0),
                                train_dataset=Tokens(),
                                gemini_config=_gemini_config(optimizer_step_in_backward=in_backward))
        trainer.train()
        assert trainer.engine.stats()["optimizer_steps"] == STEPS
        trainer.close()
        params.append({n: p.detach().clone() for n, p in model.named_parameters()})
    for name, value in params[0].items():
        assert torch.equal(params[1][name], value), name


def test_activations_planned_under_the_trainer_train_as_without(tmp_path, monkeypatch):
    """The Trainer's gradient checkpointing with the engine's activation offload ("on", and "auto"
    planning over the layers the model checkpoints, with and without the engine deciding the
    checkpointing), and the engine's own checkpointing ("auto") without the Trainer's: the same
    parameters, bit for bit, as the Trainer's checkpointing alone (tiny model: the offload
    threshold lowered to a byte). The Trainer enables its checkpointing in train(), after enable()."""
    from gemini_ext._engine.activations import offload as activation_offload
    monkeypatch.setattr(activation_offload, "MIN_OFFLOAD_BYTES", 1)
    runs = {"hf": (True, {}), "hf+offload": (True, {"activation_offload": "on"}),
            "hf+offload-auto": (True, {"activation_offload": "auto"}),
            "hf+auto": (True, {"activation_checkpointing": "auto", "activation_offload": "auto"}),
            "engine-auto": (False, {"activation_checkpointing": "auto", "activation_offload": "auto"})}
    params, stats = {}, {}
    for name, (hf_checkpointing, fields) in runs.items():
        model = _llama()
        args = _args(tmp_path / name, max_steps=4, gradient_checkpointing=hf_checkpointing,
                     gradient_checkpointing_kwargs={"use_reentrant": False})
        trainer = GeminiTrainer(model=model, args=args, train_dataset=Tokens(), gemini_config=_gemini_config(**fields))
        trainer.train()
        stats[name] = trainer.engine.stats()["activations"]
        trainer.close()
        params[name] = {n: p.detach().clone() for n, p in model.named_parameters()}
    for name in runs:
        assert all(torch.equal(params[name][n], v) for n, v in params["hf"].items()), name
    assert stats["hf+offload"]["offload"]["offloaded"] >= 2 * 4 * ACCUM, stats["hf+offload"]  # 2 layers
    for name in ("hf+offload-auto", "hf+auto", "engine-auto"):
        assert stats[name]["plan"]["decided"], (name, stats[name])
    # over the model's own checkpointing, "auto" offload recomputes or offloads, never keeps
    assert set(stats["hf+offload-auto"]["plan"]["choices"]) <= {"recompute", "offload"}, stats["hf+offload-auto"]
    for name in ("hf+offload-auto", "hf+auto"):  # the calls were the model's, through its own function
        assert stats[name]["checkpointing"]["calls_left_to_the_model"] > 0, (name, stats[name])
        assert stats[name]["checkpointing"]["checkpointed_calls"] == 0, (name, stats[name])
    assert stats["hf+offload-auto"]["offload"]["offloaded"] >= 2 * ACCUM, stats  # the measured forward's


@pytest.mark.parametrize("device", DEVICES)
def test_resume_from_a_trainer_checkpoint_is_bit_exact(tmp_path, device):
    straight = _llama()
    t = GeminiTrainer(model=straight, args=_args(tmp_path / "a", device, max_steps=8), train_dataset=Tokens(),
                      gemini_config=_gemini_config(device))
    t.train()
    t.close()
    first = _llama()
    t = GeminiTrainer(model=first, args=_args(tmp_path / "b", device, max_steps=8, save_strategy="steps",
                                              save_steps=4),
                      train_dataset=Tokens(), gemini_config=_gemini_config(device))
    t.train()
    t.close()
    resumed = _llama()
    t = GeminiTrainer(model=resumed, args=_args(tmp_path / "c", device, max_steps=8), train_dataset=Tokens(),
                      gemini_config=_gemini_config(device))
    t.train(resume_from_checkpoint=str(tmp_path / "b" / "checkpoint-4"))
    t.close()
    for (name, a), (_, b) in zip(resumed.named_parameters(), straight.named_parameters()):
        assert torch.equal(a, b), name


def test_arguments_that_conflict_with_the_engine_are_refused(tmp_path):
    with pytest.raises(ValueError, match="fp16.*precision='fp32'"):
        GeminiTrainer(model=_llama(), args=_args(tmp_path, fp16=True), train_dataset=Tokens(),
                      gemini_config=_gemini_config())
    with pytest.raises(ValueError, match="optim='adafactor'"):
        GeminiTrainer(model=_llama(), args=_args(tmp_path, optim="adafactor"), train_dataset=Tokens(),
                      gemini_config=_gemini_config())
    with pytest.raises(ValueError, match="fsdp=.*cannot manage them too"):
        GeminiTrainer(model=_llama(), args=_args(tmp_path, fsdp="full_shard"), train_dataset=Tokens(),
                      gemini_config=_gemini_config())
    for flag in ("fp16_full_eval", "bf16_full_eval"):  # the cast evaluate() makes would convert managed parameters
        args = _args(tmp_path)
        object.__setattr__(args, flag, True)  # as if given (TrainingArguments checks the hardware for it)
        with pytest.raises(ValueError, match=f"{flag}=True casts the whole model.*Leave {flag} out"):
            GeminiTrainer(model=_llama(), args=args, train_dataset=Tokens(), gemini_config=_gemini_config())
    args = _args(tmp_path)
    object.__setattr__(args, "deepspeed", "ds_config.json")  # as if given: building it needs deepspeed installed
    with pytest.raises(ValueError, match="deepspeed='ds_config.json'.*cannot manage them too"):
        GeminiTrainer(model=_llama(), args=args, train_dataset=Tokens(), gemini_config=_gemini_config())
    with pytest.raises(ValueError, match="checkpointing_kwargs=.*non-reentrant"):
        GeminiTrainer(model=_llama(), args=_args(tmp_path, **{CHECKPOINTING[0]: True,
                                                             CHECKPOINTING[1]: {"use_reentrant": True}}),
                      train_dataset=Tokens(), gemini_config=_gemini_config())
    with pytest.raises(TypeError, match="goes first in the bases"):
        type("NotATrainer", (GeminiTrainerMixin, object), {})(model=_llama(), gemini_config=_gemini_config())


class CountingTrainer(GeminiTrainerMixin, transformers.Trainer):
    """A user's Trainer subclass (as TRL's are): its own compute_loss, the mixin first."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.losses_computed = 0

    def compute_loss(self, model, inputs, **kwargs):
        self.losses_computed += 1
        return super().compute_loss(model, inputs, **kwargs)


def _losses(trainer):
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    trainer.close()
    return losses


def test_the_mixin_over_a_trainer_subclass_with_checkpointing_and_compile_trains_as_gemini_trainer(tmp_path):
    """A subclass with its own compute_loss (positional model and arguments), gradient checkpointing
    (non-reentrant by default) and torch_compile (honoured: the model is compiled) give the losses
    GeminiTrainer gives without them."""
    steps = 6
    reference = _losses(GeminiTrainer(model=_llama(), args=_args(tmp_path / "a", max_steps=steps, logging_steps=1),
                                      train_dataset=Tokens(), gemini_config=_gemini_config()))
    counting = CountingTrainer(_llama(), _args(tmp_path / "b", max_steps=steps, logging_steps=1),
                               train_dataset=Tokens(),
                               gemini_config=_gemini_config())
    assert _losses(counting) == reference and counting.losses_computed == steps * ACCUM
    model = _llama()
    checkpointed = GeminiTrainer(model=model, args=_args(tmp_path / "c", max_steps=steps, logging_steps=1,
                                                         **{CHECKPOINTING[0]: True}),
                                 train_dataset=Tokens(), gemini_config=_gemini_config())
    assert getattr(checkpointed.args, CHECKPOINTING[1]) == {"use_reentrant": False}
    assert _losses(checkpointed) == pytest.approx(reference, rel=1e-6)
    assert any(getattr(m, "gradient_checkpointing", False) for m in model.modules()), "the model checkpoints"
    compiled = GeminiTrainer(model=_llama(), args=_args(tmp_path / "d", max_steps=steps, logging_steps=1,
                                                        torch_compile=True, torch_compile_backend="aot_eager"),
                             train_dataset=Tokens(), gemini_config=_gemini_config())
    compiled.train()
    assert isinstance(compiled.model_wrapped, torch._dynamo.eval_frame.OptimizedModule), type(compiled.model_wrapped)
    losses = [h["loss"] for h in compiled.state.log_history if "loss" in h]
    compiled.close()
    assert losses == pytest.approx(reference, rel=1e-5)


def _two_ranks_body(rank, world_size, out):
    """Under torchrun: a plain Trainer (DistributedDataParallel over gloo) and a GeminiTrainer
    (chunks sharded over the same ranks) on the same data split; rank 0 compares."""
    kw = dict(ddp_backend="gloo", max_steps=8)
    plain = _llama()
    transformers.Trainer(model=plain, args=_args(f"{out}/plain", **kw), train_dataset=Tokens()).train()
    model = _llama()
    trainer = GeminiTrainer(model=model, args=_args(f"{out}/gx", **kw), train_dataset=Tokens(),
                            gemini_config=_gemini_config(sim_capacity=None))
    trainer.train()
    assert trainer.engine.world_size == 2
    trainer.save_model(f"{out}/saved")
    trainer.close()
    if rank == 0:
        for (name, a), (_, b) in zip(model.named_parameters(), plain.named_parameters()):
            rel = ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()
            assert rel <= 5e-5, (name, rel)  # a per-rank mean of means: another summation order (test_distributed)
        loaded = transformers.LlamaForCausalLM.from_pretrained(f"{out}/saved")
        for (name, a), (_, b) in zip(loaded.named_parameters(), model.named_parameters()):
            assert torch.equal(a, b), name


def test_two_ranks_under_torchrun(tmp_path):
    run_torchrun(2, _two_ranks_body, str(tmp_path), tmp_dir=str(tmp_path))


def test_the_mixin_over_trls_sft_trainer_trains_as_sft_trainer(tmp_path):
    """TRL's SFTTrainer with GeminiTrainerMixin first in the bases against SFTTrainer itself: the
    same losses and gradient norms on pre-tokenized data, and the same trained weights."""
    trl = pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    from tokenizers import Tokenizer, models

    vocab = {str(i): i for i in range(128)}
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="0")), pad_token="0", eos_token="1")
    train = datasets.Dataset.from_dict({"input_ids": [t.tolist() for t in Tokens(n=6 * BATCH).ids]})

    def sft_args(out):
        return trl.SFTConfig(output_dir=str(out), per_device_train_batch_size=BATCH, max_steps=6, learning_rate=3e-3,
                             logging_steps=1, max_grad_norm=0.5, bf16=False, use_cpu=True, save_strategy="no",
                             report_to=[], seed=0, disable_tqdm=True)

    class GeminiSFTTrainer(GeminiTrainerMixin, trl.SFTTrainer):
        pass

    plain_model, model = _llama(), _llama()  # each from its own config: SFTTrainer sets the pad token in it
    plain = trl.SFTTrainer(model=plain_model, args=sft_args(tmp_path / "plain"), train_dataset=train,
                           processing_class=tokenizer)
    plain.train()
    ours = GeminiSFTTrainer(model=model, args=sft_args(tmp_path / "gx"), train_dataset=train,
                            processing_class=tokenizer, gemini_config=_gemini_config())
    ours.train()
    logs = [[h[k] for h in t.state.log_history if "loss" in h] for t in (plain, ours) for k in ("loss", "grad_norm")]
    assert logs[2] == pytest.approx(logs[0], rel=1e-5) and logs[3] == pytest.approx(logs[1], rel=1e-4)
    assert ours.engine.stats()["optimizer_steps"] == 6
    ours.close()
    for (name, a), (_, b) in zip(plain_model.named_parameters(), model.named_parameters()):
        assert (a.detach() - b.detach()).abs().max() <= 1e-5 * a.abs().max(), name


def test_the_precision_comes_from_the_training_arguments(tmp_path):
    """Neither bf16 nor fp16 in the arguments: fp32, as a plain Trainer trains, and a warning when
    the GeminiConfig was left at its default bf16; bf16=True gives bf16."""
    with pytest.warns(UserWarning, match="neither bf16 nor fp16.*fp32"):
        t = GeminiTrainer(model=_llama(), args=_args(tmp_path), train_dataset=Tokens(),
                          gemini_config=gx.GeminiConfig(device="sim"))
    assert t.engine.config.precision == "fp32" and next(t.model.parameters()).dtype == torch.float32
    t.close()
    t = GeminiTrainer(model=_llama(), args=_args(tmp_path, bf16=True), train_dataset=Tokens(),
                      gemini_config=gx.GeminiConfig(device="sim"))
    assert t.engine.config.precision == "bf16" and next(t.model.parameters()).dtype == torch.bfloat16
    t.close()


def test_the_mixin_over_trls_grpo_trainer_generates_and_trains_as_grpo_trainer(tmp_path):
    """TRL's GRPOTrainer (online RL: the policy generates, a rule scores, the step follows) with
    GeminiTrainerMixin first in the bases against GRPOTrainer itself on the same tiny Llama: the
    same rewards and losses step for step, gradient norms within 1e-5, two optimizer steps under
    the engine. The reward: the share of even tokens in a completion."""
    trl = pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = Tokenizer(models.WordLevel({str(i): i for i in range(128)}, unk_token="0"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=words, pad_token="0", eos_token="1")
    prompts = datasets.Dataset.from_dict({"prompt": [" ".join(str(2 + (i * 7 + j) % 100) for j in range(6))
                                                     for i in range(16)]})

    def even_share(completions, **kwargs):
        return [sum(int(t) % 2 == 0 for t in c.split()) / max(1, len(c.split())) for c in completions]

    def policy():
        torch.manual_seed(0)
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(
            hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=128, max_position_embeddings=64, pad_token_id=0, eos_token_id=1))

    def grpo_args(out):
        return trl.GRPOConfig(output_dir=str(out), per_device_train_batch_size=4, num_generations=4,
                              max_completion_length=8, max_steps=2, learning_rate=1e-2, logging_steps=1, use_cpu=True,
                              bf16=False, report_to=[], save_strategy="no", seed=0, disable_tqdm=True)

    class GeminiGRPOTrainer(GeminiTrainerMixin, trl.GRPOTrainer):
        pass

    plain = trl.GRPOTrainer(model=policy(), reward_funcs=even_share, args=grpo_args(tmp_path / "plain"),
                            train_dataset=prompts, processing_class=tokenizer)
    plain.train()
    ours = GeminiGRPOTrainer(model=policy(), reward_funcs=even_share, args=grpo_args(tmp_path / "gx"),
                             train_dataset=prompts, processing_class=tokenizer,
                             gemini_config=gx.GeminiConfig(device="sim", placement_policy="auto"))
    rooms = []
    generating = ours.engine.generating

    def spy(*args, **kwargs):  # the mixin generates inside engine.generating(), the KV cache's room kept
        rooms.append(kwargs)
        return generating(*args, **kwargs)

    ours.engine.generating = spy
    ours.train()
    assert rooms and all(r["batch_size"] == 4 and 6 + 8 <= r["max_length"] for r in rooms), rooms
    logs = [[(h["reward"], h["loss"], h["grad_norm"]) for h in t.state.log_history if "loss" in h]
            for t in (plain, ours)]
    assert [r[:2] for r in logs[1]] == [r[:2] for r in logs[0]] and len(logs[0]) == 2, logs
    assert [r[2] for r in logs[1]] == pytest.approx([r[2] for r in logs[0]], rel=1e-5) and logs[0][1][2] > 0, logs
    assert ours.engine.stats()["optimizer_steps"] == 2
    ours.close()
