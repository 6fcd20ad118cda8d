import pytest

import gemini_ext as gx


def test_defaults_follow_the_spec():
    c = gx.GeminiConfig()
    assert (c.precision, c.placement_policy, c.search_range_m, c.min_chunk_size_m) == ("bf16", "static", 128, 32)
    assert (c.shard_param_frac, c.offload_optim_frac, c.offload_param_frac) == (1.0, 1.0, 0.0)
    assert (c.max_prefetch, c.initial_scale, c.max_norm, c.extra_dp_size, c.device) == (2, 2.0**16, 0.0, 1, "auto")
    assert c.pin_memory and c.master_weights and c.enable_async_reduce and not c.enable_gradient_accumulation


@pytest.mark.parametrize("field", ["shard_param_frac", "offload_optim_frac", "offload_param_frac"])
@pytest.mark.parametrize("value", [-0.1, 1.5, "half", True])
def test_fractions_outside_unit_interval_name_field_value_and_range(field, value):
    with pytest.raises(ValueError) as err:
        gx.GeminiConfig(**{field: value})
    msg = str(err.value)
    assert field in msg and repr(value) in msg and "[0, 1]" in msg


@pytest.mark.parametrize("text,expected", [("512MiB", 512 * 2**20), ("16GiB", 16 * 2**30), ("1.5GB", 1_500_000_000),
                                           (4096, 4096), ("100", 100)])
def test_byte_fields_accept_ints_and_strings(text, expected):
    assert gx.GeminiConfig(gpu_memory_limit=text).gpu_memory_limit == expected
    assert gx.parse_bytes(text, "x") == expected


@pytest.mark.parametrize("bad", ["16 GiBs", "-1", 0, -5, "lots", 1.5, True])
def test_bad_byte_values_are_refused_with_the_field_name(bad):
    with pytest.raises(ValueError, match="sim_capacity"):
        gx.GeminiConfig(sim_capacity=bad)


def test_choices_are_validated():
    with pytest.raises(ValueError, match="precision.*'int8'"):
        gx.GeminiConfig(precision="int8")
    with pytest.raises(ValueError, match="placement_policy"):
        gx.GeminiConfig(placement_policy="greedy")
    with pytest.raises(ValueError, match="device"):
        gx.GeminiConfig(device="tpu")


def test_const_policy_needs_a_budget():
    with pytest.raises(ValueError, match="const_gpu_budget"):
        gx.GeminiConfig(placement_policy="const")
    assert gx.GeminiConfig(placement_policy="const", const_gpu_budget="8GiB").const_gpu_budget == 8 * 2**30


def test_scaler_fields_are_validated():
    with pytest.raises(ValueError, match="backoff_factor"):
        gx.GeminiConfig(backoff_factor=1.5)
    with pytest.raises(ValueError, match="initial_scale"):
        gx.GeminiConfig(initial_scale=0.5, min_scale=1.0)
    with pytest.raises(ValueError, match="growth_interval"):
        gx.GeminiConfig(growth_interval=0)


def test_chunk_config_dict_flat_and_per_world_size():
    flat = gx.GeminiConfig(chunk_config_dict={"chunk_size": 1024})
    assert flat.chunk_config_for(4) == {"chunk_size": 1024, "keep_gathered": False}
    per_ws = gx.GeminiConfig(chunk_config_dict={2: {"chunk_size": 64, "keep_gathered": True}})
    assert per_ws.chunk_config_for(2) == {"chunk_size": 64, "keep_gathered": True}
    with pytest.raises(ValueError, match="world sizes \\[2\\]"):
        per_ws.chunk_config_for(1)
    with pytest.raises(ValueError, match="chunk_size"):
        gx.GeminiConfig(chunk_config_dict={"chunk_size": 0})
    with pytest.raises(ValueError, match="unknown key"):
        gx.GeminiConfig(chunk_config_dict={"chunk_size": 8, "colour": "red"})


def test_replace_refuses_unknown_fields():
    with pytest.raises(TypeError, match="no field.*'chunk_sise'"):
        gx.GeminiConfig().replace(chunk_sise=3)
    # a typo gets the field it was meant to be, when built and when overridden through enable()
    with pytest.raises(TypeError, match="no field 'placement_polcy' \\(did you mean 'placement_policy'\\?\\)"):
        gx.GeminiConfig(placement_polcy="auto")
    with pytest.raises(TypeError, match="did you mean 'max_norm'"):
        gx.GeminiConfig().replace(max_nrom=1.0)
    assert gx.GeminiConfig().replace(max_norm=1.0).max_norm == 1.0


@pytest.mark.parametrize("alias, mode", [
    ({}, "in_place"),
    ({"host_step_speculation": "spares"}, "spares"),
    ({"host_step_speculation": "off"}, "at_step"),
    ({"overlap_optimizer": False}, "serial"),
    ({"optimizer_step_in_backward": True}, "in_backward"),
])
def test_host_steps_and_its_aliases_say_the_same(alias, mode):
    """One knob for when the host steps; the three older fields are its aliases, both ways."""
    fields = ("host_steps", "overlap_optimizer", "host_step_speculation", "optimizer_step_in_backward")
    by_alias, by_knob = gx.GeminiConfig(**alias), gx.GeminiConfig(host_steps=mode)
    assert by_alias.host_steps == mode
    assert [getattr(by_alias, f) for f in fields] == [getattr(by_knob, f) for f in fields]
    assert by_knob.overlap_optimizer == (mode != "serial")
    assert by_knob.optimizer_step_in_backward == (mode == "in_backward")
    # an alias that agrees with the knob is accepted; an override replaces what was resolved
    assert gx.GeminiConfig(host_steps=mode, **alias).host_steps == mode
    assert by_knob.replace(overlap_optimizer=False).host_steps == "serial"
    assert by_alias.replace(host_steps="spares").host_step_speculation == "spares"
    assert by_alias.replace(max_prefetch=2).host_steps == mode


def test_host_steps_refuses_contradictions_and_unknown_modes():
    with pytest.raises(ValueError, match=r"host_steps='spares' and overlap_optimizer=False ask for different"):
        gx.GeminiConfig(host_steps="spares", overlap_optimizer=False)
    with pytest.raises(ValueError, match=r"overlap_optimizer=False and optimizer_step_in_backward=True"):
        gx.GeminiConfig(overlap_optimizer=False, optimizer_step_in_backward=True)
    with pytest.raises(ValueError, match=r"host_steps: expected one of .*'in_backward'.*got 'early'"):
        gx.GeminiConfig(host_steps="early")
    with pytest.raises(ValueError, match=r"max_norm=1.0 needs that norm first"):  # in backward refuses clipping
        gx.GeminiConfig(host_steps="in_backward", max_norm=1.0)
