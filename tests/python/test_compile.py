"""torch.compile under the engine: the whole model or block by block (as FSDP2 users compile),
for the example GPT and a transformers Llama, against the same training in eager mode. The
engine's hooks are graph breaks; compiled kernels fuse and round differently from eager ones,
so the bound is about the gap plain PyTorch shows between its own eager and compiled runs."""

import pytest
import torch

import gemini_ext as gx
from conftest import DEVICES
from parity_utils import batch, config, make_models, max_relative_difference

STEPS = 5


def _llama():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)


def _compile(model, mode, device):
    # On sim, dynamo and AOTAutograd (what meets the engine's hooks and chunk-backed parameters)
    # without inductor's C++ code generation, which is not the engine's and costs most of the
    # test's time on a CPU; on cuda, inductor's kernels.
    backend = "aot_eager" if device == "sim" else "inductor"
    if mode == "whole":
        return torch.compile(model, backend=backend)
    blocks = model.blocks if hasattr(model, "blocks") else model.model.layers
    for block in blocks:
        block.compile(backend=backend)
    return model


def _loss(model, fwd, step, device):
    if hasattr(model, "cfg"):
        x, y = batch(model.cfg, step, device)
        return fwd(x, y)
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(0, 128, (2, 16), generator=g).to(device)
    return fwd(input_ids=ids, labels=ids).loss


def _train(model, mode, engine_cfg, device):
    torch._dynamo.reset()
    with gx.enable(model, engine_cfg) as engine:
        opt = engine.optimizer(torch.optim.AdamW, lr=1e-3)
        fwd = _compile(model, mode, device) if mode else model
        for step in range(STEPS):
            _loss(model, fwd, step, engine.compute_device).backward()
            opt.step()
            opt.zero_grad()
    return model


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("model_name,mode", [("gpt", "whole"), ("llama", "blocks")])
def test_compiled_training_under_the_engine_matches_eager(device, model_name, mode):
    make = (lambda: make_models()[0]) if model_name == "gpt" else _llama
    cfg = config(device, chunk_config_dict={"chunk_size": 8192}, offload_optim_frac=0.5)
    eager = _train(make(), None, cfg, device)
    compiled = _train(make(), mode, cfg, device)
    gap = max(max_relative_difference(compiled, eager).values())
    # Plain PyTorch's own eager-vs-compiled (inductor) difference for the same training, measured
    # on the CPU: 1.7e-5 (GPT, whole) and 2.6e-6 (Llama, per layer); under the engine the same,
    # 1.7e-5 and 3.2e-6. aot_eager keeps eager's kernels, so on sim the gap is rounding only.
    assert gap <= 5e-5, gap
