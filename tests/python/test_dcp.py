"""torch.distributed.checkpoint (DCP) with the engine: sharded state dicts (DTensors over the
ranks), dcp.save / async_save / load, resharding 2 -> 1, dcp_to_torch_save, the Stateful path."""


import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.state_dict import StateDictOptions

import gemini_ext as gx
from conftest import DEVICES
from dist_utils import run_ranks
from parity_utils import LR, WD, batch, config, make_models

SHARDED = StateDictOptions(full_state_dict=False)
ASYNC = "async"


def _train(model, opt, steps, start, rank=0, world_size=1):
    for step in range(start, start + steps):
        x, y = batch(model.cfg, step, next(model.parameters()).device)
        per = x.shape[0] // world_size
        model(x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]).backward()
        opt.step()
        opt.zero_grad()


def _state(engine, opt):
    return {"model": engine.state_dict(SHARDED), "optim": opt.state_dict(SHARDED)}


def _engine(seed, group, opt_cls=torch.optim.AdamW, device="sim"):
    model, _ = make_models(seed=seed)
    engine = gx.enable(model, config(device, offload_optim_frac=0.5), process_group=group)
    kwargs = {"weight_decay": WD} if opt_cls is torch.optim.AdamW else {"momentum": 0.9, "dampening": 0.5}
    return model, engine, engine.optimizer(opt_cls, lr=LR, **kwargs)


def _save_body(rank, world_size, directory, how, device="sim"):
    group = dist.group.WORLD if dist.is_initialized() else None
    model, engine, opt = _engine(0, group, device=device)
    with engine:
        _train(model, opt, 3, 0, rank, world_size)
        state = _state(engine, opt)
        if world_size > 1:
            from torch.distributed.tensor import DTensor
            value = state["model"]["blocks.0.qkv.weight"]
            assert isinstance(value, DTensor) and value.to_local().shape[0] == value.shape[0] // world_size
        if how == ASYNC:
            dcp.async_save(state, checkpoint_id=f"{directory}/dcp").result()
        else:
            dcp.save(state, checkpoint_id=f"{directory}/dcp")
        del state
        expected = {"model": engine.state_dict(), "optim": opt.state_dict()}
        _train(model, opt, 3, 3, rank, world_size)
        expected["final"] = engine.state_dict()
    if rank == 0:
        torch.save(expected, f"{directory}/expected-{world_size}.pt")


def _load_body(rank, world_size, directory, saved_world_size, device="sim"):
    group = dist.group.WORLD if dist.is_initialized() else None
    expected = torch.load(f"{directory}/expected-{saved_world_size}.pt", weights_only=False)
    model, engine, opt = _engine(1, group, device=device)  # other initial values and a fresh optimizer
    with engine:
        state = _state(engine, opt)
        dcp.load(state, checkpoint_id=f"{directory}/dcp")
        engine.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])
        del state
        got = engine.state_dict()
        for key, value in expected["model"].items():
            assert torch.equal(got[key], value), key
        got = opt.state_dict()
        assert sorted(got["state"]) == sorted(expected["optim"]["state"])
        for pos, entry in expected["optim"]["state"].items():
            for k, v in entry.items():
                assert torch.equal(got["state"][pos][k], v), (pos, k)
        _train(model, opt, 3, 3, rank, world_size)
        final = engine.state_dict()
    for key, value in expected["final"].items():
        if world_size == saved_world_size:  # the same ranks continue exactly as the uninterrupted run
            assert torch.equal(final[key], value), key
        else:  # another world size sums gradients in another order
            assert torch.allclose(final[key], value, rtol=1e-4, atol=1e-6), key


@pytest.mark.parametrize("device", DEVICES)
def test_one_process_saves_and_loads_through_dcp_exactly(tmp_path, device):
    _save_body(0, 1, str(tmp_path), ASYNC, device)
    _load_body(0, 1, str(tmp_path), 1, device)


