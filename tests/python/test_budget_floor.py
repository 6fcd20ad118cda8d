"""The smallest device budget that can work: the parameter chunks one module computes with at
once plus one gradient chunk. At exactly that budget a dense model (Llama), a tied one (GPT-2:
the embedding is the output layer) and a mixture of experts whose experts get no tokens in some
steps train with clipping and accumulation (no_sync) as plain PyTorch does, under each policy,
and fp16 with loss scaling as with an unlimited budget.
The floor is enough, not always needed (a gradient may land after its module released its
chunks); with room for one chunk, below it for every model here, the OutOfMemoryError names
it in bytes."""

import copy

import pytest
import torch

import gemini_ext as gx
from dist_utils import run_ranks

transformers = pytest.importorskip("transformers")

CHUNK = 4096  # elements
STEPS, ACCUM, VOCAB = 3, 2, 96
# GPT-2's key bias has a zero gradient up to rounding; a larger eps keeps Adam from turning that
# rounding noise into full-size steps whose signs differ between any two summation orders.
EPS = 1e-3


def _llama():
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    return transformers.LlamaForCausalLM(cfg)


def _gpt2():
    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=32, resid_pdrop=0.0,
                                  embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(cfg)


class Experts(torch.nn.Module):
    """Top-1 routing over separate expert modules; the router is a fixed rule on the token id, so
    that some experts get no tokens in some steps (their parameters get no gradient)."""

    def __init__(self, width=32, experts=4):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, width)
        self.experts = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(experts))
        self.head = torch.nn.Linear(width, VOCAB)

    def forward(self, input_ids, labels):
        h = self.embed(input_ids)
        route = input_ids % len(self.experts)
        out = torch.zeros_like(h)
        for k, expert in enumerate(self.experts):
            mask = route == k
            if mask.any():
                out[mask] = expert(h[mask])
        logits = self.head(torch.relu(out + h))
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())


MODELS = {"llama": _llama, "gpt2": _gpt2, "moe": Experts}


def _ids(step, micro, model_name):
    g = torch.Generator().manual_seed(100 * step + micro)
    if model_name == "moe" and step == 1:  # only experts 0 and 2 get tokens in this step
        return torch.randint(0, VOCAB // 2, (2, 12), generator=g) * 2
    return torch.randint(0, VOCAB, (2, 12), generator=g)


def _loss(model, ids):
    out = model(input_ids=ids, labels=ids)
    return out if torch.is_tensor(out) else out.loss


def _train(model, model_name, opt, clip, no_sync, device="cpu"):
    for step in range(STEPS):
        for micro in range(ACCUM):
            ctx = no_sync() if micro < ACCUM - 1 else torch.enable_grad()
            with ctx:
                (_loss(model, _ids(step, micro, model_name).to(device)) / ACCUM).backward()
        clip(1.0)
        opt.step()
        opt.zero_grad()


def _floor_bytes(model, engine) -> int:
    """The parameter chunks of the module with the most, plus the largest gradient chunk."""
    chunk_bytes = {}
    worst = 0
    for module in model.modules():
        chunks = {engine.parameter_slot(p)[0] for p in module.parameters(recurse=False)}
        for c in chunks:
            chunk_bytes.setdefault(c, engine.chunk_info(c)["shard_numel"] * 4)  # fp32
        worst = max(worst, sum(chunk_bytes[c] for c in chunks))
    return worst + max(chunk_bytes.values())


def _config(policy, capacity, device="sim", **kw):
    """On sim the device's capacity is the budget; on cuda (const only) the const budget, which
    caps the chunks exactly (a cuda limit would cover activations too)."""
    kw.setdefault("precision", "fp32")
    if policy == "static":
        kw["offload_optim_frac"] = 1.0
    if policy == "const":
        kw["const_gpu_budget"] = capacity or 1 << 30
    if device == "sim":
        kw["sim_capacity"] = capacity
    return gx.GeminiConfig(device=device, chunk_config_dict={"chunk_size": CHUNK}, placement_policy=policy, **kw)


CUDA = pytest.mark.cuda
CASES = [
    pytest.param("llama", "static", {}, "sim", id="llama-static"),
    pytest.param("llama", "const", {}, "sim", id="llama-const"),
    pytest.param("llama", "auto", {"enable_gradient_accumulation": True}, "sim", id="llama-auto-accumulation"),
    pytest.param("gpt2", "static", {}, "sim", id="gpt2-static"),
    pytest.param("moe", "static", {}, "sim", id="moe-static"),
    pytest.param("moe", "auto", {}, "sim", id="moe-auto"),
    pytest.param("llama", "const", {}, "cuda", id="llama-const-cuda", marks=CUDA),
    pytest.param("gpt2", "const", {}, "cuda", id="gpt2-const-cuda", marks=CUDA),
    pytest.param("moe", "const", {}, "cuda", id="moe-const-cuda", marks=CUDA),
]


@pytest.mark.parametrize("model_name,policy,extra,device", CASES)
def test_the_floor_trains_as_plain_pytorch_and_below_it_the_error_names_it(model_name, policy, extra, device):
    torch.manual_seed(0)
    reference = MODELS[model_name]()
    model = copy.deepcopy(reference)
    probe = copy.deepcopy(reference)
    reference.to("cuda" if device == "cuda" else "cpu")  # after the copies: the engine places its own
    with gx.enable(probe, _config(policy, None, device, **extra)) as engine:
        floor = _floor_bytes(probe, engine)
        smallest_chunk = min(engine.chunk_info(engine.parameter_slot(p)[0])["shard_numel"] * 4
                             for p in probe.parameters())

    opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, eps=EPS)
    _train(reference, model_name, opt, lambda n: torch.nn.utils.clip_grad_norm_(reference.parameters(), n),
           torch.enable_grad, next(reference.parameters()).device)

    with gx.enable(model, _config(policy, floor, device, **extra)) as engine:
        opt = engine.optimizer(torch.optim.AdamW, lr=1e-2, eps=EPS)
        _train(model, model_name, opt, engine.clip_grad_norm_, engine.no_sync, engine.compute_device)
        assert engine.stats()["counters"]["evictions"] > 0, "the floor is below the model: chunks moved"
        got = engine.state_dict()
    for name, value in reference.state_dict().items():
        if name in got:
            value = value.cpu()
            diff = ((got[name].cpu() - value).abs().max() / value.abs().max().clamp_min(1e-12)).item()
            assert diff <= 1e-5, (name, diff)

    below = copy.deepcopy(reference)
    with pytest.raises(gx.OutOfMemoryError, match=f"trains under is about {floor} bytes"):
        with gx.enable(below, _config(policy, smallest_chunk, device, **extra)) as engine:
            opt = engine.optimizer(torch.optim.AdamW, lr=1e-2, eps=EPS)
            _train(below, model_name, opt, engine.clip_grad_norm_, engine.no_sync, engine.compute_device)


