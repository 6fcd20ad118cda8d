"""optimizer_state_dtype="bf16": Adam's moments in bf16 with stochastic rounding, and with
master_weights=False the 8-byte state (the bf16 parameter is the master, rounded alike). The CPU
kernel against an independent Python implementation of the rounding (the CUDA kernel against the
CPU kernel: test_cpu_adam.py), then the engine: memory, the loss curve against fp32 state,
determinism, checkpoints, refusals (the host and device paths: test_optimizer.py)."""

import pytest
import torch

import gemini_ext as gx
from conftest import DEVICES
from parity_utils import batch, config, make_models, train_gemini

M32 = 0xFFFFFFFF


def _mulmod32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2^32 for int64 x < 2^32 without overflowing int64."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & M32


def _mix32(x):
    if isinstance(x, int):
        return int(_mix32(torch.tensor([x], dtype=torch.int64))[0])
    x = x ^ (x >> 16)
    x = _mulmod32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mulmod32(x, 0x846CA68B)
    return x ^ (x >> 16)


def _key(step: int, chunk: int) -> int:
    return _mix32((step & M32) ^ _mix32((chunk + 0x9E3779B9) & M32))


def _stochastic_bf16(x: torch.Tensor, key: int, first_index: int, high_half: bool = False) -> torch.Tensor:
    """The rounding of csrc/core/kernels/stochastic_round.h, written again with torch's integer ops: the
    low (or high) 16 of each element's hashed bits are its draw."""
    index = (torch.arange(x.numel(), dtype=torch.int64) + first_index) & M32
    draw = (_mix32(index ^ key) >> (16 if high_half else 0)) & 0xFFFF
    bits = x.view(torch.int32).to(torch.int64) & M32
    rounded = ((bits + draw) >> 16) & 0xFFFF
    finite = (bits & 0x7F800000) != 0x7F800000
    nearest = x.to(torch.bfloat16).view(torch.int16).to(torch.int64) & 0xFFFF
    halves = torch.where(finite, rounded, nearest)
    return torch.where(halves >= 0x8000, halves - 0x10000, halves).to(torch.int16).view(torch.bfloat16)


def test_the_kernel_is_the_fp32_update_then_the_documented_rounding():
    torch.manual_seed(0)
    n, key, first = 10_007, _key(3, 17), 70_000
    master = torch.randn(n)
    m = (torch.randn(n) * 1e-2).to(torch.bfloat16)
    v = (torch.rand(n) * 1e-4).to(torch.bfloat16)
    grad = (torch.randn(n) * 0.1).to(torch.bfloat16)
    hyper = dict(step=3, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, adamw=True)
    p_ref, m_ref, v_ref, copy_ref = master.clone(), m.float(), v.float(), torch.empty(n, dtype=torch.bfloat16)
    gx._C.cpu_adam_step(p_ref, m_ref, v_ref, grad, copy_ref, **hyper)
    p, copy = master.clone(), torch.empty(n, dtype=torch.bfloat16)
    m_in, v_in = m.clone(), v.clone()
    gx._C.cpu_adam_step(p, m_in, v_in, grad, copy, **hyper, random_key=key, first_index=first)
    assert torch.equal(p, p_ref) and torch.equal(copy, copy_ref), "the master is the fp32 kernel's"
    assert torch.equal(m_in, _stochastic_bf16(m_ref, key, first))
    assert torch.equal(v_in, _stochastic_bf16(v_ref, key, first, high_half=True))
    assert not torch.equal(m_in, m_ref.to(torch.bfloat16)), "not round to nearest"
    with pytest.raises(ValueError, match="both be float32 or both bfloat16"):
        gx._C.cpu_adam_step(master.clone(), m.clone(), v.float(), grad, None, **hyper)


