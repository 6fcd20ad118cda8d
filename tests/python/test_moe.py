"""Mixture-of-experts with one module per expert: an expert that gets no token runs no forward, so
its parameters get no gradient (torch.optim skips them: no step, no weight decay) and its chunks
are not fetched. (transformers' own MoE models hold a layer's experts in one stacked tensor: those
are covered by test_parity_transformers.py, and every routed layer fetches all of its experts.)
"""

import copy

import pytest
import torch

import gemini_ext as gx
from conftest import DEVICES
from parity_utils import max_relative_difference, torch_device

D, HIDDEN, EXPERTS, LAYERS, STEPS = 64, 128, 4, 2, 6
ROUTED_FROM = 2  # from this step on only the first two experts of each layer get tokens


class Expert(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = torch.nn.Linear(D, HIDDEN), torch.nn.Linear(HIDDEN, D)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


class MoE(torch.nn.Module):
    """Top-1 routing over experts[:allowed]; an expert with no token is not called."""

    def __init__(self):
        super().__init__()
        self.router = torch.nn.Linear(D, EXPERTS)
        self.experts = torch.nn.ModuleList(Expert() for _ in range(EXPERTS))
        self.allowed = EXPERTS

    def forward(self, x):
        logits = self.router(x).masked_fill(torch.arange(EXPERTS, device=x.device) >= self.allowed, -1e9)
        weight, index = logits.softmax(-1).topk(1, dim=-1)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            rows = index[:, 0] == e
            if rows.any():
                out[rows] += weight[rows] * expert(x[rows])
        return out


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inp, self.out = torch.nn.Linear(D, D), torch.nn.Linear(D, 1)
        self.layers = torch.nn.ModuleList(MoE() for _ in range(LAYERS))

    def forward(self, x):
        h = self.inp(x)
        for layer in self.layers:
            h = h + layer(h)
        return self.out(h).pow(2).mean()


EXPERT_ELEMENTS = 2 * D * HIDDEN + HIDDEN + D


def _unrouted(model):
    return [p for layer in model.layers for expert in layer.experts[2:] for p in expert.parameters()]


def _train(model, opt, device, engine=None):
    """(h2d bytes per step, the unrouted experts' values when their last token was routed)"""
    inputs = [torch.randn(32, D, generator=torch.Generator().manual_seed(s)) for s in range(STEPS)]
    per_step = []
    for step, x in enumerate(inputs):
        if step == ROUTED_FROM:
            if engine is not None:
                engine.synchronize()  # the CPU steps of the last step end before the values are read
            last_routed = [p.detach().clone() for p in _unrouted(model)]
        for layer in model.layers:
            layer.allowed = EXPERTS if step < ROUTED_FROM else 2
        before = engine.stats()["traffic"]["h2d_bytes"] if engine else 0
        model(x.to(device)).backward()
        opt.step()
        opt.zero_grad()
        per_step.append((engine.stats()["traffic"]["h2d_bytes"] if engine else 0) - before)
    return per_step, last_routed


@pytest.mark.parametrize("device", DEVICES)
def test_experts_without_tokens_are_neither_stepped_nor_fetched(device):
    torch.manual_seed(0)
    reference = Net()
    model = copy.deepcopy(reference)
    reference.to(torch_device(device))
    _train(reference, torch.optim.AdamW(reference.parameters(), lr=1e-3, weight_decay=0.1), torch_device(device))
    # chunks of one expert's size, every chunk's home on the host: each use fetches it
    cfg = gx.GeminiConfig(device=device, precision="fp32", chunk_config_dict={"chunk_size": EXPERT_ELEMENTS},
                          placement_policy="static", offload_param_frac=1.0)
    with gx.enable(model, cfg) as engine:
        opt = engine.optimizer(torch.optim.AdamW, model.parameters(), lr=1e-3, weight_decay=0.1)
        per_step, last_routed = _train(model, opt, engine.compute_device, engine)
    worst = max_relative_difference(model, reference)
    assert max(worst.values()) < 1e-5, worst
    assert all(torch.equal(p.detach().cpu(), q.cpu()) for p, q in zip(_unrouted(model), last_routed)), \
        "no gradient, no step: AdamW's weight decay skips them too, as torch's does"
    # all experts routed: every chunk is fetched; from one step after the routing changed (the
    # prefetcher follows the last iteration's order), none of the unrouted experts' chunks is
    unrouted_chunk_bytes = LAYERS * 2 * EXPERT_ELEMENTS * 4
    assert per_step[1] - per_step[-1] >= unrouted_chunk_bytes, per_step
    assert per_step[ROUTED_FROM + 1] == per_step[-1], per_step
