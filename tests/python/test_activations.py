"""Activations planned by the engine: `activation_offload="on"` (checkpointed blocks' kept inputs to
host memory and back) and `activation_checkpointing="on"` (the engine checkpoints the model's
blocks itself). Both must give the same bits as "off": the project's GPT and transformers' Llama
(its own gradient checkpointing, or the engine's), under torch's `save_on_cpu` and HF's
`offload=True` (then the engine offloads nothing itself), with an in-place write to an offloaded
input refused as autograd refuses it. On cuda, the device peak falls with offload on.

The models are tiny, so the offload threshold (1 MiB) is lowered to a byte here.
"""

import dataclasses
import inspect

import pytest
import torch

from conftest import DEVICES
from parity_utils import torch_device

import gemini_ext as gx
from gemini_ext._engine import activation_offload, activation_planner
from gemini_ext.models import GPT, GPTConfig, checkpoint_blocks

transformers = pytest.importorskip("transformers")

STEPS, BATCH, SEQ = 3, 4, 16
GPT_SMALL = GPTConfig(vocab_size=128, max_seq_len=SEQ, d_model=32, n_layers=3, n_heads=4, qkv_bias=False)


@pytest.fixture(autouse=True)
def _offload_everything(monkeypatch):
    monkeypatch.setattr(activation_offload, "MIN_OFFLOAD_BYTES", 1)


def _gpt(checkpointed: bool, **fields):
    torch.manual_seed(0)
    model = GPT(dataclasses.replace(GPT_SMALL, **fields))
    if checkpointed:
        checkpoint_blocks(model)
    return model


def _llama(hf_checkpointing: bool, **enable_kwargs):
    cfg = transformers.LlamaConfig(vocab_size=128, max_position_embeddings=64, use_cache=False, hidden_size=32,
                                   intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                                   num_key_value_heads=2)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    if hf_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False}, **enable_kwargs)
    model.train()
    return model


def _loss(model, x):
    if isinstance(model, GPT):
        return model(x, x)
    return model(input_ids=x, labels=x).loss


def _train(model, device, outer=None, **fields):
    cfg = gx.GeminiConfig(device=device, precision="fp32", chunk_config_dict={"chunk_size": 4096}, **fields)
    dev = torch_device(device)
    losses = []
    with gx.enable(model, cfg) as engine:
        opt = engine.optimizer(torch.optim.AdamW, lr=1e-3)
        for step in range(STEPS):
            x = torch.randint(0, 128, (BATCH, SEQ), generator=torch.Generator().manual_seed(step)).to(dev)
            if outer is not None:
                with outer():
                    loss = _loss(model, x)
            else:
                loss = _loss(model, x)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        stats = engine.stats()["activations"]
    return losses, [p.detach().cpu().clone() for p in model.parameters()], stats


def _same_bits(a, b):
    assert a[0] == b[0], (a[0], b[0])
    assert all(torch.equal(x, y) for x, y in zip(a[1], b[1]))


@pytest.mark.parametrize("device", DEVICES)
def test_gpt_with_the_engines_checkpointing_and_offload_matches_plain_training_bit_for_bit(device):
    plain = _train(_gpt(False, loss_chunk_tokens=16), device)
    planned = _train(_gpt(False, loss_chunk_tokens=16), device, activation_offload="on", activation_checkpointing="on")
    _same_bits(plain, planned)
    ck, off = planned[2]["checkpointing"], planned[2]["offload"]
    assert ck["module"] == "blocks" and ck["blocks"] == 3 and ck["checkpointed_calls"] == 3 * STEPS, ck
    # every block's input, every step; the loss's four checkpointed pieces keep theirs
    assert off["offloaded"] == 3 * STEPS and off["kept"] == 0, off
    assert off["host"]["in_use_bytes"] == 0 and off["host"]["reserved_bytes"] > 0, off  # all given back, kept for reuse
    assert plain[2] == {"checkpointing": None, "offload": None, "plan": None}


@pytest.mark.parametrize("device", DEVICES)
def test_a_model_that_checkpoints_itself_is_left_to_do_so(device):
    own = _train(_gpt(True), device)
    both = _train(_gpt(True), device, activation_offload="on", activation_checkpointing="on")
    _same_bits(own, both)
    ck = both[2]["checkpointing"]
    assert ck["checkpointed_calls"] == 0 and ck["calls_left_to_the_model"] == 3 * STEPS, ck
    assert both[2]["offload"]["offloaded"] == 3 * STEPS  # its own checkpoints' inputs go to the host