def test_a_bf16_master_is_the_widened_update_rounded_from_its_own_stream():
    torch.manual_seed(1)
    n, key, first = 9_001, _key(5, 2), 123
    param = torch.randn(n).to(torch.bfloat16)
    m = (torch.randn(n) * 1e-2).to(torch.bfloat16)
    v = (torch.rand(n) * 1e-4).to(torch.bfloat16)
    grad = (torch.randn(n) * 0.1).to(torch.bfloat16)
    hyper = dict(step=5, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, adamw=True)
    p_ref, m_ref, v_ref = param.float(), m.float(), v.float()
    gx._C.cpu_adam_step(p_ref, m_ref, v_ref, grad, None, **hyper)
    want = _stochastic_bf16(p_ref, _mix32(key ^ 0x632BE5AB), first)  # stochastic_round.h's param_stream_key
    p, m_in, v_in = param.clone(), m.clone(), v.clone()
    gx._C.cpu_adam_step(p, m_in, v_in, grad, None, **hyper, random_key=key, first_index=first)
    assert torch.equal(p, want) and (p != param).float().mean() > 0.5
    assert torch.equal(m_in, _stochastic_bf16(m_ref, key, first))
    assert torch.equal(v_in, _stochastic_bf16(v_ref, key, first, high_half=True))
    out = [torch.empty_like(t) for t in (param, m, v)]
    gx._C.cpu_adam_step(param, m, v, grad, None, **hyper, out=out, random_key=key, first_index=first)
    assert torch.equal(out[0], want) and torch.equal(out[1], m_in), "out of place: the same values"
    with pytest.raises(ValueError, match="bfloat16 with bfloat16 moments and no param16"):
        gx._C.cpu_adam_step(param, m.float(), v.float(), grad, None, **hyper)
    with pytest.raises(ValueError, match="bfloat16 with bfloat16 moments and no param16"):
        gx._C.cpu_adam_step(param, m, v, grad, torch.empty_like(param), **hyper)


def _train(device, steps, state_dtype="bf16", **kw):
    model, _ = make_models()
    kw.setdefault("precision", "bf16")
    losses, stats = train_gemini(model, steps, config(device, optimizer_state_dtype=state_dtype, **kw))
    return model, losses, stats


@pytest.mark.parametrize("device", DEVICES)
def test_bf16_state_trains_like_fp32_state_in_three_quarters_of_the_memory(device):
    model_fp32, losses_fp32, stats_fp32 = _train(device, 30, state_dtype="fp32")
    model_bf16, losses_bf16, stats_bf16 = _train(device, 30)
    tiers = lambda s: sum(t["current"] for t in s["tier_bytes"].values())  # noqa: E731
    elements = stats_bf16["num_param_chunks"] * stats_bf16["chunk_size"]  # of each trainable chunk kind
    assert tiers(stats_fp32) - tiers(stats_bf16) == 4 * elements, "m and v: 2 bytes less each per element"
    # what placement plans per element besides the parameter chunk: grad 2, master 4, m and v
    assert gx.placement.costs.set_bytes_per_element(torch.bfloat16, 2, torch.bfloat16) == 2 + 4 + 2 + 2
    assert gx.placement.costs.set_bytes_per_element(torch.bfloat16, 2) == 2 + 4 + 4 + 4
    assert losses_bf16[-1] < losses_bf16[0] - 0.3, "it trains"
    # measured on sim: the curves differ by 2e-4 at most over 30 steps, the parameters by 3e-4
    assert max(abs(a - b) for a, b in zip(losses_bf16, losses_fp32)) < 2e-3, (losses_bf16, losses_fp32)
    drift = max((a.float() - b.float()).abs().max().item()
                for a, b in zip(model_bf16.parameters(), model_fp32.parameters()))
    assert 0 < drift < 3e-3, "the numerics change, a little"


@pytest.mark.parametrize("device", DEVICES)
def test_the_8_byte_state_trains_close_to_fp32_state_in_half_the_memory(device):
    """master_weights=False with bf16 moments: no fp32 master, the bf16 parameters take the
    update stochastically rounded; 8 bytes per parameter (P, gradient, m, v) against 16."""
    _, losses_fp32, stats_fp32 = _train(device, 30, state_dtype="fp32")
    model, losses, stats = _train(device, 30, master_weights=False)
    tiers = lambda s: sum(t["current"] for t in s["tier_bytes"].values())  # noqa: E731
    elements = stats["num_param_chunks"] * stats["chunk_size"]
    assert tiers(stats_fp32) - tiers(stats) == 8 * elements, "the master's 4 bytes and 2 for each moment"
    assert gx.placement.costs.set_bytes_per_element(torch.bfloat16, 2, torch.bfloat16, has_master=False) == 6
    assert all(p.dtype == torch.float32 for p in model.parameters()), "close() gives the model its dtype back"
    assert losses[-1] < losses[0] - 0.3, "it trains"
    # measured on sim: the curves differ by 1.3e-3 at most over 30 steps (bf16 moments alone: 3e-4)
    drift = max(abs(a - b) for a, b in zip(losses, losses_fp32))
    assert 0 < drift < 5e-3, (losses, losses_fp32)


