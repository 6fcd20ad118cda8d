"""The hook cases: checkpointing, tied, frozen and unused parameters,
evaluation without grad, two forwards before one backward, and what must be refused."""

import copy
import dataclasses

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

import gemini_ext as gx
from conftest import DEVICES
from gemini_ext.models import GPT, GPTConfig
from parity_utils import (LR, SMALL, WD, batch, chunk_cap, config, make_models, max_relative_difference, torch_device,
                          train_gemini, train_reference, train_step)


class Checkpointed(nn.Module):
    def __init__(self, block, reentrant):
        super().__init__()
        self.block = block
        self.reentrant = reentrant

    def forward(self, x):
        return checkpoint(self.block, x, use_reentrant=self.reentrant)


def _checkpoint_blocks(model, reentrant):
    for i, block in enumerate(model.blocks):
        model.blocks[i] = Checkpointed(block, reentrant)
    return model


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("budget_chunks", [None, 5])
def test_non_reentrant_checkpointing_matches_plain_pytorch(device, budget_chunks):
    model, reference = make_models()
    _checkpoint_blocks(model, reentrant=False)
    _checkpoint_blocks(reference, reentrant=False)
    train_reference(reference, 8, torch_device(device))
    kw = {}
    if budget_chunks:
        kw.update(chunk_cap(device, budget_chunks * 4096 * 4))
    _, stats = train_gemini(model, 8, config(device, **kw))
    assert max(max_relative_difference(model, reference).values()) <= 1e-5
    if budget_chunks:
        assert stats["counters"]["evictions"] > 0


@pytest.mark.parametrize("device", DEVICES)
def test_the_loss_in_checkpointed_token_chunks_matches_plain_pytorch(device):
    """GPTConfig.loss_chunk_tokens: the head and the loss over 24 of the batch's 64 tokens at a
    time (24, 24, 16), each piece checkpointed, so the head runs three times in forward and again
    in backward. In plain PyTorch the loss and gradients equal the loss over the whole batch at
    once; under the engine, with blocks checkpointed too and chunks evicted, training matches
    plain PyTorch of the same model. A negative size is refused."""
    chunked = dataclasses.replace(SMALL, loss_chunk_tokens=24)
    whole, _ = make_models()
    pieces, _ = make_models(chunked)
    x, y = batch(SMALL, 0, torch.device("cpu"))
    y = y.clone()  # a view of the inputs' storage
    y[0, :3] = -100  # ignored targets stay out of the mean, as in F.cross_entropy
    losses = [m(x, y) for m in (whole, pieces)]
    for loss in losses:
        loss.backward()
    assert losses[1].item() == pytest.approx(losses[0].item(), rel=1e-6)
    for (name, a), b in zip(whole.named_parameters(), pieces.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-5, atol=1e-7, msg=name)

    model, reference = make_models(chunked)
    _checkpoint_blocks(model, reentrant=False)
    _checkpoint_blocks(reference, reentrant=False)
    train_reference(reference, 8, torch_device(device))
    _, stats = train_gemini(model, 8, config(device, **chunk_cap(device, 5 * 4096 * 4)))
    assert max(max_relative_difference(model, reference).values()) <= 1e-5
    assert stats["counters"]["evictions"] > 0
    with pytest.raises(ValueError, match="loss_chunk_tokens must be an int >= 0"):
        GPT(dataclasses.replace(SMALL, loss_chunk_tokens=-1))


def test_reentrant_checkpointing_is_refused_clearly():
    model, _ = make_models()
    _checkpoint_blocks(model, reentrant=True)
    with gx.enable(model, config("sim")):
        x, y = batch(model.cfg, 0, "cpu")
        loss = model(x, y)
        with pytest.raises(RuntimeError, match="use_reentrant=False"):
            loss.backward()


def test_compiled_autograd_is_refused_clearly(monkeypatch):
    from torch._dynamo import compiled_autograd
    model, _ = make_models()
    with gx.enable(model, config("sim")):
        x, y = batch(model.cfg, 0, "cpu")
        loss = model(x, y)
        monkeypatch.setattr(compiled_autograd, "compiled_autograd_enabled", True)
        with pytest.raises(RuntimeError, match="compiled autograd"):
            loss.backward()


