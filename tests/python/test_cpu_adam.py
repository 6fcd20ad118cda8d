"""Our fused Adam kernels: the CPU kernel against torch.optim.Adam / AdamW (fp32 masters), the CUDA
kernel against the CPU kernel (the same bits)."""

import pytest
import torch

import gemini_ext as gx

_C = gx._C
ISA_ORDER = ["scalar", "avx2", "avx512"]
ISAS = ISA_ORDER[:ISA_ORDER.index(_C.build_info()["simd_detected"]) + 1]


def run_pair(numel, grad_dtype, weight_decay, adamw, isa, steps=5, grad_scale=1.0, out_dtype=torch.bfloat16):
    torch.manual_seed(numel)
    p0 = torch.randn(numel)
    grads = [(torch.randn(numel) * 0.1).to(grad_dtype) for _ in range(steps)]
    # torch: a Parameter with fp32 grads (the upcast of ours, scaled as ours would be)
    ref = torch.nn.Parameter(p0.clone())
    cls = torch.optim.AdamW if adamw else torch.optim.Adam
    opt = cls([ref], lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=weight_decay)
    p, m, v = p0.clone(), torch.zeros(numel), torch.zeros(numel)
    out = torch.empty(numel, dtype=out_dtype)
    for t, g in enumerate(grads, start=1):
        ref.grad = g.float() * grad_scale
        opt.step()
        _C.cpu_adam_step(p, m, v, g, out, step=t, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8,
                         weight_decay=weight_decay, adamw=adamw, grad_scale=grad_scale, isa=isa)
    state = opt.state[ref]
    return p, m, v, out, ref.detach(), state["exp_avg"], state["exp_avg_sq"]


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
@pytest.mark.parametrize("adamw", [True, False], ids=["adamw", "adam"])
@pytest.mark.parametrize("numel", [1, 15, 17, 1000, 4099, 100_003])
def test_matches_torch_optim_within_1e6_relative(isa, grad_dtype, weight_decay, adamw, numel):
    p, m, v, out, ref_p, ref_m, ref_v = run_pair(numel, grad_dtype, weight_decay, adamw, isa)
    torch.testing.assert_close(p, ref_p, rtol=1e-6, atol=1e-8)
    # m can be a small difference of gradients of size ~0.1; where it cancels, one float ulp of the
    # inputs (7.5e-9 at 0.1) is the floor of any error, hence the absolute tolerance.
    torch.testing.assert_close(m, ref_m, rtol=1e-6, atol=1e-8)
    torch.testing.assert_close(v, ref_v, rtol=1e-6, atol=1e-12)
    assert torch.equal(out, p.to(torch.bfloat16)), "the bf16 copy is torch's round-to-nearest-even of the master"


@pytest.mark.parametrize("isa", ISAS)
def test_fp16_copy_and_grad_scale(isa):
    p, m, v, out, ref_p, _, _ = run_pair(4099, torch.float16, 0.1, True, isa, grad_scale=1 / 1024,
                                         out_dtype=torch.float16)
    torch.testing.assert_close(p, ref_p, rtol=1e-6, atol=1e-8)
    assert torch.equal(out, p.to(torch.float16))


def test_every_isa_and_any_thread_split_give_identical_bits():
    """3M elements run on every thread of the pool; each ISA path must give the same bits."""
    numel = 3_000_001
    results = [run_pair(numel, torch.bfloat16, 0.1, True, isa, steps=2) for isa in ISAS]
    for other in results[1:]:
        for a, b in zip(results[0][:4], other[:4]):
            assert torch.equal(a, b)


@pytest.mark.parametrize("offset", [0, 1], ids=["aligned", "odd-offset"])
def test_the_16_bit_copy_is_the_masters_rounding_wherever_it_starts(offset):
    """In place the 16-bit copy is streamed (non-temporal stores) where it is aligned and stored
    plainly where it is not: the same bits on every ISA either way."""
    numel = 1 << 18
    for isa in ISAS:
        p, m, v = torch.randn(numel), torch.zeros(numel), torch.zeros(numel)
        backing = torch.empty(numel + 1, dtype=torch.bfloat16)
        out = backing[offset:offset + numel]
        _C.cpu_adam_step(p, m, v, (torch.randn(numel) * 0.1).bfloat16(), out, step=1, lr=1e-2, beta1=0.9,
                         beta2=0.999, eps=1e-8, weight_decay=0.1, isa=isa)
        assert torch.equal(out, p.to(torch.bfloat16)), isa


