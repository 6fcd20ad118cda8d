"""engine.offload_states() / reload_states(): the engine gives the device up between training
phases (generation by another inference engine) and takes it back, bit-identically
(see [Note: offloading the states], gemini_ext/_engine/phases.py)."""

import pytest
import torch

import gemini_ext as gx
from conftest import DEVICES
from gemini_ext.models import GPT, GPT_PRESETS


def _train(device: str, steps: int, between=None) -> tuple[list, list]:
    """`steps` AdamW steps of the tiny GPT under `auto`; `between(engine, step)` after each."""
    torch.manual_seed(0)
    model = GPT(GPT_PRESETS["tiny"])
    cfg = gx.GeminiConfig(device=device, placement_policy="auto", search_range_m=1, min_chunk_size_m=0.01,
                          max_norm=1.0)
    batches = torch.Generator().manual_seed(1)
    losses = []
    with gx.enable(model, cfg) as engine:
        opt = engine.optimizer(torch.optim.AdamW, lr=1e-3)
        compute = engine.compute_device
        for step in range(steps):
            x = torch.randint(0, 100, (2, 16), generator=batches).to(compute)
            loss = model(x).float().square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
            if between is not None:
                between(engine, step)
    return [p.detach().clone() for p in model.parameters()], losses


@pytest.mark.parametrize("device", DEVICES)
def test_training_after_a_round_trip_is_bit_identical_and_the_device_is_left_empty(device):
    seen = {}

    def round_trip(engine, step):
        if step in (2, 4):  # the iteration after a round trip: its forward found its chunks copied back
            seen.setdefault("sync_fetches_after", []).append(engine.stats()["steps"][-1]["sync_fetches"])
        if step not in (1, 3):
            return
        placements = [p["optim_on_host"] for p in engine.internal.runtime.set_placements()]
        moved = engine.offload_states()
        seen.setdefault("device_bytes", []).append(engine.stats()["tier_bytes"]["device"]["current"])
        seen.setdefault("moved", []).append(moved["optimizer_sets_moved"])
        if device == "cuda":
            seen.setdefault("torch_reserved", []).append(torch.cuda.memory_reserved())
        engine.reload_states()
        assert [p["optim_on_host"] for p in engine.internal.runtime.set_placements()] == placements
        seen.setdefault("device_bytes_reloaded", []).append(engine.stats()["tier_bytes"]["device"]["current"])

    plain_params, plain_losses = _train(device, 5)
    params, losses = _train(device, 5, round_trip)
    assert losses == plain_losses
    assert all(torch.equal(a, b) for a, b in zip(params, plain_params))
    assert seen["device_bytes"] == [0, 0], seen  # no chunk is left on the device
    assert all(n >= 1 for n in seen["moved"]), seen  # the tiny model's optimizer state was on the device
    # reload_states() starts the parameter chunks back at once: the next forward waits for none
    assert all(b > 0 for b in seen["device_bytes_reloaded"]) and seen["sync_fetches_after"] == [0, 0], seen


def test_the_context_manager_and_the_mistakes_each_name_the_fix():
    torch.manual_seed(0)
    model = GPT(GPT_PRESETS["tiny"])
    with gx.enable(model, gx.GeminiConfig(device="sim", placement_policy="auto")) as engine:
        opt = engine.optimizer(torch.optim.AdamW, lr=1e-3)
        x = torch.randint(0, 100, (2, 16))
        model(x).float().mean().backward()
        opt.step()
        with pytest.raises(RuntimeError, match=r"call engine.offload_states\(\) first"):
            engine.reload_states()
        with engine.states_offloaded():
            assert engine.stats()["tier_bytes"]["device"]["current"] == 0
            with pytest.raises(RuntimeError, match=r"call engine.reload_states\(\) first"):
                engine.offload_states()
            with pytest.raises(RuntimeError, match=r"forward.*offloaded.*reload_states\(\)"):
                model(x)
            with pytest.raises(RuntimeError, match=r"optimizer.step\(\).*offloaded.*reload_states\(\)"):
                opt.step()
        model(x).float().mean().backward()  # trains again once reloaded
        opt.step()
        with pytest.raises(ValueError, match=r"unknown states \['kv_cache'\]"):
            engine.offload_states(include=["kv_cache"])
        moved = engine.offload_states(include=["lp_params"])  # the parameters only: the state stays
        assert moved["optimizer_sets_moved"] == 0
        engine.reload_states()


