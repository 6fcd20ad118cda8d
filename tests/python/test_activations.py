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
import re

import pytest
import torch

from conftest import DEVICES
from parity_utils import torch_device

import gemini_ext as gx
from gemini_ext._engine.activations import offload as activation_offload, planner as activation_planner
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


def _llama(hf_checkpointing: bool, use_cache=False, **enable_kwargs):
    cfg = transformers.LlamaConfig(vocab_size=128, max_position_embeddings=64, use_cache=use_cache, hidden_size=32,
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
    block_input_bytes = BATCH * SEQ * GPT_SMALL.d_model * 4  # fp32 hidden states
    assert off["offloaded_bytes"] == 3 * STEPS * block_input_bytes, off  # bytes moved, not only equal results
    host = off["host"]
    assert host["in_use_bytes"] == 0 and host["reserved_bytes"] == host["peak_in_use_bytes"] > 0, host
    assert host["peak_in_use_bytes"] >= 3 * block_input_bytes, host  # a forward's three inputs at once
    assert host["upstream_allocations"] == 3, host  # the first step's buffers, reused by the next steps
    assert plain[2] == {"checkpointing": None, "offload": None, "plan": None, "torch_cap_bytes": None,
                        "warm_up": None}


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


class _TableBlock(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, h, table):
        return self.linear(h) * table


class _SharedTable(torch.nn.Module):
    """Blocks that all get one table as a positional input."""

    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(_TableBlock() for _ in range(3))
        self.register_buffer("table", torch.linspace(0, 1, 8))

    def forward(self, x):
        table = self.table * 1.0  # one tensor, computed once per forward
        for block in self.blocks:
            x = block(x, table)
        return x.square().sum()


def _run_table(**fields):
    torch.manual_seed(0)
    model = _SharedTable()
    with gx.enable(model, gx.GeminiConfig(device="sim", precision="fp32", **fields)) as engine:
        opt = engine.optimizer(torch.optim.SGD, lr=0.1)
        for _ in range(2):
            model(torch.randn(4, 8, generator=torch.Generator().manual_seed(1)) + 0).backward()
            opt.step()
            opt.zero_grad()
        stats = engine.stats()["activations"]["offload"]
    return [p.detach().clone() for p in model.parameters()], stats


def test_one_tensor_kept_by_several_blocks_goes_to_the_host_once():
    off, _ = _run_table(activation_checkpointing="on")
    on, stats = _run_table(activation_checkpointing="on", activation_offload="on")
    assert all(torch.equal(a, b) for a, b in zip(off, on))
    # per step: three block inputs and the table once; the table's two other saves share it
    assert stats["offloaded"] == 2 * 4 and stats["shared"] == 2 * 2, stats


class _OwnCheckpoints(_SharedTable):
    """Calls torch.utils.checkpoint in its own code, where the engine takes no part."""

    def forward(self, x):
        for block in self.blocks:
            x = torch.utils.checkpoint.checkpoint(block, x, self.table, use_reentrant=False)
        return x.square().sum()


def test_checkpoints_the_engine_cannot_see_are_said_not_offloaded_in_silence():
    torch.manual_seed(0)
    model = _OwnCheckpoints()
    with gx.enable(model, gx.GeminiConfig(device="sim", precision="fp32", activation_offload="on")) as engine:
        with pytest.warns(RuntimeWarning, match="made no checkpoint call the engine takes part in"):
            model(torch.randn(4, 8)).backward()
        assert engine.stats()["activations"]["offload"]["offloaded"] == 0


def test_enable_refuses_offload_where_torch_saves_a_checkpoints_inputs_otherwise(monkeypatch):
    """The mechanism check: a checkpoint that saves what its region computes where the engine's
    hooks see it (here: no checkpoint at all) is refused at enable(), naming the torch version."""
    from gemini_ext._engine.activations import calls

    monkeypatch.setattr(calls.torch.utils.checkpoint, "checkpoint", lambda fn, *args, **kwargs: fn(*args))
    monkeypatch.setattr(calls, "_checked", [])  # checked once per process: again, under this torch
    model = _gpt(False)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match=re.escape(f"torch {torch.__version__} saved 3 tensors there")):
        gx.enable(model, gx.GeminiConfig(device="sim", precision="fp32", activation_offload="on",
                                         activation_checkpointing="on"))
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))


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
    assert plan["device_free_bytes"] > plan["planned_device_bytes"] > 0, plan
    # the measured forward: every block checkpointed and offloaded (block 0's activations counted by a
    # forward of its own, dropped at once), then every block kept
    assert ck["checkpointed_calls"] == 3 and ck["kept_calls"] == 3 * (STEPS - 1), ck
    assert auto[2]["offload"]["offloaded"] == 3, auto[2]["offload"]


