"""model.generate() inside the enable() block: transformers' causal LM generates with its KV cache
under torch.no_grad() in eval mode, token for token as the same model alone, and trains on after
it (the access trace re-recorded for each shape, the placement kept)."""

import contextlib

import pytest
import torch

import gemini_ext as gx
from conftest import DEVICES


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


def _llama(transformers, layers: int = 4):
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=128, max_position_embeddings=64, pad_token_id=0))


def _generate_and_train(device: str, steps: int, room=None) -> tuple:
    """`steps` of: greedy generation (inside engine.generating(kv_cache_bytes=room(engine)) where
    `room` is given), then a training step on the generated tokens. Returns the generations, the
    final parameters and what each generating() block saw."""
    transformers = pytest.importorskip("transformers")
    model = _llama(transformers)
    prompts = torch.randint(1, 128, (2, 8), generator=torch.Generator().manual_seed(1))
    cfg = gx.GeminiConfig(device=device, placement_policy="auto", precision="fp32",
                          chunk_config_dict={"chunk_size": 40000})
    generations, seen = [], []
    with gx.enable(model, cfg) as engine:
        opt = engine.optimizer(torch.optim.AdamW, lr=1e-2)
        x = prompts.to(engine.compute_device)
        for _ in range(steps):
            block = engine.generating(kv_cache_bytes=room(engine)) if room is not None else contextlib.nullcontext()
            placements = [p["optim_on_host"] for p in engine.internal.runtime.set_placements()]
            budget = engine.internal.runtime.device_budget
            with block as held:
                if held is not None:
                    seen.append(dict(held, training=model.training, budget_inside=engine.internal.runtime.device_budget,
                                     device_chunk_bytes=engine.stats()["tier_bytes"]["device"]["current"]))
                else:
                    model.eval()
                with torch.no_grad():
                    out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=12, do_sample=False)
            model.train()
            assert engine.internal.runtime.device_budget == budget  # given back after the block
            assert [p["optim_on_host"] for p in engine.internal.runtime.set_placements()] == placements
            generations.append(out.cpu())
            model(input_ids=out, labels=out).loss.backward()
            opt.step()
            opt.zero_grad()
    return generations, [p.detach().cpu().clone() for p in model.parameters()], seen


@pytest.mark.parametrize("device", DEVICES)
def test_generating_keeps_the_kv_caches_room_and_training_after_it_is_bit_identical(device):
    """engine.generating(): the chunks' budget less the room inside the block, the optimizer sides
    that do not fit beside the parameters moved to the host and back, eval mode, and the same tokens
    and trained values as without the block (see [Note: room for the KV cache])."""
    def room(engine):  # leaves the parameter chunks and one and a half sets' optimizer sides (12 B an element)
        params = sum(engine.internal.layout.shard_bytes)
        return engine.internal.runtime.device_budget - params - 40000 * 18

    plain_out, plain_params, _ = _generate_and_train(device, 3)
    out, params, seen = _generate_and_train(device, 3, room)
    assert all(torch.equal(a, b) for a, b in zip(out, plain_out))
    assert all(torch.equal(a, b) for a, b in zip(params, plain_params))
    assert [s["training"] for s in seen] == [False] * 3
    assert all(s["budget_inside"] == s["chunk_budget_bytes"] for s in seen), seen
    assert all(1 <= s["optimizer_sets_moved"] < 5 for s in seen[1:]), seen  # after the first step: one set stays
    assert all(s["device_chunk_bytes"] <= s["chunk_budget_bytes"] for s in seen), seen


def test_generating_refuses_a_room_that_leaves_too_little_and_a_step_inside():
    transformers = pytest.importorskip("transformers")
    model = _llama(transformers)
    cfg = gx.GeminiConfig(device="sim", placement_policy="auto", chunk_config_dict={"chunk_size": 40000})
    with gx.enable(model, cfg) as engine:
        opt = engine.optimizer(torch.optim.AdamW, lr=1e-2)
        budget = engine.internal.runtime.device_budget
        with pytest.raises(gx.OutOfMemoryError, match=r"kept for the KV cache.*Generate fewer or shorter sequences"):
            with engine.generating(kv_cache_bytes=budget):
                pass
        with pytest.raises(ValueError, match=r"pass kv_cache_bytes=, or batch_size= and max_length="):
            with engine.generating(batch_size=8):
                pass
        with engine.generating(batch_size=2, max_length=20) as held:
            # keys and values x 4 layers x 2 kv heads x 16 head dims x 2 sequences x 20 tokens x 2 B (bf16)
            assert held["kv_cache_bytes"] == 2 * 4 * 2 * 16 * 2 * 20 * 2
            with pytest.raises(RuntimeError, match=r"already inside a generating\(\) block"):
                with engine.generating(kv_cache_bytes=0):
                    pass
            with pytest.raises(RuntimeError, match=r"optimizer.step\(\): inside engine.generating\(\)"):
                opt.step()
        assert engine.internal.runtime.device_budget == budget