@pytest.mark.parametrize("master_weights", [True, False], ids=["master", "no-master"])
def test_bf16_state_is_deterministic_and_the_same_with_or_without_the_overlapped_pipeline(master_weights):
    """The rounding's bits depend on (step, chunk, element) alone: a second run, and a run whose
    CPU steps are serial instead of overlapped or speculative, give the same parameters."""
    kw = dict(master_weights=master_weights)
    runs = [_train("sim", 6, **kw), _train("sim", 6, **kw), _train("sim", 6, overlap_optimizer=False, **kw)]
    for model, _, _ in runs[1:]:
        for a, b in zip(model.parameters(), runs[0][0].parameters()):
            assert torch.equal(a, b)


@pytest.mark.parametrize("master_weights", [True, False], ids=["master", "no-master"])
def test_bf16_state_checkpoints_resume_bit_exactly(tmp_path, master_weights):
    model, _ = make_models()
    cfg = config("sim", precision="bf16", optimizer_state_dtype="bf16", master_weights=master_weights)
    with gx.enable(model, cfg) as engine:
        opt = engine.optimizer(torch.optim.AdamW, lr=1e-3)
        for step in range(6):
            if step == 3:
                engine.save_checkpoint(str(tmp_path / "ckpt"))
                exp_avg = opt.state_dict()["state"][0]["exp_avg"]  # torch's format: widened to fp32, exactly
                assert exp_avg.dtype == torch.float32 and exp_avg.abs().sum() > 0
                assert torch.equal(exp_avg, exp_avg.to(torch.bfloat16).float())
            x, y = batch(model.cfg, step, engine.compute_device)
            model(x, y).backward()
            opt.step()
            opt.zero_grad()
    straight = [p.detach().clone() for p in model.parameters()]
    model2, _ = make_models(seed=1)
    with gx.enable(model2, cfg) as engine:
        opt = engine.optimizer(torch.optim.AdamW, lr=1e-3)
        engine.load_checkpoint(str(tmp_path / "ckpt"))
        for step in range(3, 6):
            x, y = batch(model2.cfg, step, engine.compute_device)
            model2(x, y).backward()
            opt.step()
            opt.zero_grad()
    resumed = [p.detach().clone() for p in model2.parameters()]
    for a, b in zip(straight, resumed):
        assert torch.equal(a, b)


@pytest.mark.parametrize("opt_cls", [torch.optim.SGD, torch.optim.Adagrad])
def test_bf16_state_refuses_optimizers_without_the_kernel(opt_cls):
    model, _ = make_models()
    with gx.enable(model, config("sim", optimizer_state_dtype="bf16")) as engine:
        with pytest.raises(ValueError, match="optimizer_state_dtype='bf16'.*Adam or AdamW"):
            engine.optimizer(opt_cls, lr=1e-2)


def test_the_config_names_the_allowed_state_dtypes():
    with pytest.raises(ValueError, match=r"optimizer_state_dtype: expected one of \('fp32', 'bf16'\), got 'fp16'"):
        gx.GeminiConfig(optimizer_state_dtype="fp16")


@pytest.mark.parametrize("precision,state_dtype", [("fp16", "bf16"), ("bf16", "fp32")])
def test_no_masters_needs_bf16_parameters_and_moments(precision, state_dtype):
    model, _ = make_models()
    cfg = config("sim", precision=precision, optimizer_state_dtype=state_dtype, master_weights=False)
    with pytest.raises(NotImplementedError, match=f"master_weights=False with precision='{precision}' and "
                       f"optimizer_state_dtype='{state_dtype}'.*precision='bf16' with optimizer_state_dtype='bf16'"):
        gx.enable(model, cfg)
    assert all(p.device.type == "cpu" and p.dtype == torch.float32 for p in model.parameters()), "left as it was"