@pytest.mark.parametrize("checkpointing", ["on", "auto"])
def test_a_llama_left_at_use_cache_true_trains_as_without_the_engines_checkpointing(checkpointing):
    # transformers' default: the decoder layers append to a KV cache in training too; the forward
    # that measures block 0 must not add its keys to the cache the real call uses
    off = _train(_llama(False, use_cache=True), "sim")
    planned = _train(_llama(False, use_cache=True), "sim", activation_checkpointing=checkpointing)
    _same_bits(off, planned)
    assert planned[2]["checkpointing"]["checkpointed_calls"] >= 3, planned[2]


def test_offload_auto_over_a_model_that_checkpoints_no_block_says_nothing_is_planned():
    # activation_offload="auto" without the engine's checkpointing plans the blocks the model checkpoints
    # itself; a model that checkpoints none gets the warning after its first iteration, once
    with pytest.warns(RuntimeWarning, match="this iteration checkpointed none") as caught:
        _, _, stats = _train(_gpt(False), "sim", activation_offload="auto")
    assert sum("checkpointed none" in str(w.message) for w in caught) == 1
    assert stats["offload"]["offloaded"] == 0 and not stats["plan"]["decided"], stats


def _device_free_bytes_for(choices):
    """A room of exactly what `choices` need on the device (the measured blocks' plan figure)."""
    return lambda self, warm: gx._C.activation_device_bytes(self.measured, choices, activation_offload.LOOKAHEAD)


@pytest.mark.parametrize("offload", ["off", "on"])
def test_auto_recomputes_and_offloads_what_the_room_cannot_hold(monkeypatch, offload):
    """The room is set: the least the blocks allow (every block recomputed, or offloaded where offload
    is on) and room for all but about one block's activations (one block goes)."""
    plain = _train(_gpt(False), "sim")
    goes = "offload" if offload == "on" else "recompute"
    monkeypatch.setattr(activation_planner.ActivationPlanner, "device_free_bytes", _device_free_bytes_for([goes] * 3))
    least = _train(_gpt(False), "sim", activation_checkpointing="auto", activation_offload=offload)
    _same_bits(plain, least)
    assert least[2]["plan"]["choices"] == [goes] * 3 and least[2]["plan"]["fits"], least[2]["plan"]
    if offload == "on":
        assert least[2]["offload"]["offloaded"] == 3 * STEPS, least[2]["offload"]
    # room for all three blocks' activations less a byte: a recomputed block's activations come back
    # during backward (the working set), so two blocks must go for one to be kept
    monkeypatch.setattr(activation_planner.ActivationPlanner, "device_free_bytes",
                        lambda self, warm: gx._C.activation_device_bytes(self.measured, ["keep"] * 3) - 1)
    some = _train(_gpt(False), "sim", activation_checkpointing="auto", activation_offload=offload)
    _same_bits(plain, some)
    plan = some[2]["plan"]  # which block stays follows the measured forward times
    assert sorted(plan["choices"]) == sorted([goes, goes, "keep"]) and plan["fits"], plan