def test_an_offload_the_host_cannot_hold_moves_what_it_can_and_says_what_stayed(monkeypatch):
    """A host with room for the parameter chunks (235.5 KiB without a host copy) but not for the
    optimizer side (1.38 MiB, on the device only): the parameters leave the device, the optimizer
    side stays; the call warns naming it and returns it, and training goes on bit-identically
    after the reload."""
    from gemini_ext.placement import host_memory
    seen = {}

    def partial(engine, step):
        if step != 1:
            return
        before = engine.stats()["tier_bytes"]["device"]["current"]
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(host_memory, "host_available_bytes", lambda ranks_on_host=1: 300 << 10)
            with pytest.warns(UserWarning, match=r"host has 300.00 KiB available, not enough for the optimizer side "
                                                 r"of 1 chunk set\(s\) .* stay on the device .*; the rest moved"):
                moved = engine.offload_states()
        seen.update(moved=moved, before=before, after=engine.stats()["tier_bytes"]["device"]["current"])
        engine.reload_states()

    plain_params, plain_losses = _train("sim", 3)
    params, losses = _train("sim", 3, partial)
    kept = seen["moved"]["kept_on_device"]
    assert seen["moved"]["optimizer_sets_moved"] == 0 and len(kept["optimizer_sets"]) >= 1, seen
    assert "parameter_chunks_bytes" not in kept and 0 < seen["after"] < seen["before"], seen
    assert losses == plain_losses and all(torch.equal(a, b) for a, b in zip(params, plain_params))


def test_the_weights_stream_out_whole_in_the_models_names():
    """named_parameters_for_inference: transformers' Llama after two steps on sim yields every
    parameter once, under the name its state dict has, equal to the trained value in the asked
    dtype; refused while the states are offloaded."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=128, max_position_embeddings=32))
    names = [n for n, _ in model.named_parameters()]
    with gx.enable(model, gx.GeminiConfig(device="sim", placement_policy="auto", search_range_m=1,
                                          min_chunk_size_m=0.01)) as engine:
        opt = engine.optimizer(torch.optim.AdamW, lr=1e-2)
        for _ in range(2):
            x = torch.randint(0, 128, (2, 16))
            model(input_ids=x, labels=x).loss.backward()
            opt.step()
            opt.zero_grad()
        streamed = dict(engine.named_parameters_for_inference(dtype=torch.bfloat16))
        full = engine.state_dict()
        assert sorted(streamed) == sorted(names)  # every parameter once, in the model's names
        for name, value in streamed.items():  # bf16, the compute dtype: read from the 16-bit chunks
            assert value.dtype == torch.bfloat16 and torch.equal(value, full[name].to(torch.bfloat16)), name
        for name, value in engine.named_parameters_for_inference(dtype=torch.float32):  # the fp32 masters
            assert torch.equal(value, full[name]), name
        with engine.states_offloaded():
            with pytest.raises(RuntimeError, match=r"offloaded.*reload_states\(\)"):
                engine.named_parameters_for_inference()


def test_closing_while_offloaded_gives_the_model_its_trained_values():
    torch.manual_seed(0)
    model = GPT(GPT_PRESETS["tiny"])
    with gx.enable(model, gx.GeminiConfig(device="sim", placement_policy="auto")) as engine:
        opt = engine.optimizer(torch.optim.AdamW, lr=1e-3)
        model(torch.randint(0, 100, (2, 16))).float().mean().backward()
        opt.step()
        full = engine.state_dict()
        engine.offload_states()
    assert all(torch.equal(p.detach().float(), full[name]) for name, p in model.named_parameters())
