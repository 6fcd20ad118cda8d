"""A hostile user in one process: every everyday action on a model inside gx.enable().

Usage: python hostile_worker.py SCENARIO DEVICE [RANK WORLD_SIZE PORT]

Runs the checks of CHECKS in order on the scenario's model and prints `BEGIN name` before each
and `PASS name` or `FAIL name: error` after it (flushed), then `DONE`, so that the test that
launched it can tell which check a crash (a signal) happened in. A check's failure does not stop
the others. Models are real transformers models built from small configs (no weights are
downloaded) and the project's GPT.
"""

from __future__ import annotations

import sys
import tempfile
import traceback

import torch

import gemini_ext as gx

VOCAB = 128


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel
    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64))


def _t5():
    from transformers import T5Config, T5ForConditionalGeneration
    return T5ForConditionalGeneration(T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2,
                                               num_heads=4, decoder_start_token_id=0))


def _moe():
    # Switch Transformers: every expert is a module of its own, and a step uses only some of them.
    from transformers import SwitchTransformersConfig, SwitchTransformersForConditionalGeneration
    return SwitchTransformersForConditionalGeneration(SwitchTransformersConfig(
        vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, expert_capacity=64, num_layers=2, num_decoder_layers=2,
        num_sparse_encoder_layers=1, num_sparse_decoder_layers=1, num_heads=4, num_experts=4,
        decoder_start_token_id=0))


MODELS = {"llama": _llama, "gpt2": _gpt2, "t5": _t5, "moe": _moe}
TIGHT = 48 * 1024  # chunk bytes on the device: a few of the 4,096-element chunks, so chunks are evicted
# scenario: (model, precision, config fields, world size)
SCENARIOS = {
    "llama-tight-bf16": ("llama", "bf16", {"tight": True}, 1),
    "gpt2-homed-on-host": ("gpt2", "fp32", {"offload_param_frac": 1.0}, 1),
    "t5-overlap-bf16": ("t5", "bf16", {"overlap_optimizer": True, "offload_optim_frac": 1.0}, 1),
    "moe-tight": ("moe", "fp32", {"tight": True}, 1),
    "llama-two-ranks": ("llama", "bf16", {}, 2),
}


class Context:
    def __init__(self, scenario: str, device: str, rank: int, world_size: int):
        name, precision, fields, _ = SCENARIOS[scenario]
        self.scenario, self.name, self.device, self.rank, self.world_size = scenario, name, device, rank, world_size
        self.dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[precision]
        torch.manual_seed(0)
        self.model = MODELS[name]()
        self.buffers_before = {k: v.clone() for k, v in self.model.named_buffers()}
        fields = dict(fields)
        if fields.pop("tight", False):
            tight = 2 * TIGHT if name == "moe" else TIGHT  # a sparse layer's router and experts are used at once
            fields.update({"sim_capacity": tight} if device == "sim" else
                          {"placement_policy": "const", "const_gpu_budget": tight})
        self.config = gx.GeminiConfig(device=device, precision=precision, chunk_config_dict={"chunk_size": 4096},
                                      **fields)
        self.tdev = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")
        self.engine = None
        self.opt = None

    def batch(self, step: int) -> dict:
        g = torch.Generator().manual_seed(1000 * step + self.rank)
        ids = torch.randint(0, VOCAB, (2, 12), generator=g).to(self.tdev)
        return {"input_ids": ids, "labels": ids}

    def train_step(self, step: int) -> None:
        loss = self.model(**self.batch(step)).loss
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), 0.5)
        assert torch.isfinite(norm) and float(norm) > 0, f"clip_grad_norm_ returned {norm}: the gradients were not seen"
        self.opt.step()
        self.opt.zero_grad()

    def pick(self):
        """A trainable weight matrix every scenario has, and its name."""
        for name, p in self.model.named_parameters():
            if p.dim() == 2 and p.requires_grad and "shared" not in name and "embed" not in name:
                return name, p
        raise AssertionError("no 2-d parameter")


# --- the checks ---------------------------------------------------------------------------------
def check_train(ctx):
    ctx.engine = gx.enable(ctx.model, ctx.config)
    ctx.opt = ctx.engine.optimizer(torch.optim.AdamW, lr=1e-2, fused=True)  # fused: an accepted hint
    for step in range(2):
        ctx.train_step(step)
    assert ctx.engine.stats()["optimizer_steps"] == 2