def test_where_no_plan_fits_the_next_forward_says_by_how_much_and_what_would_fit(monkeypatch):
    """The budget is kept, not exceeded with a warning: the forward after the measured one raises,
    naming the shortfall, the tokens per step that would fit and the budget that would (on cuda;
    on sim, whose device does not hold torch's activations, a warning unless made to refuse)."""
    monkeypatch.setattr(activation_planner.ActivationPlanner, "device_free_bytes", lambda self, warm: 0)
    with pytest.warns(RuntimeWarning, match="more than the 0 B that the chunks leave"):
        _train(_gpt(False), "sim", activation_checkpointing="auto", activation_offload="on")
    monkeypatch.setattr(activation_planner.ActivationPlanner, "REFUSING_DEVICES", ("cuda", "sim"))
    model = _gpt(False)
    cfg = gx.GeminiConfig(device="sim", precision="fp32", chunk_config_dict={"chunk_size": 4096},
                          activation_checkpointing="auto", activation_offload="on")
    x = torch.randint(0, 128, (BATCH, SEQ))
    with gx.enable(model, cfg) as engine:
        opt = engine.optimizer(torch.optim.AdamW, lr=1e-3)
        model(x, x).backward()  # the measured forward: every block offloaded, the least the plan allows
        opt.step()
        opt.zero_grad()
        with pytest.raises(RuntimeError, match=rf"more than the 0 B that the chunks leave .* at most about 0 tokens "
                                               rf"per step \(this step had {BATCH * SEQ}\), raise gpu_memory_limit by"):
            model(x, x)
        assert not engine.stats()["activations"]["plan"]["fits"]


def test_the_plan_offloads_no_more_than_the_host_has_room_for(monkeypatch):
    """Room on the device for every block recomputed, and no host room beyond the reserve: the
    measured forward's inputs stay on the device (refused) and the plan offloads nothing."""
    from gemini_ext._engine.activations import host_buffers

    plain = _train(_gpt(False), "sim")
    monkeypatch.setattr(activation_planner.ActivationPlanner, "device_free_bytes",
                        _device_free_bytes_for(["recompute"] * 3))
    monkeypatch.setattr(host_buffers, "host_available_bytes", lambda ranks: host_buffers.RESERVE_BYTES)
    capped = _train(_gpt(False), "sim", activation_checkpointing="auto", activation_offload="auto")
    _same_bits(plain, capped)
    plan, offload = capped[2]["plan"], capped[2]["offload"]
    assert plan["choices"] == ["recompute"] * 3 and plan["fits"] and plan["host_bytes"] == 0, plan
    assert offload["offloaded"] == 0 and offload["host"]["refused"] == offload["kept"] == 3, offload


def test_offload_auto_offloads_only_what_the_room_needs(monkeypatch):
    """activation_offload="auto" under the engine's checkpointing "on": every block recomputes, and
    its input goes to the host only where the room needs it (here never; with room for no input on
    the device, every one)."""
    plain = _train(_gpt(False), "sim")
    ample = _train(_gpt(False), "sim", activation_checkpointing="on", activation_offload="auto")
    _same_bits(plain, ample)
    assert ample[2]["plan"]["choices"] == ["recompute"] * 3, ample[2]["plan"]
    assert ample[2]["offload"]["offloaded"] == 3, ample[2]["offload"]  # the measured forward's only
    monkeypatch.setattr(activation_planner.ActivationPlanner, "device_free_bytes",
                        _device_free_bytes_for(["offload"] * 3))
    tight = _train(_gpt(False), "sim", activation_checkpointing="auto", activation_offload="auto")
    _same_bits(plain, tight)
    assert tight[2]["plan"]["choices"] == ["offload"] * 3, tight[2]["plan"]
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    with pytest.raises(ValueError, match="activation_offload='auto': the model has no nn.ModuleList"):
        gx.enable(model, gx.GeminiConfig(device="sim", activation_offload="auto"))


class _Writer(torch.nn.Module):
    """Checkpointed blocks; the first one's input is written in place after the block's forward."""

    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(2))

    def forward(self, x):
        h = x * 2
        y = self.blocks[0](h)
        h.mul_(3)
        return (self.blocks[1](y) + h).sum()


@pytest.mark.parametrize("mode", ["off", "on"])
def test_an_in_place_write_to_a_kept_input_is_refused_as_autograd_refuses_it(mode):
    torch.manual_seed(0)
    model = _Writer()
    cfg = gx.GeminiConfig(device="sim", precision="fp32", activation_offload=mode, activation_checkpointing="on")
    with gx.enable(model, cfg):
        with pytest.raises(RuntimeError, match="inplace"):  # at the write (a hooked module's input) or at backward
            model(torch.randn(4, 8, requires_grad=True)).backward()


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
                                   host_free_bytes=3 * mib)
    assert tight["choices"].count("offload") == 3 and not tight["fits"], tight  # the host's room, no more
    with pytest.raises(Exception, match="in_flight must be >= 1"):
        gx._C.plan_activations([(mib, mib, 0.0, 0.0)], mib, 1e9, in_flight=0)


