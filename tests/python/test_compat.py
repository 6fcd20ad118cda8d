"""The ColossalAI-style surface: GeminiDDP + GeminiOptimizer(optimizer, model), and Booster."""

import pytest
import torch

import gemini_ext as gx
from parity_utils import CHUNK, LR, WD, batch, make_models, max_relative_difference, train_reference


def test_gemini_ddp_and_gemini_optimizer_train_like_plain_pytorch():
    model, reference = make_models()
    train_reference(reference, 6, torch.device("cpu"))
    ddp = gx.GeminiDDP(model, device="sim", precision="fp32", chunk_config_dict=CHUNK)
    assert isinstance(ddp, torch.nn.Module)
    opt = gx.GeminiOptimizer(torch.optim.AdamW(ddp.parameters(), lr=LR, weight_decay=WD), ddp)
    for step in range(6):
        x, y = batch(model.cfg, step, "cpu")
        ddp.backward(ddp(x, y))
        opt.step()
        opt.zero_grad()
    assert set(ddp.state_dict()) == set(reference.state_dict()), "the wrapped module's own keys"
    plain = ddp.close()
    assert plain is model
    assert max(max_relative_difference(model, reference).values()) <= 1e-5


def test_booster_boosts_and_keeps_the_lr_scheduler_working(tmp_path):
    model, reference = make_models()
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=LR, weight_decay=WD)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=2, gamma=0.5)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    booster = gx.Booster(plugin=gx.GeminiPlugin(device="sim", precision="fp32", chunk_config_dict=CHUNK))
    model_b, opt_b, _, _, sched_b = booster.boost(model, opt, lr_scheduler=sched)
    assert isinstance(model_b, gx.GeminiDDP) and isinstance(opt_b, gx.GeminiOptimizer) and sched_b is sched
    for step in range(6):
        x, y = batch(model.cfg, step, "cpu")
        booster.backward(model_b(x, y), opt_b)
        opt_b.step()
        opt_b.zero_grad()
        sched_b.step()
        reference(x, y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_sched.step()
    assert opt_b.param_groups[0]["lr"] == pytest.approx(LR / 8)
    booster.save_model(model_b, tmp_path / "model.pt")
    booster.save_optimizer(opt_b, tmp_path / "optim.pt")
    model_b.close()
    assert max(max_relative_difference(model, reference).values()) <= 1e-5
    again, _ = make_models(seed=5)
    opt2 = torch.optim.AdamW(again.parameters(), lr=LR, weight_decay=WD)
    model2, opt2, *_ = booster.boost(again, opt2)
    booster.load_model(model2, tmp_path / "model.pt")
    booster.load_optimizer(opt2, tmp_path / "optim.pt")
    assert opt2.state_dict()["state"][0]["step"].item() == 6
    model2.close()
    assert max(max_relative_difference(again, model).values()) == 0.0, "loaded exactly"
    with pytest.raises(TypeError, match="GeminiPlugin"):
        gx.Booster(plugin="gemini")