def test_fp16_with_loss_scaling_at_the_floor_equals_an_unlimited_budget():
    """fp16 chunks (half the bytes, so half the floor) with the dynamic loss scaler: the values
    at the floor are bit for bit those of a budget that never evicts."""
    torch.manual_seed(0)
    reference = _llama()
    probe = copy.deepcopy(reference)
    with gx.enable(probe, _config("static", None)) as engine:
        floor_fp16 = _floor_bytes(probe, engine) // 2

    def train(capacity):
        model = copy.deepcopy(reference)
        with gx.enable(model, _config("static", capacity, precision="fp16")) as engine:
            opt = engine.optimizer(torch.optim.AdamW, lr=1e-2, eps=EPS)
            _train(model, "llama", opt, engine.clip_grad_norm_, engine.no_sync)
            return engine.state_dict(), engine.stats()["counters"]["evictions"]

    at_floor, evictions = train(floor_fp16)
    unlimited, none = train(None)
    assert evictions > 0 and none == 0
    for name, value in unlimited.items():
        assert torch.equal(at_floor[name], value), name


def _sharded_floor_body(rank, world_size, out_path):
    """Two gloo ranks, a budget of two shards: the error states the sharded floor's lower bound
    (per chunk its shard plus its gathered buffer) and says what comes on top."""
    import torch.distributed as dist

    torch.manual_seed(0)
    model = _llama()
    cfg = _config("static", None)
    probe = copy.deepcopy(model)
    with gx.enable(probe, cfg, process_group=dist.group.WORLD) as engine:
        def device_bytes(c):  # fp32: the shard and the gathered buffer
            info = engine.chunk_info(c)
            return (info["shard_numel"] + info["padded_numel"]) * 4
        modules = [{engine.parameter_slot(p)[0] for p in m.parameters(recurse=False)} for m in probe.modules()]
        floor = (max(sum(device_bytes(c) for c in chunks) for chunks in modules)
                 + max(device_bytes(c) for chunks in modules for c in chunks))
        shard = engine.chunk_info(engine.parameter_slot(next(probe.parameters()))[0])["shard_numel"] * 4
    with pytest.raises(gx.OutOfMemoryError) as err:
        with gx.enable(model, _config("static", 2 * shard), process_group=dist.group.WORLD) as engine:
            opt = engine.optimizer(torch.optim.AdamW, lr=1e-2, eps=EPS)
            _train(model, "llama", opt, engine.clip_grad_norm_, engine.no_sync)
    text = str(err.value)
    assert f"trains under is at least {floor} bytes" in text, (floor, text)
    assert "keeps a gathered gradient buffer on top" in text, text


def test_sharded_the_error_states_the_floors_lower_bound():
    run_ranks(2, _sharded_floor_body, None)