def _step_within_limit(engine, opt, loss_of, limit: int, step: int) -> None:
    """One training step on cuda; then the chunks' device peak, torch's reserved peak and the memory
    outside torch of that step together within `limit`."""
    from gemini_ext import allocator
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    loss_of().backward()
    opt.step()
    opt.zero_grad()
    torch.cuda.synchronize()
    chunk_peak = engine.internal.chunks.tier_bytes("device")["peak"]
    outside = allocator.outside_torch_bytes(0, whole_device=False)
    assert torch.cuda.max_memory_reserved() + chunk_peak + outside <= limit, (
        step, torch.cuda.max_memory_reserved(), chunk_peak, outside)


@pytest.mark.cuda
def test_the_chunks_and_torchs_reserved_memory_stay_within_the_limit_from_the_first_iteration():
    """auto with activations planned under a gpu_memory_limit that cannot hold every block's
    activations beside the chunks: in every iteration, the first included, the chunks' device peak
    plus torch's reserved peak plus the memory outside torch (the CUDA context, cuBLAS's workspace)
    stay within the limit, and so does the process's whole device memory as the driver counts it
    (NVML's per-process figure; the device's use where the driver does not tell, this process alone
    on the test machine): a 2.5 GiB limit is what a 2.5 GiB card holds. The plan leaves the
    activations fewer."""
    from gemini_ext import allocator
    cfg = GPTConfig(vocab_size=512, max_seq_len=2048, d_model=1024, n_layers=8, n_heads=8)
    limit = 5 * 2**29
    torch.cuda.empty_cache()  # what earlier tests of this process cached is not this one's
    torch.manual_seed(0)
    model = GPT(cfg)
    x = torch.randint(0, 512, (4, 2048), device="cuda")
    config = gx.GeminiConfig(device="cuda", gpu_memory_limit=limit, activation_checkpointing="auto",
                             activation_offload="auto")
    with gx.enable(model, config) as engine:
        opt = engine.optimizer(torch.optim.AdamW, lr=1e-4)
        for step in range(3):
            _step_within_limit(engine, opt, lambda: model(x, x), limit, step)
            free, total = torch.cuda.mem_get_info()
            process = allocator.process_device_bytes(0)
            assert (process if process is not None else total - free) <= limit, (step, process, total - free)
        stats = engine.stats()["activations"]
    assert stats["plan"]["fits"] and stats["plan"]["keep"] < cfg.n_layers, stats["plan"]
    assert stats["torch_cap_bytes"] is not None and stats["warm_up"]["foreseen_bytes"] > 0, stats


@pytest.mark.parametrize("fields", [{"activation_offload": "on"}, {"activation_checkpointing": "auto",
                                                                   "activation_offload": "auto"}])
def test_the_engine_goes_when_its_block_ends_without_the_garbage_collector(fields):
    """Nothing of the activations keeps the chunks alive after close(): not the measured forward of
    block 0 (a saved output tied to its own node), not the mechanism check's frames, not the plan."""
    import gc
    import weakref

    gc.disable()
    try:
        model = _gpt(False)
        with gx.enable(model, gx.GeminiConfig(device="sim", precision="fp32", **fields)) as engine:
            chunks = weakref.ref(engine.internal.chunks)
            opt = engine.optimizer(torch.optim.SGD, lr=0.1)
            for step in range(2):
                x = torch.randint(0, 128, (BATCH, SEQ))
                model(x, x).backward()
                opt.step()
                opt.zero_grad()
        del engine, opt
        assert chunks() is None
    finally:
        gc.enable()