@pytest.mark.parametrize("device", DEVICES)
def test_llama_offload_under_hf_checkpointing_matches_off(device):
    off = _train(_llama(True), device)
    on = _train(_llama(True), device, activation_offload="on")
    _same_bits(off, on)
    stats = on[2]["offload"]
    # each decoder layer's hidden states; HF binds the other inputs (rotary table, mask) as keywords,
    # which the checkpoint keeps in its closure rather than saving
    assert stats["offloaded"] == 3 * STEPS and stats["shared"] == 0, stats


class _SharedTable(torch.nn.Module):
    """Checkpointed blocks that all get one table as a positional input."""

    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(3))
        self.register_buffer("table", torch.linspace(0, 1, 8))

    def forward(self, x):
        table = self.table * 1.0  # one tensor, computed once per forward
        for block in self.blocks:
            x = torch.utils.checkpoint.checkpoint(lambda h, t, b=block: b(h) * t, x, table, use_reentrant=False)
        return x.square().sum()


def test_one_tensor_kept_by_several_blocks_goes_to_the_host_once():
    def run(mode):
        torch.manual_seed(0)
        model = _SharedTable()
        with gx.enable(model, gx.GeminiConfig(device="sim", precision="fp32", activation_offload=mode)) as engine:
            opt = engine.optimizer(torch.optim.SGD, lr=0.1)
            for _ in range(2):
                model(torch.randn(4, 8, generator=torch.Generator().manual_seed(1)) + 0).backward()
                opt.step()
                opt.zero_grad()
            stats = engine.stats()["activations"]["offload"]
        return [p.detach().clone() for p in model.parameters()], stats

    off, _ = run("off")
    on, stats = run("on")
    assert all(torch.equal(a, b) for a, b in zip(off, on))
    # per step: three block inputs and the table once; the table's two other saves share it
    assert stats["offloaded"] == 2 * 4 and stats["shared"] == 2 * 2, stats


@pytest.mark.parametrize("device", DEVICES)
def test_llama_under_the_engines_checkpointing_matches_hf_checkpointing(device):
    hf = _train(_llama(True), device)
    engine = _train(_llama(False), device, activation_checkpointing="on", activation_offload="on")
    _same_bits(hf, engine)
    ck = engine[2]["checkpointing"]
    assert ck["module"] == "model.layers" and ck["checkpointed_calls"] == 3 * STEPS, ck
    both = _train(_llama(True), device, activation_checkpointing="on")
    left = both[2]["checkpointing"]  # no second checkpoint: every call (recomputes too) left to HF's
    assert left["checkpointed_calls"] == 0 and left["calls_left_to_the_model"] >= 3 * STEPS, left


@pytest.mark.parametrize("device", DEVICES)
def test_torch_save_on_cpu_around_the_forward_keeps_working_and_nothing_goes_twice(device):
    off = _train(_llama(True), device)
    outer = _train(_llama(True), device, outer=torch.autograd.graph.save_on_cpu, activation_offload="on")
    _same_bits(off, outer)
    stats = outer[2]["offload"]
    assert stats["forwards_under_outer_hooks"] == STEPS and stats["offloaded"] == 0, stats


@pytest.mark.cuda  # HF's offload pins host memory, which torch offers only with an accelerator
@pytest.mark.parametrize("device", ["cuda"])
def test_hf_offload_true_keeps_working_and_the_engine_offloads_nothing_itself(device):
    if "offload" not in inspect.signature(transformers.PreTrainedModel._set_gradient_checkpointing).parameters and \
            "offload" not in inspect.signature(getattr(transformers.PreTrainedModel, "_activation_checkpointing_enable",
                                                       lambda: None)).parameters:
        pytest.skip(f"transformers {transformers.__version__} has no gradient checkpointing offload")
    off = _train(_llama(True), device)
    hf = _train(_llama(True, offload=True), device, activation_offload="on")
    _same_bits(off, hf)
    assert hf[2]["offload"]["offloaded"] == 0, hf[2]  # HF's save_on_cpu took the checkpoints' inputs


