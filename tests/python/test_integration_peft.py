"""PEFT / LoRA under the engine: a LoRA adapter on a frozen tiny Llama (built from a config, no
weights) trains as plain PEFT does, its frozen base costs its compute-dtype bytes only, and
save_pretrained inside the block writes the adapter PEFT writes."""

import copy
import json
import os

import pytest
import torch

import gemini_ext as gx
from conftest import DEVICES
from parity_utils import chunk_cap

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
safetensors_torch = pytest.importorskip("safetensors.torch")

STEPS = 6


def _lora_models():
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    base = transformers.LlamaForCausalLM(cfg)
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    plain = peft.get_peft_model(copy.deepcopy(base), lora)
    torch.manual_seed(1)
    for name, p in plain.named_parameters():  # lora_B starts at zero: give it values, so that lora_A trains too
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.02)
    mine = peft.get_peft_model(copy.deepcopy(base), lora)
    mine.load_state_dict(plain.state_dict())
    return plain, mine


def _batches(device):
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 128, (4, 16), generator=g).to(device) for _ in range(STEPS)]


def _train(model, opt, device):
    for x in _batches(device):
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("device", DEVICES)
def test_lora_trains_as_plain_peft_and_saves_the_adapter_peft_saves(tmp_path, device):
    plain, mine = _lora_models()
    frozen_before = {n: p.detach().clone() for n, p in mine.named_parameters() if not p.requires_grad}
    torch_device = torch.device("cuda" if device == "cuda" else "cpu")
    plain.to(torch_device)
    _train(plain, torch.optim.AdamW([p for p in plain.parameters() if p.requires_grad], lr=1e-2), torch_device)
    plain.save_pretrained(tmp_path / "plain")
    config = gx.GeminiConfig(device=device, precision="fp32", chunk_config_dict={"chunk_size": 4096},
                             **chunk_cap(device, 6 * 4096 * 4))
    with gx.enable(mine, config) as engine:
        _train(mine, engine.optimizer(torch.optim.AdamW, lr=1e-2), engine.compute_device)
        assert engine.stats()["counters"]["evictions"] > 0, "the budget evicts"
        mine.save_pretrained(tmp_path / "gx")
    for (name, a), (_, b) in zip(plain.named_parameters(), mine.named_parameters()):
        if a.requires_grad:
            assert (a.detach().cpu() - b.detach().cpu()).abs().max() <= 1e-5 * a.abs().max(), name
        else:
            assert torch.equal(b.detach().cpu(), frozen_before[name]), f"{name}: a frozen parameter changed"
    assert sorted(os.listdir(tmp_path / "gx")) == sorted(os.listdir(tmp_path / "plain"))
    ours = safetensors_torch.load_file(tmp_path / "gx" / "adapter_model.safetensors")
    theirs = safetensors_torch.load_file(tmp_path / "plain" / "adapter_model.safetensors")
    assert sorted(ours) == sorted(theirs) and len(ours) == 8  # lora_A and lora_B of q and v in 2 layers
    for key, value in theirs.items():
        assert ours[key].dtype == value.dtype and (ours[key] - value.cpu()).abs().max() <= 1e-5 * value.abs().max()