def test_the_room_counts_the_memory_outside_torch_as_the_placement_does():
    """The room the chunks leave (activations/budget.py) and the placement's chunk budget
    (policies.measured_chunk_budget) count the device's memory outside torch alike, on the whole
    device and under a gpu_memory_limit (what a card of that size holds: the CUDA context is on
    that card too). 40 GiB of an 80 GiB device, 1.5 GiB outside torch, a 4 GiB peak that was the
    measured forward's own, nothing reserved beyond it, 20 GiB of chunks: 20 - 1.5 GiB of room; the
    whole device: 60 - 1.5 GiB."""
    from gemini_ext._engine.activations import budget
    from gemini_ext.placement.policies import Measurements, measured_chunk_budget
    gib = 2**30
    figures = {"non_model_peak_bytes": 4 * gib, "non_model_reserved_bytes": 4 * gib,
               "device_other_bytes": 3 * gib // 2}
    assert budget.device_free_bytes(40 * gib, 20 * gib, figures, 4 * gib) == 20 * gib - 3 * gib // 2
    assert budget.device_free_bytes(80 * gib, 20 * gib, figures, 4 * gib) == 60 * gib - 3 * gib // 2
    for capacity, outside in ((40 * gib, 3 * gib // 2), (80 * gib, 3 * gib // 2)):
        m = Measurements(device_kind="cuda", allocator_mode="default", device_capacity_bytes=capacity,
                         set_shard_bytes=(gib,), trainable=(True,), set_bytes_per_element=14, compute_itemsize=2,
                         sharded=False, world_size=1, device_total_bytes=80 * gib, **figures)
        chunk_budget, _ = measured_chunk_budget(m, "auto")
        assert chunk_budget == capacity - 4 * gib - gib // 4 - outside  # peak, 1/16 of it as headroom, outside


def test_the_losss_backward_is_foreseen_from_the_head_and_the_largest_output():
    """What the first backward needs beyond the forward's end for the head and the loss: as much as the
    forward allocated after its last block (the gradients mirror what the head and the loss saved),
    or, where the output holds no loss (it is computed after the forward), 12 bytes per element of the
    largest floating output (the fp32 copy, what cross-entropy saves, the gradient)."""
    from gemini_ext._engine.activations import budget
    from gemini_ext._engine.activations.manager import _largest_floating_output
    logits = torch.zeros(2, 8, 100, dtype=torch.bfloat16)
    loss = torch.zeros((), requires_grad=True)
    out = transformers.modeling_outputs.CausalLMOutputWithPast(loss=loss, logits=logits)
    assert _largest_floating_output(out) == (1600, True)
    assert _largest_floating_output((logits, torch.zeros(5, dtype=torch.long))) == (1600, False)
    assert _largest_floating_output(loss) == (1, True) and _largest_floating_output(torch.zeros(())) == (1, False)
    assert budget.foreseen_loss_bytes(10_000, 1600, True) == 10_000
    assert budget.foreseen_loss_bytes(10_000, 1600, False) == 1600 * 12
    assert budget.foreseen_loss_bytes(30_000, 1600, False) == 30_000


@pytest.mark.cuda
def test_the_first_backward_has_room_for_the_gradient_of_large_logits():
    """A transformers Llama whose logits (4 x 2048 tokens x 32,000, fp32 in the loss) outweigh its
    blocks' activations, under a gpu_memory_limit its chunks would otherwise fill: the first forward
    foresees the loss's backward from what it allocated after its last block, lowers the chunks'
    budget before the backward, and the first iteration trains within the limit rather than stop in
    torch's out-of-memory at the engine's cap (the fp32 logits' gradient)."""
    cfg = transformers.LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2752, num_hidden_layers=8,
                                   num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=2048,
                                   use_cache=False)
    cfg._attn_implementation = "sdpa"
    torch.cuda.empty_cache()
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    limit = 8 * 2**30
    x = torch.randint(0, 32000, (4, 2048), device="cuda")
    config = gx.GeminiConfig(device="cuda", gpu_memory_limit=limit, activation_checkpointing="auto",
                             activation_offload="auto")
    with gx.enable(model, config) as engine:
        opt = engine.optimizer(torch.optim.AdamW, lr=1e-4)
        for step in range(2):
            _step_within_limit(engine, opt, lambda: model(input_ids=x, labels=x).loss, limit, step)
        warm = engine.stats()["activations"]["warm_up"]
    loss = warm["loss"]
    assert loss["loss_in_output"] and loss["largest_output_elements"] == 4 * 2048 * 32000, loss
    assert loss["head_bytes"] >= 4 * 2048 * 32000 * 4, "the fp32 logits at least were allocated after the blocks"
    assert loss["foreseen_bytes"] == loss["head_bytes"], loss