def test_bad_arguments_name_the_problem():
    p = torch.zeros(8)
    with pytest.raises(ValueError, match="exp_avg has 4 elements, expected 8"):
        _C.cpu_adam_step(p, torch.zeros(4), torch.zeros(8), torch.zeros(8), step=1, lr=1e-3, beta1=0.9, beta2=0.999,
                         eps=1e-8, weight_decay=0.0)
    with pytest.raises(ValueError, match="float32"):
        _C.cpu_adam_step(p.double(), torch.zeros(8), torch.zeros(8), torch.zeros(8), step=1, lr=1e-3, beta1=0.9,
                         beta2=0.999, eps=1e-8, weight_decay=0.0)
    with pytest.raises(ValueError, match="contiguous"):
        _C.cpu_adam_step(p, torch.zeros(16)[::2], torch.zeros(8), torch.zeros(8), step=1, lr=1e-3, beta1=0.9,
                         beta2=0.999, eps=1e-8, weight_decay=0.0)
    with pytest.raises(ValueError, match="step"):
        _C.cpu_adam_step(p, torch.zeros(8), torch.zeros(8), torch.zeros(8), step=0, lr=1e-3, beta1=0.9, beta2=0.999,
                         eps=1e-8, weight_decay=0.0)
    with pytest.raises(ValueError, match="isa"):
        _C.cpu_adam_step(p, torch.zeros(8), torch.zeros(8), torch.zeros(8), step=1, lr=1e-3, beta1=0.9, beta2=0.999,
                         eps=1e-8, weight_decay=0.0, isa="sse")
    with pytest.raises(ValueError, match="expected CUDA tensors, got param on cpu"):
        _C.device_adam_step(p, torch.zeros(8), torch.zeros(8), torch.zeros(8), step=1, lr=1e-3, beta1=0.9,
                            beta2=0.999, eps=1e-8, weight_decay=0.0)


@pytest.mark.cuda
def test_the_device_kernel_computes_the_cpu_kernels_bits():
    """csrc/cuda/adam_kernel.cu and the CPU kernel on the same values over three steps: every
    gradient, moment and 16-bit copy dtype, Adam and AdamW, a gradient scale, and bf16 moments'
    stochastic rounding, with an fp32 master or a bf16 one (the 8-byte state); gradients spanning
    ten orders of magnitude."""
    n, key, first = 1_000_003, 123_456_789, 3_000_000_000
    bf16, fp16, fp32 = torch.bfloat16, torch.float16, torch.float32
    cases = [(fp32, state, grad, copy, adamw) for state in (fp32, bf16) for grad in (fp32, bf16, fp16)
             for copy in (None, bf16, fp16) for adamw in (True, False) if copy in (None, bf16) or grad == fp16]
    cases += [(bf16, bf16, grad, None, adamw) for grad in (bf16, fp32) for adamw in (True, False)]
    for master_dtype, state, grad_dtype, copy_dtype, adamw in cases:
        torch.manual_seed(len(str((master_dtype, state, grad_dtype, copy_dtype, adamw))))
        master = torch.randn(n).to(master_dtype)
        moments = [(torch.randn(n) * 1e-3).to(state), (torch.rand(n) * 1e-5).to(state)]
        host = [master.clone(), *[m.clone() for m in moments]]
        dev = [t.cuda() for t in host]
        copies = (torch.empty(n, dtype=copy_dtype), torch.empty(n, dtype=copy_dtype, device="cuda")) \
            if copy_dtype else (None, None)
        hyper = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1 if adamw else 0.01, adamw=adamw,
                     grad_scale=0.37, random_key=key, first_index=first)
        for step in (1, 2, 3):
            grad = (torch.randn(n) * 10.0 ** torch.empty(n).uniform_(-8, 2)).to(grad_dtype)
            _C.cpu_adam_step(*host, grad, copies[0], step=step, **hyper)
            _C.device_adam_step(*dev, grad.cuda(), copies[1], step=step, **hyper)
        what = f"master {master_dtype}, state {state}, grad {grad_dtype}, copy {copy_dtype}, adamw {adamw}"
        assert not torch.equal(host[0], master), f"the master moved: {what}"
        for name, a, b in zip(["master", "exp_avg", "exp_avg_sq", "copy"], host + [copies[0]], dev + [copies[1]]):
            if a is not None:
                assert torch.equal(a.view(torch.int16 if a.element_size() == 2 else torch.int32),
                                   b.cpu().view(torch.int16 if a.element_size() == 2 else torch.int32)), \
                    f"{name} differs: {what}"
    with pytest.raises(ValueError, match="exp_avg is on cpu, expected the param's device cuda"):
        _C.device_adam_step(dev[0], host[1], dev[2], dev[0], step=1, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
                            weight_decay=0.0)