def test_a_frozen_base_costs_its_compute_dtype_bytes_only():
    """A base in the compute dtype costs 2 bytes per parameter under bf16; one in fp32 adds its
    exact values on the host (4 bytes), which close() and state dicts give back."""
    _, wide = _lora_models()
    with gx.enable(wide, gx.GeminiConfig(device="sim", precision="bf16")) as engine:
        costs, padding = engine.stats()["parameters"]["frozen"], engine.stats()["wasted_bytes_all_groups"]
        assert 6.0 <= costs["bytes_per_parameter"] <= 6.0 + 3 * padding / costs["parameters"]  # bf16 padding, x3
        frozen_sets = [s for s in engine.internal.layout.sets if not s.trainable]
        assert frozen_sets and all(s.optimizer_side().keys() == {"master"} for s in frozen_sets)
        tiers = {engine.internal.chunks.chunk_info(s.master)["shard_tiers"] for s in frozen_sets}
        assert tiers == {"pageable_host"}, tiers
    _, mine = _lora_models()
    mine.to(torch.bfloat16)  # a base loaded in bf16, as from_pretrained loads one saved in bf16
    frozen = sum(p.numel() for p in mine.parameters() if not p.requires_grad)
    trainable = sum(p.numel() for p in mine.parameters() if p.requires_grad)
    with gx.enable(mine, gx.GeminiConfig(device="sim", precision="bf16", search_range_m=0.01,
                                         min_chunk_size_m=0.001)) as engine:
        engine.optimizer(torch.optim.AdamW, lr=1e-3)
        costs = engine.stats()["parameters"]
        assert costs["frozen"]["parameters"] == frozen and costs["trainable"]["parameters"] == trainable
        padding = engine.stats()["wasted_bytes_all_groups"]
        # bf16: 2 bytes per frozen parameter (padding aside); 2 + 2 (gradient) + 4 (master) + 8 (Adam) trainable
        assert 2.0 <= costs["frozen"]["bytes_per_parameter"] <= 2.0 + padding / frozen
        assert costs["trainable"]["bytes_per_parameter"] >= 16.0
    # the default chunk search: the adapter's chunks are sized to it, not to the base model
    _, again = _lora_models()
    again.to(torch.bfloat16)
    with gx.enable(again, gx.GeminiConfig(device="sim", precision="bf16")) as engine:
        engine.optimizer(torch.optim.AdamW, lr=1e-3)
        assert 16.0 <= engine.stats()["parameters"]["trainable"]["bytes_per_parameter"] <= 32.0, \
            engine.stats()["parameters"]
        frozen_sets = [s for s in engine.internal.layout.sets if not s.trainable]
        assert frozen_sets and all(s.optimizer_side() == {} for s in frozen_sets), "no gradient, master or state"


def test_a_checkpoint_without_the_base_holds_the_adapter_and_resumes_onto_the_base(tmp_path):
    """save_checkpoint(frozen=False): the adapter's masters and optimizer state, not the base;
    a fresh PEFT model over the same base resumes from it as if never stopped."""
    def run(model, steps, load=None, save=None):
        config = gx.GeminiConfig(device="sim", precision="fp32", chunk_config_dict={"chunk_size": 4096})
        with gx.enable(model, config) as engine:
            opt = engine.optimizer(torch.optim.AdamW, lr=1e-2)
            if load:
                engine.load_checkpoint(load)
            for x in _batches(torch.device("cpu"))[STEPS - steps if load else 0:][:steps]:
                model(input_ids=x, labels=x).loss.backward()
                opt.step()
                opt.zero_grad()
            if save:
                engine.save_checkpoint(save, frozen=False)
                engine.save_checkpoint(str(save) + "-full")

    _, whole = _lora_models()
    run(whole, STEPS)
    _, first = _lora_models()
    run(first, STEPS // 2, save=tmp_path / "adapter")
    trainable = sum(p.numel() for p in first.parameters() if p.requires_grad)
    frozen = sum(p.numel() for p in first.parameters() if not p.requires_grad)
    size = sum(f.stat().st_size for f in (tmp_path / "adapter").iterdir())
    full = sum(f.stat().st_size for f in (tmp_path / "adapter-full").iterdir())
    # fp32 master + two Adam moments of the adapter, and the buffers; the full one adds the base
    assert size < 12 * trainable + 100_000 < full and full - size >= 4 * frozen, (size, full, trainable, frozen)
    index = json.loads((tmp_path / "adapter" / "index.json").read_text())
    payload = torch.load(tmp_path / "adapter" / index["files"][0], weights_only=True)
    assert not any("lora" not in k and k in dict(first.named_parameters()) for k in payload["model"])
    _, resumed = _lora_models()  # the same base (its initial values), the adapter's initial values
    run(resumed, STEPS - STEPS // 2, load=tmp_path / "adapter")
    for (name, a), (_, b) in zip(whole.named_parameters(), resumed.named_parameters()):
        assert torch.equal(a, b), f"{name} differs from the uninterrupted run"
    from gemini_ext.export import export
    with pytest.raises(ValueError, match="trainable parameters only"):  # an exporter needs the base
        export(str(tmp_path / "adapter"), str(tmp_path / "out"))