@pytest.mark.parametrize("device", DEVICES)
def test_tied_weights_share_one_slot_and_stay_tied(device):
    cfg = GPTConfig(vocab_size=128, max_seq_len=32, d_model=32, n_layers=1, n_heads=4, qkv_bias=False,
                    tie_embeddings=True)
    model, reference = make_models(cfg)
    shared = model.tok_emb.weight
    train_reference(reference, 6, torch_device(device))
    with gx.enable(model, config(device)) as engine:
        assert model.head.weight is model.tok_emb.weight
        assert engine.num_parameters == len(list(model.parameters()))  # counted once
        assert model.head.weight.data_ptr() == model.tok_emb.weight.data_ptr()
        opt = engine.optimizer(torch.optim.AdamW, lr=LR, weight_decay=WD)
        for step in range(6):
            x, y = batch(cfg, step, engine.compute_device)
            model(x, y).backward()
            opt.step()
            opt.zero_grad()
    assert model.tok_emb.weight is shared and model.head.weight is shared, "the same Parameter object after close"
    assert max(max_relative_difference(model, reference).values()) <= 1e-5


@pytest.mark.parametrize("device", DEVICES)
def test_frozen_parameters_stay_in_chunks_without_optimizer_state(device):
    model, reference = make_models()
    for m in (model, reference):
        m.tok_emb.weight.requires_grad_(False)
        m.blocks[0].requires_grad_(False)
    frozen_before = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    dev = torch_device(device)
    reference.to(dev)
    ref_opt = torch.optim.AdamW([p for p in reference.parameters() if p.requires_grad], lr=LR, weight_decay=WD)
    with gx.enable(model, config(device)) as engine:
        opt = engine.optimizer(torch.optim.AdamW, lr=LR, weight_decay=WD)
        idx = engine.parameter_index(model.tok_emb.weight)
        with pytest.raises(ValueError, match="frozen"):
            engine.internal.runtime.read("exp_avg", idx)
        assert model.tok_emb.weight.device.type == dev.type, "a frozen parameter lives in a chunk too"
        for step in range(6):
            train_step(model, opt, step, engine.compute_device)
            train_step(reference, ref_opt, step, dev)
        assert len(opt.state_dict()["state"]) == sum(p.requires_grad for p in model.parameters())
    for n, p in model.named_parameters():
        if n in frozen_before:
            assert torch.equal(p.detach(), frozen_before[n]), n
    assert max(max_relative_difference(model, reference).values()) <= 1e-5


class TwoBranches(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.b = nn.Linear(16, 16)
        self.c = nn.Linear(16, 4)

    def forward(self, x, use_b):
        h = torch.tanh(self.a(x))
        if use_b:
            h = h + torch.tanh(self.b(x))
        return self.c(h).pow(2).mean()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("chunk_size", [64, 4096])  # b alone in its chunk, or sharing one with a and c
def test_parameters_unused_in_a_step_are_left_untouched_like_torch(device, chunk_size):
    torch.manual_seed(0)
    model = TwoBranches()
    reference = copy.deepcopy(model)
    dev = torch_device(device)
    reference.to(dev)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=WD)
    pattern = [True, False, False, True, False, True]
    with gx.enable(model, config(device, chunk_config_dict={"chunk_size": chunk_size})) as engine:
        opt = engine.optimizer(torch.optim.AdamW, lr=1e-2, weight_decay=WD)
        for step, use_b in enumerate(pattern):
            x = torch.randn(8, 16, generator=torch.Generator().manual_seed(step))
            b_before = model.b.weight.detach().clone()
            model(x.to(engine.compute_device), use_b).backward()
            opt.step()
            opt.zero_grad()
            # read outside the hooks: the CPU steps of the overlapped optimizer must be done first
            engine.synchronize()
            if not use_b:
                assert torch.equal(model.b.weight.detach(), b_before), "unused: no decay, no moment update"
            reference(x.to(dev), use_b).backward()
            ref_opt.step()
            ref_opt.zero_grad()
        state = opt.state_dict()["state"]
        b_pos = [n for n, _ in model.named_parameters()].index("b.weight")
        assert state[b_pos]["step"].item() == sum(pattern)
        assert state[0]["step"].item() == len(pattern)
    assert max(max_relative_difference(model, reference).values()) <= 1e-5