def check_read_right_after_the_step(ctx):
    # With CPU steps left running (overlap_optimizer), a parameter is either current or refused.
    ctx.train_step(5)
    refused = []
    for name, p in ctx.model.named_parameters():
        try:
            p.detach().clone()  # reads the data (.float().cpu() of an fp32 parameter on sim would not)
        except RuntimeError as e:
            assert "synchronize" in str(e) or (ctx.world_size > 1 and "gathered" in str(e)), str(e)
            refused.append(name)
    if ctx.config.overlap_optimizer and ctx.config.offload_optim_frac == 1.0:
        assert refused, "every CPU step had settled already: this check saw nothing"
    ctx.engine.synchronize()
    full = ctx.engine.state_dict()
    if ctx.world_size == 1:
        for name, p in ctx.model.named_parameters():
            assert torch.equal(p.detach().float().cpu(), full[name].to(p.dtype).float()), name


def check_evicted_between_steps(ctx):
    if ctx.config.sim_capacity is not None or ctx.config.const_gpu_budget is not None:
        assert ctx.engine.stats()["counters"]["evictions"] > 0, "the tight budget evicted nothing"


def check_touch_every_parameter(ctx):
    full = ctx.engine.state_dict()  # settles every step still running
    refused = 0
    for name, p in ctx.model.named_parameters():
        try:
            value = p.detach().float().cpu()
            total = float(p.sum())
        except RuntimeError as e:
            assert ctx.world_size > 1, f"{name}: one process must serve every value, got: {e}"
            assert name in str(e) or "among" in str(e), f"the error does not name the parameter: {e}"
            assert "gathered" in str(e), f"the error does not name the fix: {e}"
            refused += 1
            continue
        expected = full[name].to(p.dtype).float()
        assert torch.equal(value, expected), f"{name}: read {value.flatten()[:4]}, current {expected.flatten()[:4]}"
        assert abs(total - float(value.to(p.dtype).sum())) <= 1e-3 * max(1.0, abs(total)) or ctx.dtype != torch.float32
    if ctx.world_size > 1:
        assert refused > 0, "sharded, some parameters must be refused outside the hooks"


def check_write_in_place(ctx):
    name, p = ctx.pick()
    before = ctx.engine.state_dict()[name]
    try:
        with torch.no_grad():
            p.mul_(0.5)
    except RuntimeError as e:
        assert ctx.world_size > 1 and "gathered" in str(e), f"unexpected refusal: {e}"
        return
    after = ctx.engine.state_dict()[name]
    expected = before.to(ctx.dtype) * 0.5
    assert torch.equal(after.to(ctx.dtype), expected), f"{name}: the write did not reach the master"
    ctx.train_step(10)
    moved = ctx.engine.state_dict()[name]
    assert (moved - after).abs().max() < (before - after).abs().max(), "the step went back to the unwritten value"


def check_model_state_dict(ctx):
    full = ctx.engine.state_dict()
    sd = ctx.model.state_dict()
    assert set(sd) == set(full), sorted(set(sd) ^ set(full))
    params = dict(ctx.model.named_parameters())
    for k, v in sd.items():
        assert torch.equal(v.float().cpu(), full[k]), k
        if k in params:
            assert v.dtype == torch.float32, f"{k}: {v.dtype}, expected the original dtype"
    kept = ctx.model.state_dict(keep_vars=True)
    assert all(kept[k] is p for k, p in params.items() if k in kept), "keep_vars=True returns the Parameters"


def check_load_state_dict(ctx):
    full = ctx.engine.state_dict()
    params = dict(ctx.model.named_parameters())
    # every key of a parameter, tied ones too: torch loads them in turn into the same tensor
    param_keys = {k for k, v in ctx.model.state_dict(keep_vars=True).items() if isinstance(v, torch.nn.Parameter)}
    changed = {k: (v * 0.75 if k in param_keys else v) for k, v in full.items()}
    result = ctx.model.load_state_dict(changed)
    assert not result.missing_keys and not result.unexpected_keys, result
    now = ctx.engine.state_dict()
    for k in params:
        if k in now:
            assert torch.equal(now[k], changed[k]), f"{k}: load_state_dict did not reach the master"
            if ctx.world_size == 1:  # sharded, parameters are not readable outside the hooks
                assert torch.equal(params[k].detach().float().cpu(), changed[k].to(ctx.dtype).float()), k
    ctx.model.load_state_dict(full)
    assert all(torch.equal(ctx.engine.state_dict()[k], full[k]) for k in params if k in full)


