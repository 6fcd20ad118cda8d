"""close() gives back what the model held: frozen parameters bit for bit as they were at enable(),
trained parameters bit for bit as the engine's state dict holds them (cast to their own dtype), and
every buffer as the model left it, for models in fp32, bf16 and fp16 under each precision. A
frozen fp32 parameter under a 16-bit precision keeps its exact value beside its compute copy
(_engine/layout.py), so a LoRA base model in fp32 is not rounded by passing through the engine."""

import pytest
import torch

import gemini_ext as gx
from conftest import DEVICES
from parity_utils import torch_device

transformers = pytest.importorskip("transformers")

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _model(dtype):
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   use_cache=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).to(dtype)
    model.register_buffer("seen", torch.zeros(4, dtype=dtype))  # a buffer the forward changes
    inner_forward = model.forward

    def forward(*args, **kwargs):
        model.seen.add_(1.5)
        return inner_forward(*args, **kwargs)

    model.forward = forward
    for name, p in model.named_parameters():  # the base frozen, as PEFT leaves it; some layers train
        p.requires_grad_("layers.1" in name or "lm_head" in name)
    return model


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("precision", list(DTYPES))
@pytest.mark.parametrize("model_dtype", list(DTYPES))
def test_close_gives_back_frozen_values_and_trained_state_bit_for_bit(model_dtype, precision, device):
    model = _model(DTYPES[model_dtype]).to(torch_device(device))
    at_enable = {n: p.detach().clone() for n, p in model.named_parameters()}
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    cfg = gx.GeminiConfig(device=device, precision=precision, chunk_config_dict={"chunk_size": 4096},
                          initial_scale=2.0 ** 8)
    x = torch.randint(0, 128, (2, 16), device=torch_device(device))
    with gx.enable(model, cfg) as engine:
        opt = engine.optimizer(torch.optim.AdamW, model.parameters(), lr=1e-2)  # frozen ones included, as torch
        for _ in range(3):
            model(input_ids=x, labels=x).loss.backward()
            opt.step()
            opt.zero_grad()
        assert engine.stats()["skipped_steps"] < 3, "some steps were applied"
        state = engine.state_dict()
        buffers = {n: b.detach().clone() for n, b in model.named_buffers()}
    params = dict(model.named_parameters())
    for n in frozen:
        assert params[n].dtype == at_enable[n].dtype
        assert torch.equal(params[n], at_enable[n]), n
        assert torch.equal(state[n], at_enable[n].float().cpu()), f"{n}: the state dict holds the exact value"
    trained = [n for n in params if n not in frozen]
    assert any(not torch.equal(params[n], at_enable[n]) for n in trained), "training moved the trained ones"
    for n in trained:
        assert params[n].dtype == at_enable[n].dtype
        assert torch.equal(params[n].cpu(), state[n].to(at_enable[n].dtype)), n
    for n, b in model.named_buffers():
        assert b.dtype == buffers[n].dtype and torch.equal(b, buffers[n]), n
    assert torch.equal(model.seen.cpu(), torch.full((4,), 4.5, dtype=DTYPES[model_dtype]))