def test_generation_keeps_its_own_access_trace_and_trainings_is_not_rerecorded():
    """Inside engine.generating() each forward pass is an iteration of a trace of its own: the
    training trace keeps its length and is never re-recorded around the blocks. With half the
    parameters in the budget the sets that do not fit stream: from the second block on (the pass's
    trace recorded) every chunk comes by prefetch, once per pass."""
    transformers = pytest.importorskip("transformers")
    model = _llama(transformers, layers=8)
    x = torch.randint(1, 128, (2, 8), generator=torch.Generator().manual_seed(2))
    y = torch.randint(1, 128, (2, 24), generator=torch.Generator().manual_seed(3))
    cfg = gx.GeminiConfig(device="sim", placement_policy="auto", precision="fp32",
                          chunk_config_dict={"chunk_size": 40000})
    traces, fetches = [], []
    with gx.enable(model, cfg) as engine:
        opt = engine.optimizer(torch.optim.AdamW, lr=1e-2)
        runtime = engine.internal.runtime
        for step in range(4):
            if step >= 2:
                params = sum(engine.internal.layout.shard_bytes)
                before = engine.stats()["traffic"]
                with pytest.warns(UserWarning, match=r"do not fit beside the .* KV cache .*: \d+ chunk sets stream "
                                                     r"from the host on every forward.* To keep them resident: a KV "
                                                     r"cache of at most"), \
                        engine.generating(kv_cache_bytes=runtime.device_budget - params // 2) as room:
                    with torch.no_grad():
                        model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=8, do_sample=False)
                after = engine.stats()["traffic"]
                fetches.append({k: after[k] - before[k] for k in ("fetches", "prefetches", "prefetch_wasted")})
                fetches[-1]["streamed"] = room["parameter_sets_streamed"]
            model(input_ids=y, labels=y).loss.backward()
            opt.step()
            opt.zero_grad()
            t = runtime.trace_info()
            traces.append((len(t["recorded"]), t["rerecordings"]))
    assert traces == [traces[0]] * 4 and traces[0][1] == 0, traces
    last = fetches[-1]
    assert last["streamed"] >= 3 and last["fetches"] == 0 and last["prefetch_wasted"] == 0, fetches
    assert 0 < last["prefetches"] <= 8 * last["streamed"], fetches  # 8 passes, each streamed set once