def check_save_pretrained(ctx):
    full = ctx.engine.state_dict()
    with tempfile.TemporaryDirectory() as d:
        ctx.model.save_pretrained(d)  # every rank: its state dict is collective
        if ctx.rank != 0:
            return  # transformers writes the weights from the main process
        from gemini_ext.integrations.transformers import DTYPE_NAME

        again = type(ctx.model).from_pretrained(d, **{DTYPE_NAME: torch.float32})
    loaded = again.state_dict()
    for k, v in full.items():
        if k in loaded:
            assert torch.equal(loaded[k].float(), v), f"{k}: saved value differs from the master"


def check_gathered_writable(ctx):
    name, p = ctx.pick()
    before = ctx.engine.state_dict()[name]
    with ctx.engine.gathered([p], writable=True):
        assert p.dtype == torch.float32 and p.device == ctx.tdev
        assert torch.equal(p.detach().cpu(), before), "gathered: not the current master value"
        with torch.no_grad():
            p.mul_(2.0)
    assert torch.equal(ctx.engine.state_dict()[name], before * 2.0), "gathered(writable=True): edit lost"
    with ctx.engine.gathered(writable=False):
        with torch.no_grad():
            p.mul_(0.5)
    assert torch.equal(ctx.engine.state_dict()[name], before * 2.0), "gathered(writable=False): edit kept"
    ctx.model.load_state_dict({**ctx.model.state_dict(), name: before})


def check_foreign_optimizer_refused(ctx):
    sgd = torch.optim.SGD(ctx.model.parameters(), lr=0.1)
    try:
        sgd.step()
    except RuntimeError as e:
        assert "engine.optimizer" in str(e), str(e)
    else:
        raise AssertionError("a torch optimizer stepping managed parameters did not raise")


def check_clip_value_refused(ctx):
    try:
        torch.nn.utils.clip_grad_value_(ctx.model.parameters(), 1.0)
    except RuntimeError as e:
        assert "clip_grad_norm_" in str(e)
    else:
        raise AssertionError("clip_grad_value_ on managed parameters clipped nothing and did not raise")


def check_refused_optimizer_flags(ctx):
    try:
        ctx.engine.optimizer(torch.optim.AdamW, capturable=True)
    except ValueError as e:
        assert "capturable" in str(e)
    else:
        raise AssertionError("capturable=True was accepted")


def check_peak_counters_kept(ctx):
    if ctx.device != "cuda":
        return
    torch.cuda.synchronize()
    user_peak = torch.cuda.max_memory_allocated()
    steps = ctx.engine.stats()["steps"]
    engine_peak = max(s["non_model_peak_bytes"] for s in steps)
    assert user_peak >= engine_peak, f"torch's peak {user_peak} < an iteration's non-model peak {engine_peak}: reset"


def check_close_gives_buffers_back(ctx):
    clip = torch.nn.utils.clip_grad_norm_
    ctx.engine.close()
    after = dict(ctx.model.named_buffers())
    for k, v in ctx.buffers_before.items():
        assert after[k].dtype == v.dtype and torch.equal(after[k].cpu(), v.cpu()), f"buffer {k} changed"
    restored = torch.nn.utils.clip_grad_norm_
    assert clip is not restored and restored.__module__.startswith("torch"), "torch's clip_grad_norm_ was not put back"
    for name, p in ctx.model.named_parameters():
        float(p.sum())  # ordinary tensors again
    sgd = torch.optim.SGD(ctx.model.parameters(), lr=0.0)
    sgd.step()  # the engine's step pre-hook is gone with the engine


CHECKS = [check_train, check_read_right_after_the_step, check_evicted_between_steps, check_touch_every_parameter,
          check_write_in_place,
          check_model_state_dict, check_load_state_dict, check_save_pretrained, check_gathered_writable,
          check_foreign_optimizer_refused, check_clip_value_refused, check_refused_optimizer_flags,
          check_peak_counters_kept, check_close_gives_buffers_back]


def main() -> int:
    scenario, device = sys.argv[1], sys.argv[2]
    rank, world_size = 0, 1
    if len(sys.argv) > 3:
        rank, world_size, port = int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
        torch.distributed.init_process_group("gloo" if device == "sim" else "nccl",
                                             init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    if device == "cuda":
        torch.cuda.set_device(rank)
        torch.cuda.reset_peak_memory_stats()
    ctx = Context(scenario, device, rank, world_size)
    for check in CHECKS:
        name = check.__name__[len("check_"):]
        print(f"BEGIN {name}", flush=True)
        try:
            check(ctx)
        except Exception as e:  # noqa: BLE001 - reported, the next check runs
            print(f"FAIL {name}: {type(e).__name__}: {e}\n{traceback.format_exc()}", flush=True)
            if ctx.engine is None:
                break
        else:
            print(f"PASS {name}", flush=True)
    print("DONE", flush=True)
    if world_size > 1:
        torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