@pytest.mark.parametrize("device", DEVICES)
def test_auto_keeps_every_block_where_the_chunks_leave_room(device):
    plain = _train(_gpt(False), device)
    auto = _train(_gpt(False), device, activation_checkpointing="auto", activation_offload="on")
    _same_bits(plain, auto)
    plan, ck = auto[2]["plan"], auto[2]["checkpointing"]
    assert plan["decided"] and plan["choices"] == ["keep"] * 3 and plan["fits"], plan
    assert plan["room_bytes"] > plan["planned_device_bytes"] > 0, plan
    # the measured forward: block 0 kept (its activations counted), the others checkpointed and offloaded
    assert ck["checkpointed_calls"] == 2 and ck["kept_calls"] == 1 + 3 * (STEPS - 1), ck
    assert auto[2]["offload"]["offloaded"] == 2, auto[2]["offload"]


@pytest.mark.parametrize("offload", ["off", "on"])
def test_auto_recomputes_and_offloads_what_the_room_cannot_hold(monkeypatch, offload):
    """The room is set: none (every block recomputed, or offloaded where offload is on) and room
    for all but about one block's activations (one block goes)."""
    plain = _train(_gpt(False), "sim")
    monkeypatch.setattr(activation_planner.ActivationPlanner, "room_bytes", lambda self, warm: 0)
    with pytest.warns(RuntimeWarning, match="blocks need .* beyond the 0 B that the chunks leave"):
        none = _train(_gpt(False), "sim", activation_checkpointing="auto", activation_offload=offload)
    _same_bits(plain, none)
    goes = "offload" if offload == "on" else "recompute"
    assert none[2]["plan"]["choices"] == [goes] * 3 and not none[2]["plan"]["fits"], none[2]["plan"]
    if offload == "on":
        assert none[2]["offload"]["offloaded"] == 3 * STEPS - 1, none[2]["offload"]  # block 0 kept while measured
    # room for all three blocks' activations less a byte: a recomputed block's activations come back
    # during backward (the working set), so two blocks must go for one to be kept
    monkeypatch.setattr(activation_planner.ActivationPlanner, "room_bytes",
                        lambda self, warm: gx._C.activation_device_bytes(self.measured, ["keep"] * 3) - 1)
    some = _train(_gpt(False), "sim", activation_checkpointing="auto", activation_offload=offload)
    _same_bits(plain, some)
    plan = some[2]["plan"]  # which block stays follows the measured forward times
    assert sorted(plan["choices"]) == sorted([goes, goes, "keep"]) and plan["fits"], plan


def test_the_plan_offloads_no_more_than_the_host_has_room_for(monkeypatch):
    """No device room and no host room beyond the reserve: the measured forward's inputs stay on
    the device (refused), the plan offloads nothing (with host room it would offload every block,
    as above) and every block recomputes from the device; the engine warns that the activations
    exceed the room."""
    from gemini_ext._engine import host_buffers

    plain = _train(_gpt(False), "sim")
    monkeypatch.setattr(activation_planner.ActivationPlanner, "room_bytes", lambda self, warm: 0)
    monkeypatch.setattr(host_buffers, "host_available_bytes", lambda ranks: host_buffers.RESERVE_BYTES)
    with pytest.warns(RuntimeWarning, match="the host has room for 0 B of offloaded inputs"):
        capped = _train(_gpt(False), "sim", activation_checkpointing="auto", activation_offload="auto")
    _same_bits(plain, capped)
    plan, offload = capped[2]["plan"], capped[2]["offload"]
    assert plan["choices"] == ["recompute"] * 3 and not plan["fits"] and plan["host_bytes"] == 0, plan
    assert offload["offloaded"] == 0 and offload["host"]["refused"] == offload["kept"] == 2, offload


def test_offload_auto_offloads_only_what_the_room_needs(monkeypatch):
    """activation_offload="auto" under the engine's checkpointing "on": every block recomputes, and
    its input goes to the host only where the room needs it (here never; with no room, every one)."""
    plain = _train(_gpt(False), "sim")
    roomy = _train(_gpt(False), "sim", activation_checkpointing="on", activation_offload="auto")
    _same_bits(plain, roomy)
    assert roomy[2]["plan"]["choices"] == ["recompute"] * 3, roomy[2]["plan"]
    assert roomy[2]["offload"]["offloaded"] == 2, roomy[2]["offload"]  # the measured forward's only
    monkeypatch.setattr(activation_planner.ActivationPlanner, "room_bytes", lambda self, warm: 0)
    tight = _train(_gpt(False), "sim", activation_checkpointing="auto", activation_offload="auto")
    _same_bits(plain, tight)
    assert tight[2]["plan"]["choices"] == ["offload"] * 3, tight[2]["plan"]
    with pytest.raises(ValueError, match="activation_offload='auto' decides per block of the engine's checkpointing"):
        gx.GeminiConfig(activation_offload="auto")