@pytest.mark.parametrize("device", DEVICES)
def test_a_resident_generation_runs_the_model_without_module_hooks_and_puts_them_back(device):
    """Where every parameter chunk fits beside the KV cache, the prompt's forward fetches them and
    the decode steps run the model as it is alone: the manager is asked for no chunk (a second
    generation in the block, 12 tokens, makes no access at all), the tokens are the model's own, and a forward with
    gradients inside the block, and training after it, have the hooks back: the values equal a
    run that never generated (see [Note: a generation with every parameter resident])."""
    transformers = pytest.importorskip("transformers")
    prompts = torch.randint(1, 128, (2, 8), generator=torch.Generator().manual_seed(4))
    y = torch.randint(1, 128, (2, 16), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(prompts)
    on = "cuda" if device == "cuda" else "cpu"  # the model alone where the engine computes: the same kernels
    alone = _llama(transformers).eval().to(on)
    with torch.no_grad():
        expected = [alone.generate(prompts.to(on), attention_mask=mask.to(on), max_new_tokens=n,
                                   do_sample=False).cpu() for n in (4, 12)]

    def run(generate: bool):
        model = _llama(transformers)
        cfg = gx.GeminiConfig(device=device, placement_policy="auto", precision="fp32")
        accesses, losses = [], []
        with gx.enable(model, cfg) as engine:
            opt = engine.optimizer(torch.optim.AdamW, lr=1e-2)
            for step in range(2):
                if generate:
                    with engine.generating(batch_size=2, max_length=20) as room:
                        assert room["parameter_sets_streamed"] == 0
                        for n, tokens in zip((4, 12), expected):
                            before = engine.stats()["traffic"]["accesses"]
                            with torch.no_grad():
                                out = model.generate(prompts.to(engine.compute_device),
                                                     attention_mask=mask.to(engine.compute_device), max_new_tokens=n,
                                                     do_sample=False)
                            accesses.append(engine.stats()["traffic"]["accesses"] - before)
                            if step == 0:
                                assert torch.equal(out.cpu(), tokens)
                        model.train()
                        before = engine.stats()["traffic"]["accesses"]
                        on_device = y.to(engine.compute_device)
                        losses.append(model(input_ids=on_device, labels=on_device).loss)  # hooks back
                        losses[-1].backward()
                        assert engine.stats()["traffic"]["accesses"] > before
                else:
                    on_device = y.to(engine.compute_device)
                    losses.append(model(input_ids=on_device, labels=on_device).loss)
                    losses[-1].backward()
                opt.step()
                opt.zero_grad()
            params = [p.detach().cpu().clone() for p in model.parameters()]
        return [loss.item() for loss in losses], params, accesses

    plain_losses, plain_params, _ = run(False)
    losses, params, accesses = run(True)
    assert accesses[0] > 0 and accesses[1] == 0 and accesses[2:] == accesses[:2], accesses
    assert losses == plain_losses
    assert all(torch.equal(a, b) for a, b in zip(params, plain_params))


def test_closing_the_engine_inside_a_generation_leaves_a_plain_model():
    """close() inside engine.generating(), with the module hooks off: the block ends without an error,
    no hook of the engine is left on the model, and the model computes as a plain one with the values
    training gave it."""
    transformers = pytest.importorskip("transformers")
    model = _llama(transformers)
    x = torch.randint(1, 128, (2, 8), generator=torch.Generator().manual_seed(6))
    engine = gx.enable(model, gx.GeminiConfig(device="sim", precision="fp32")).__enter__()
    opt = engine.optimizer(torch.optim.AdamW, lr=1e-2)
    model(input_ids=x, labels=x).loss.backward()
    opt.step()
    trained = engine.state_dict()
    with engine.generating(batch_size=2, max_length=20), torch.no_grad():
        for _ in range(2):  # the second with the module hooks off
            model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=4, do_sample=False)
        engine.close()
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in model.modules() if m is not model)
    plain = _llama(transformers)
    plain.load_state_dict(trained)
    with torch.no_grad():
        assert torch.equal(model(input_ids=x).logits, plain(input_ids=x).logits)


def test_a_root_that_owns_parameters_keeps_its_hooks_while_the_modules_below_go_without():
    """A model whose root module owns a parameter (sharing a chunk with a child's): inside
    engine.generating() with every chunk held, the forwards after the first compute what the same
    model trained alone computes, and training after the block goes on."""
    class Scaled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = torch.nn.Parameter(torch.full((32,), 1.5))
            self.a, self.b = torch.nn.Linear(32, 32), torch.nn.Linear(32, 32)

        def forward(self, x):
            return self.b(torch.relu(self.a(x * self.scale)))

    torch.manual_seed(0)
    model = Scaled()
    alone = Scaled()
    alone.load_state_dict(model.state_dict())
    x = torch.randn(4, 32)
    with gx.enable(model, gx.GeminiConfig(device="sim", precision="fp32", chunk_config_dict={"chunk_size": 1100})) as e:
        opt, opt_alone = e.optimizer(torch.optim.SGD, lr=0.1), torch.optim.SGD(alone.parameters(), lr=0.1)
        for m, o in ((model, opt), (alone, opt_alone)):
            m(x).sum().backward()
            o.step()
            o.zero_grad()
        with e.generating(kv_cache_bytes=0), torch.no_grad():
            outs = [model(x) for _ in range(3)]
            assert e.internal.hooks.module_hooks_off
        with torch.no_grad():
            assert all(torch.equal(out, alone(x)) for out in outs)
        model(x).sum().backward()
        opt.step()
    assert not torch.equal(model.scale, alone.scale)  # the step after the block reached the root's parameter