@pytest.mark.parametrize("device", DEVICES)
def test_no_grad_and_inference_mode_evaluation_between_steps(device):
    model, reference = make_models()
    dev = torch_device(device)
    reference.to(dev)
    budget = chunk_cap(device, 5 * 4096 * 4)
    with gx.enable(model, config(device, **budget)) as engine:
        opt = engine.optimizer(torch.optim.AdamW, lr=LR, weight_decay=WD)
        ref_opt = torch.optim.AdamW(reference.parameters(), lr=LR, weight_decay=WD)
        for step in range(4):
            train_step(model, opt, step, engine.compute_device)
            train_step(reference, ref_opt, step, dev)
            ex, ey = batch(model.cfg, 100 + step, engine.compute_device)
            with torch.no_grad():
                eval_loss = model(ex, ey)
            with torch.inference_mode():
                infer_loss = model(ex, ey)
            with torch.no_grad():
                ref_eval = reference(ex.to(dev), ey.to(dev))
            assert eval_loss.item() == pytest.approx(ref_eval.item(), rel=1e-5)
            assert infer_loss.item() == pytest.approx(ref_eval.item(), rel=1e-5)
            assert not engine.internal.runtime.in_backward
    assert max(max_relative_difference(model, reference).values()) <= 1e-5


@pytest.mark.parametrize("device", DEVICES)
def test_two_forwards_before_one_backward(device):
    model, reference = make_models()
    dev = torch_device(device)
    reference.to(dev)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=LR, weight_decay=WD)
    budget = chunk_cap(device, 5 * 4096 * 4)
    with gx.enable(model, config(device, **budget)) as engine:
        opt = engine.optimizer(torch.optim.AdamW, lr=LR, weight_decay=WD)
        for step in range(4):
            (x1, y1), (x2, y2) = batch(model.cfg, 2 * step, dev), batch(model.cfg, 2 * step + 1, dev)
            (model(x1, y1) + 0.5 * model(x2, y2)).backward()
            opt.step()
            opt.zero_grad()
            (reference(x1, y1) + 0.5 * reference(x2, y2)).backward()
            ref_opt.step()
            ref_opt.zero_grad()
    assert max(max_relative_difference(model, reference).values()) <= 1e-5


@pytest.mark.parametrize("device", DEVICES)
def test_gradients_go_into_chunks_and_p_grad_stays_none(device):
    model, reference = make_models()
    dev = torch_device(device)
    reference.to(dev)
    x, y = batch(model.cfg, 0, dev)
    reference(x, y).backward()
    with gx.enable(model, config(device)) as engine:
        model(x, y).backward()
        for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
            assert p.grad is None, name
            torch.testing.assert_close(engine.grad(p), q.grad.float().cpu(), rtol=1e-5, atol=1e-7, msg=name)
        opt = engine.optimizer(torch.optim.AdamW)
        opt.zero_grad()
        assert engine.grad(model.head.weight) is None


def test_a_parameter_homed_on_the_host_is_served_from_its_host_copy_between_uses():
    model, _ = make_models()
    with gx.enable(model, config("sim", offload_param_frac=1.0)) as engine:
        p = model.blocks[0].fc1.weight
        idx = engine.parameter_index(p)
        assert engine.internal.runtime.param_binding(idx) == "host", "home on the host: no device copy between uses"
        torch.testing.assert_close(p.detach().float().cpu(), engine.state_dict()["blocks.0.fc1.weight"], rtol=0, atol=0)
        x, y = batch(model.cfg, 0, "cpu")
        seen = {}
        def look(module, args):
            seen.setdefault("binding", engine.internal.runtime.param_binding(idx))

        handle = model.blocks[0].fc1.register_forward_pre_hook(look)  # runs after the engine's pre-hook
        model(x, y).backward()
        handle.remove()
        assert seen["binding"] == "device", "fetched for its forward"
        assert engine.internal.runtime.param_binding(idx) == "host"
        assert engine.stats()["counters"]["evictions"] > 0


def test_a_gradient_assigned_by_hand_is_not_silently_dropped():
    model, _ = make_models()
    with gx.enable(model, config("sim")) as engine:
        opt = engine.optimizer(torch.optim.AdamW)
        model.ln_f.weight.grad = torch.ones_like(model.ln_f.weight)
        with pytest.raises(RuntimeError, match="ln_f.weight"):
            opt.step()