class _Writer(torch.nn.Module):
    """A checkpointed block whose input is written in place after the block's forward."""

    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(2))

    def forward(self, x):
        h = x * 2
        y = torch.utils.checkpoint.checkpoint(self.blocks[0], h, use_reentrant=False)
        h.mul_(3)
        return (self.blocks[1](y) + h).sum()


@pytest.mark.parametrize("mode", ["off", "on"])
def test_an_in_place_write_to_a_kept_input_is_refused_as_autograd_refuses_it(mode):
    torch.manual_seed(0)
    model = _Writer()
    cfg = gx.GeminiConfig(device="sim", precision="fp32", activation_offload=mode)
    with gx.enable(model, cfg):
        loss = model(torch.randn(4, 8, requires_grad=True))
        with pytest.raises(RuntimeError, match="inplace operation"):
            loss.backward()


def test_activation_fields_are_checked():
    with pytest.raises(ValueError, match="activation_offload: expected one of"):
        gx.GeminiConfig(activation_offload="yes")
    with pytest.raises(ValueError, match="activation_checkpointing: expected one of"):
        gx.GeminiConfig(activation_checkpointing=True)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 4))
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match="no nn.ModuleList of two or more blocks"):
        gx.enable(model, gx.GeminiConfig(device="sim", activation_checkpointing="on"))
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))  # refused before anything moved
    assert gx.enable(model, gx.GeminiConfig(device="sim", precision="fp32")).close() is None  # still usable


def test_closing_gives_the_blocks_their_own_forward_back():
    model = _gpt(False)
    with gx.enable(model, gx.GeminiConfig(device="sim", precision="fp32", activation_checkpointing="on")):
        assert all("forward" in block.__dict__ for block in model.blocks)
    assert not any("forward" in block.__dict__ for block in model.blocks)


@pytest.mark.cuda
def test_offload_lowers_the_device_peak_on_cuda():
    cfg = GPTConfig(vocab_size=512, max_seq_len=1024, d_model=1024, n_layers=12, n_heads=8)
    kept_input_bytes = 4 * 1024 * 1024 * 2 * cfg.n_layers  # 4 x 1024 tokens x 1024 wide, bf16, per block

    def peak(mode):
        torch.manual_seed(0)
        model = GPT(cfg)
        x = torch.randint(0, 512, (4, 1024), device="cuda")
        with gx.enable(model, gx.GeminiConfig(device="cuda", activation_offload=mode,
                                              activation_checkpointing="on")) as engine:
            opt = engine.optimizer(torch.optim.AdamW, lr=1e-4)
            for step in range(2):
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                model(x, x).backward()
                opt.step()
                opt.zero_grad()
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated(), engine.stats()["activations"]["offload"]

    off, _ = peak("off")
    on, stats = peak("on")
    assert stats["offloaded"] >= cfg.n_layers, stats
    assert off - on > kept_input_bytes // 2, (off, on, kept_input_bytes)


def test_the_per_block_plan_is_the_cores():
    """_C.plan_activations (core/activation_plan.h, tested there): eight alike blocks of 10 MiB
    with 1 MiB inputs and a link that hides the copies, in 50 MiB."""
    mib = 2**20
    plan = gx._C.plan_activations([(10 * mib, mib, 0.010, 0.020)] * 8, 50 * mib, 25e9)
    # five blocks checkpointed (ties: the earlier first); their inputs fit, so none goes to the host
    assert plan["choices"] == ["recompute"] * 5 + ["keep"] * 3 and plan["fits"], plan
    assert plan["device_bytes"] == 45 * mib and plan["host_bytes"] == 0 and plan["added_seconds"] == pytest.approx(0.05)
    tight = gx._C.plan_activations([(10 * mib, mib, 0.010, 0.020)] * 8, 15 * mib, 25e9, allow_keep=False,
                                   host_room_bytes=3 * mib)
    assert tight["choices"].count("offload") == 3 and not tight["fits"], tight  # the host's room, no more
    with pytest.raises(Exception, match="in_flight must be >= 1"):
        gx._C.plan_activations([(mib, mib, 0.0, 0.0)], mib, 1e9, in_flight=0)
