import warnings

import pytest
import torch

import gemini_ext as gx
from gemini_ext.models import GPT, GPT_PRESETS


def test_search_waste_matches_the_manager_built_with_that_size():
    model = GPT(GPT_PRESETS["tiny"])
    found = gx.search_chunk_configuration(model, search_range_m=0.05, min_chunk_size_m=0.01, precision="fp32")
    assert found["order"] == "definition" and found["chunk_size"] >= int(0.01 * 2**20)
    with gx.enable(model, device="sim", precision="fp32", offload_optim_frac=0.0,
                   chunk_config_dict={"chunk_size": found["chunk_size"]}) as engine:
        stats = engine.stats()
    assert stats["wasted_bytes"] == found["wasted_bytes"]
    assert stats["num_param_chunks"] == found["num_chunks"]


def test_search_picks_the_least_waste_in_range():
    model = torch.nn.Sequential(*[torch.nn.Linear(30, 30, bias=False) for _ in range(6)])  # 6 x 900 elements
    found = gx.search_chunk_configuration(model, search_range_m=3000 / 2**20, min_chunk_size_m=1700 / 2**20,
                                          search_interval=1, alignment_bytes=4, precision="fp32")
    assert found["chunk_size"] == 1800 and found["wasted_bytes"] == 0 and found["num_chunks"] == 3


def test_execution_order_changes_the_layout():
    sizes = [6, 6, 4, 4]
    model = torch.nn.ParameterList([torch.nn.Parameter(torch.zeros(n)) for n in sizes])
    kwargs = dict(search_range_m=0, min_chunk_size_m=10 / 2**20, search_interval=1, alignment_bytes=4,
                  precision="fp32", filter_exlarge_params=False)
    by_definition = gx.search_chunk_configuration(model, **kwargs)
    order = [model[0], model[2], model[1], model[3]]
    by_execution = gx.search_chunk_configuration(model, execution_order=order, **kwargs)
    assert by_definition["wasted_bytes"] == 10 * 4 and by_execution["wasted_bytes"] == 0
    assert by_execution["order"] == "execution"


def test_tied_parameters_count_once():
    model = GPT(GPT_PRESETS["tiny"])
    untied = GPT(GPT_PRESETS["tiny"].__class__(**{**GPT_PRESETS["tiny"].__dict__, "tie_embeddings": False}))
    a = gx.search_chunk_configuration(model, 0, 0.01, precision="fp32")
    b = gx.search_chunk_configuration(untied, 0, 0.01, precision="fp32")
    assert b["num_chunks"] >= a["num_chunks"]
    total = sum(p.numel() for p in model.parameters())
    assert total == GPT_PRESETS["tiny"].num_parameters()


def test_bad_inputs():
    with pytest.raises(ValueError, match="no parameters"):
        gx.search_chunk_configuration(torch.nn.ReLU())
    with pytest.raises(ValueError, match="not a parameter"):
        gx.search_chunk_configuration(torch.nn.Linear(2, 2), execution_order=[torch.nn.Parameter(torch.zeros(2))])
    with pytest.raises(ValueError, match="precision"):
        gx.search_chunk_configuration(torch.nn.Linear(2, 2), precision="fp8")


def test_seven_billion_layout_searches_in_milliseconds():
    cfg = GPT_PRESETS["6.7b"]
    with torch.device("meta"):
        model = GPT(cfg)
    found = gx.search_chunk_configuration(model)  # defaults: range 128 Mi, min 32 Mi elements
    print(f"7B search: {found}")
    assert found["chunk_size"] >= 32 * 2**20
    assert found["wasted_frac"] < 0.05


def _interleaved(pairs=4):
    """Parameters of 3008 and 992 elements in turn (multiples of the 32-element alignment):
    chunks of 3008 to 3508 elements hold one each (a 992 alone wastes two thirds of its chunk),
    chunks of 4000 hold a pair exactly."""
    model = torch.nn.Module()
    for i in range(pairs):
        model.register_parameter(f"big{i}", torch.nn.Parameter(torch.randn(3008)))
        model.register_parameter(f"small{i}", torch.nn.Parameter(torch.randn(992)))
    return model


def test_enable_names_a_wider_search_range_when_the_search_wastes_much():
    model = _interleaved()
    narrow, least = 500 / 2**20, 3008 / 2**20
    found = gx.search_chunk_configuration(model, narrow, least, precision="fp32")
    assert found["wasted_frac"] > 0.3, found  # every chunk holds one parameter
    hint = rf"search_range_m={2 * narrow:g} finds 4,000 elements, wasting 0.0%\. Pass search_range_m={2 * narrow:g}"
    with pytest.warns(UserWarning, match=hint) as caught:
        with gx.enable(model, device="sim", precision="fp32", search_range_m=narrow, min_chunk_size_m=least) as engine:
            assert engine.chunk_size == found["chunk_size"]  # the warning only advises
    assert f"{found['wasted_frac']:.1%}" in str(caught[0].message)
    # with the range it names, the chunks hold a pair each and nothing is said
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with gx.enable(_interleaved(), device="sim", precision="fp32", search_range_m=2 * narrow,
                       min_chunk_size_m=least) as engine:
            assert engine.chunk_size == 4000 and engine.stats()["wasted_bytes"] == 0
