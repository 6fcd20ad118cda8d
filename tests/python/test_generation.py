"""model.generate() inside the enable() block: transformers' causal LM generates with its KV cache
under torch.no_grad() in eval mode, token for token as the same model alone, and trains on after
it (the access trace re-recorded for each shape, the placement kept)."""

import pytest
import torch

import gemini_ext as gx


def test_greedy_generation_under_the_engine_is_the_models_own_and_training_goes_on():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=128, max_position_embeddings=64, pad_token_id=0))
    prompts = torch.randint(1, 128, (2, 8))
    mask = torch.ones_like(prompts)
    model.eval()
    with torch.no_grad():
        alone = model.generate(prompts, attention_mask=mask, max_new_tokens=12, do_sample=False)
    model.train()
    with gx.enable(model, gx.GeminiConfig(device="sim", placement_policy="auto", precision="fp32")) as engine:
        opt = engine.optimizer(torch.optim.AdamW, lr=1e-2)
        for step in range(3):
            model.eval()
            with torch.no_grad():
                generated = model.generate(prompts, attention_mask=mask, max_new_tokens=12, do_sample=False)
                if step == 0:  # before any update: the model's own tokens
                    assert torch.equal(generated, alone)
                    logits_before = model(input_ids=alone).logits
            model.train()
            model(input_ids=generated, labels=generated).loss.backward()
            opt.step()
            opt.zero_grad()
        model.eval()
        with torch.no_grad():
            logits_after = model(input_ids=alone).logits
    assert generated.shape == (2, 20)
    assert not torch.equal(logits_before, logits_after)  # the updates reached what generation computes with