def test_two_ranks_save_their_shards_and_one_process_loads_them(tmp_path):
    """Saved by two gloo ranks (DTensors: each rank writes its rows), loaded by the same two ranks
    (a bit-exact resume) and resharded into one process; dcp_to_torch_save gives the plain model's
    state dict under the key it was saved with."""
    run_ranks(2, _save_body, str(tmp_path), "sync")
    run_ranks(2, _load_body, str(tmp_path), 2)
    _load_body(0, 1, str(tmp_path), 2)
    dcp_to_torch_save(f"{tmp_path}/dcp", f"{tmp_path}/plain.pt")
    plain = torch.load(f"{tmp_path}/plain.pt", weights_only=False)
    expected = torch.load(f"{tmp_path}/expected-2.pt", weights_only=False)
    reference, _ = make_models()
    assert sorted(plain["model"]) == sorted(reference.state_dict())
    for key, value in expected["model"].items():
        assert torch.equal(plain["model"][key], value), key
    reference.load_state_dict(plain["model"])  # a plain model takes it as it is


def test_a_plain_model_and_its_optimizer_resume_from_the_engines_dcp_checkpoint(tmp_path):
    """The sharded optimizer layout is torch DCP's (state by parameter name): torch's own
    set_state_dict loads the engine's checkpoint into a plain model and torch.optim.AdamW (a
    partial load: torch's groups have flags, such as foreach, that the engine's do not)."""
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    model, engine, opt = _engine(0, None)
    with engine:
        _train(model, opt, 3, 0)
        dcp.save(_state(engine, opt), checkpoint_id=f"{tmp_path}/dcp")
        _train(model, opt, 2, 3)
        expected = engine.state_dict()
    plain, _ = make_models(seed=1)
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=LR, weight_decay=WD)
    model_sd, optim_sd = get_state_dict(plain, plain_opt)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=f"{tmp_path}/dcp", planner=DefaultLoadPlanner(allow_partial_load=True))
    set_state_dict(plain, plain_opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    _train(plain, plain_opt, 2, 3)
    for key, value in plain.state_dict().items():
        assert torch.allclose(value, expected[key], rtol=1e-5, atol=1e-7), key


def test_the_engine_is_a_stateful_and_a_fresh_sgd_resumes_every_parameter(tmp_path):
    """dcp.save({"model": engine}) calls engine.state_dict() (the Stateful protocol); an optimizer
    whose torch state would lack never-stepped parameters (SGD keeps no step) still finds a place
    for every saved state in the sharded layout, and the resume is exact."""
    from torch.distributed.checkpoint.stateful import Stateful
    model, engine, opt = _engine(0, None, torch.optim.SGD)
    with engine:
        assert isinstance(engine, Stateful)
        _train(model, opt, 2, 0)
        dcp.save({"model": engine, "optim": opt.state_dict(SHARDED)}, checkpoint_id=f"{tmp_path}/dcp")
        _train(model, opt, 2, 2)
        expected = engine.state_dict()
    model, engine, opt = _engine(1, None, torch.optim.SGD)
    with engine:
        state = {"model": engine, "optim": opt.state_dict(SHARDED)}
        assert all(float(e["step"]) == 0 for e in state["optim"]["state"].values())
        dcp.load(state, checkpoint_id=f"{tmp_path}/dcp")
        opt.load_state_dict(state["optim"])
        _train(model, opt, 2, 2)
        got = engine.state_dict()
    for key, value in expected.items():
        assert torch.equal(got[key], value), key


def test_sharded_state_dicts_refuse_what_they_cannot_load(tmp_path):
    model, engine, opt = _engine(0, None)
    with engine:
        state = opt.state_dict(SHARDED)
        name = next(iter(state["state"]))
        del state["state"][name]
        with pytest.raises(ValueError, match=f"no state for parameter '{name}'"):
            opt.load_state_dict(state)
        state = opt.state_dict(SHARDED)
        state["param_groups"][0]["params"] = list(reversed(state["param_groups"][0]["params"]))
        with pytest.raises(ValueError, match="same parameters in the same groups"):
            opt.load_state_dict(state)
        with pytest.raises(TypeError, match="StateDictOptions"):
            engine.state_dict(options="sharded")