def test_chunks_homed_on_the_host_are_fetched_about_once_per_pass():
    model, _ = make_models()
    with gx.enable(model, config("sim", offload_param_frac=1.0)) as engine:
        opt = engine.optimizer(torch.optim.AdamW, lr=LR)
        n = engine.stats()["num_param_chunks"]
        steps = 3
        for step in range(steps):
            train_step(model, opt, step, "cpu")
        stats = engine.stats()
        fetches = stats["counters"]["fetches"] + stats["traffic"]["prefetches"]  # synchronous + ahead
        assert stats["traffic"]["prefetch_hits"] > 0, "after the warm-up step, fetches come ahead of use"
    # forward and backward each walk the chunks once; the tied embedding/head chunk and chunks
    # shared by neighbouring modules may come back once more; a chunk the walk uses again within
    # 8 accesses (at the turn from forward to backward) stays instead of going home in between
    assert steps * (2 * n - 8) <= fetches <= steps * (2 * n + 2)


@pytest.mark.parametrize("device", DEVICES)
def test_a_forward_that_fails_on_its_inputs_says_the_engine_does_not_cast_them(device):
    """fp32 inputs to a bf16 model fail inside torch ("mat1 and mat2 must have the same dtype");
    the exception carries a note naming the inputs' dtype, the parameters' and the fix. A forward
    that succeeds (under autocast) gets nothing, and a failure unrelated to inputs no note."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    dev = torch_device(device)
    with gx.enable(model, gx.GeminiConfig(device=device, precision="bf16", chunk_config_dict={"chunk_size": 1024})):
        with pytest.raises(RuntimeError) as info:
            model(torch.randn(8, 16, device=dev))
        notes = "\n".join(getattr(info.value, "__notes__", []))
        assert "does not cast or move" in notes and "torch.float32" in notes and "torch.bfloat16" in notes, notes
        assert "torch.autocast" in notes
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            assert model(torch.randn(8, 16, device=dev)).dtype == torch.bfloat16
        with pytest.raises(RuntimeError) as info:
            model(torch.randn(8, 15, device=dev, dtype=torch.bfloat16))  # a shape error, inputs of the right dtype
        assert not getattr(info.value, "__notes__", []), info.value.__notes__
        with pytest.raises(RuntimeError) as info:
            model(torch.randint(0, 4, (8, 16), device=dev))  # token ids into a Linear layer
        notes = "\n".join(getattr(info.value, "__notes__", []))
        assert "integer input(s) in torch.int64" in notes and "x.to(torch.bfloat16)" in notes, notes


class _RaisesInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise ValueError("raised inside backward")


def _train_through_a_failed_backward(model, opt, device, after_failure):
    """Four iterations; the second one's backward raises once block 1's backward is done (block 1
    and the head have their gradients, block 0 and the embeddings none), and the loop goes on with
    `after_failure`: "zero_grad" (drop what the failed pass left), "step" (step with it, as torch
    does), "forward" (the next forward at once, accumulating onto it)."""
    for step in range(4):
        fail = step == 1
        handle = model.blocks[1].register_forward_pre_hook(
            lambda module, args: (_RaisesInBackward.apply(args[0]),)) if fail else None
        x, y = batch(model.cfg, step, device)
        loss = model(x, y)
        if handle is not None:
            handle.remove()
        if not fail:
            loss.backward()
            opt.step()
            opt.zero_grad()
            continue
        with pytest.raises(ValueError, match="raised inside backward"):
            loss.backward()
        if after_failure == "zero_grad":
            opt.zero_grad()
        elif after_failure == "step":
            opt.step()
            opt.zero_grad()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("after_failure", ["zero_grad", "step", "forward"])
def test_training_goes_on_after_an_exception_inside_backward_as_in_plain_pytorch(device, after_failure):
    # see [Note: a backward that raised] (gemini_ext/_engine/hooks.py)
    model, reference = make_models()
    reference.to(torch_device(device))
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=LR, weight_decay=WD)
    _train_through_a_failed_backward(reference, ref_opt, torch_device(device), after_failure)
    with gx.enable(model, config(device)) as engine:
        opt = engine.optimizer(torch.optim.AdamW, lr=LR, weight_decay=WD)
        _train_through_a_failed_backward(model, opt, engine.compute_device, after_failure)
        assert engine.stats()["counters"]["backward_passes"] == 4, "the failed pass was ended, the later ones ran"
    diff = max_relative_difference(model, reference)
    assert max(diff.values()) < 1e-5, diff
