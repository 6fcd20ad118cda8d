"""gx.estimate and `gemini-ext estimate`: the plan, memory and predicted step time of a model
built on meta, with the machine described by arguments (this machine has no GPU). The step-time
model's accuracy is measured on the H200 (docs/BENCHMARKS.md); here: the plan is the one enable()
would make, the parts add up, the figures move the way the model says, and bad input is refused."""

import dataclasses
import json

import pytest
import torch

import gemini_ext as gx
from gemini_ext.__main__ import main as cli
from gemini_ext.estimate import HOST_DISPATCH_S_PER_TENSOR_PASS, LOGIT_BYTES_PER_VOCAB, model_shape
from gemini_ext.models import GPT, GPT_PRESETS
from gemini_ext.placement.optimizer_lanes import RATE_SHARES_WHILE_BOTH_RUN

H200 = dict(device_bytes=150_109_880_320, device_name="NVIDIA H200", cpu_optimizer_elements_per_s=4.6e9)


def _meta_gpt(preset):
    with torch.device("meta"):
        return GPT(GPT_PRESETS[preset])


def test_the_layout_is_the_one_enable_builds():
    config = gx.GeminiConfig(device="sim", placement_policy="auto", search_range_m=1, min_chunk_size_m=0.1)
    e = gx.estimate(_meta_gpt("small"), config, tokens_per_step=4096, host_bytes="64GiB", **H200)
    model = GPT(GPT_PRESETS["small"])
    with gx.enable(model, config) as engine:
        stats = engine.stats()
    assert (e["plan"]["chunk_size"], e["plan"]["chunk_sets"]) == (stats["chunk_size"], stats["num_param_chunks"])
    assert e["plan"]["optim_sets_on_host"] == 0, "a small model's state all fits the device"
    assert e["step_parts_s"]["optimizer_wait"] == 0.0


def test_a_15b_model_on_one_h200_splits_its_state_and_waits_for_the_host():
    """The 15.4B GPT with 125.5 GiB of host: the host holds the state of the back sets (auto's
    plan on the H200 was 36 sets on the device, 38 on the host at 16k tokens per step), the
    parts add up, and the GPU's share (MFU) grows with the tokens per step."""
    model = _meta_gpt("15b")
    by_tokens = {t: gx.estimate(model, tokens_per_step=t, host_bytes="125.5GiB", **H200) for t in (1024, 16384)}
    big = by_tokens[16384]
    assert (big["plan"]["optim_sets_on_device"], big["plan"]["optim_sets_on_host"]) == (36, 38)
    assert big["plan"]["link_lane_sets"] > 0 and big["step_parts_s"]["optimizer_wait"] > 0
    assert big["step_time_s"] == pytest.approx(sum(big["step_parts_s"].values()))
    lanes = big["lanes"]["busy_seconds"]  # as engine.stats()["lanes"] measures them: both lanes step host sets
    assert lanes["gpu"] == big["step_parts_s"]["gpu"] and lanes["cpu"] > 0 and lanes["link"] > 0
    shares = RATE_SHARES_WHILE_BOTH_RUN  # each lane at its share of its rate while both step
    assert (lanes["cpu"] * big["rates"]["cpu_optimizer_elements_per_s"] * shares[0] + lanes["link"] *
            big["rates"]["link_optimizer_elements_per_s"] * shares[1]) == pytest.approx(
        big["plan"]["host_stepped_parameters"])
    assert big["lanes"]["bound"] == max(lanes, key=lanes.get)
    assert big["host_bytes"] <= 125.5 * 2**30 and big["device_bytes"] <= H200["device_bytes"]
    assert by_tokens[1024]["activation_bytes"] * 16 == big["activation_bytes"]
    assert by_tokens[1024]["mfu"] < big["mfu"] < 0.6
    assert all(p.is_meta for p in model.parameters()), "nothing was materialised"


def test_a_loss_in_token_pieces_counts_one_pieces_logits():
    """loss_chunk_tokens (given, or read from gemini_ext's GPT): the logits' bytes count for one
    piece of tokens, not the batch, and then the peak is the larger of that piece and one block's
    recomputed activations (its backward); at 15.4B and 16k tokens that frees the device of about
    4 GB, so fewer parameter bytes are evicted, and the command line takes it too."""
    model = _meta_gpt("15b")
    whole = gx.estimate(model, tokens_per_step=16384, host_bytes="125.5GiB", **H200)
    pieces = gx.estimate(model, tokens_per_step=16384, host_bytes="125.5GiB", loss_chunk_tokens=2048, **H200)
    shape = model_shape(model)
    piece_bytes = 2048 * 32000 * LOGIT_BYTES_PER_VOCAB
    block_bytes = 16384 * shape.block_activation_bytes_per_token()
    assert block_bytes > piece_bytes, "at 16k tokens a block's recompute outweighs a 2048-token piece of logits"
    assert whole["activation_bytes"] - pieces["activation_bytes"] == \
        pytest.approx(16384 * 32000 * LOGIT_BYTES_PER_VOCAB - block_bytes, abs=2)
    assert whole["plan"]["evicted_param_bytes"] > pieces["plan"]["evicted_param_bytes"]
    assert pieces["step_time_s"] < whole["step_time_s"]
    with torch.device("meta"):
        chunked = GPT(dataclasses.replace(GPT_PRESETS["15b"], loss_chunk_tokens=2048))
    assert gx.estimate(chunked, tokens_per_step=16384, host_bytes="125.5GiB", **H200)["activation_bytes"] == \
        pieces["activation_bytes"]
    with pytest.raises(ValueError, match="loss_chunk_tokens must be an int >= 0"):
        gx.estimate(model, tokens_per_step=16384, loss_chunk_tokens=-1, **H200)


def test_the_step_in_backward_hides_the_host_steps_behind_a_long_backward(capsys):
    """With optimizer_step_in_backward (no clipping) the host sets step from the backward pass on:
    at 16k tokens the 15.4B GPT's backward outlasts the host's 8G parameters, so nothing is waited
    for, no set goes to the link lane, and the command line takes it too; at 1k it is too short."""
    model = _meta_gpt("15b")
    config = gx.GeminiConfig(placement_policy="auto", optimizer_step_in_backward=True)
    big = gx.estimate(model, config, tokens_per_step=16384, host_bytes="125.5GiB", loss_chunk_tokens=2048, **H200)
    clipped = gx.estimate(model, tokens_per_step=16384, host_bytes="125.5GiB", loss_chunk_tokens=2048, **H200)
    assert big["plan"]["optim_sets_on_host"] == clipped["plan"]["optim_sets_on_host"] > 30
    assert big["step_parts_s"]["optimizer_wait"] == 0.0 < clipped["step_parts_s"]["optimizer_wait"]
    assert big["plan"]["link_lane_sets"] == 0 and big["mfu"] > clipped["mfu"]
    small = gx.estimate(model, config, tokens_per_step=1024, host_bytes="125.5GiB", **H200)
    assert small["step_parts_s"]["optimizer_wait"] > 1.0
    assert cli(["estimate", "--preset", "15b", "--tokens-per-step", "16384", "--max-norm", "0", "--step-in-backward",
                "--host-bytes", "125.5GiB", "--device-bytes", str(H200["device_bytes"]), "--device-name", "H200",
                "--cpu-rate", "4.6e9", "--loss-chunk-tokens", "2048", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["step_parts_s"]["optimizer_wait"] == 0.0


def test_refusals_name_the_argument():
    model = _meta_gpt("tiny")
    with pytest.raises(ValueError, match="tokens_per_step"):
        gx.estimate(model, tokens_per_step=0, **H200)
    with pytest.raises(ValueError, match="peak_tflops"):
        gx.estimate(model, tokens_per_step=64, device_bytes="80GB", device_name="a GPU not in the table")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="device_bytes"):
            gx.estimate(model, tokens_per_step=64)
    # neither the host nor the device holds a 15B model's state: the plan, said not to fit the host
    e = gx.estimate(_meta_gpt("15b"), tokens_per_step=1024, device_bytes="24GiB", host_bytes="32GiB",
                    device_name="H200", cpu_optimizer_elements_per_s=4.6e9)
    assert e["fits"]["host"] is False and e["host_bytes"] > 32 * 2**30 and e["plan"]["chunk_sets"] > 0


def test_the_command_line_prints_the_estimate(capsys):
    assert cli(["estimate", "--preset", "small", "--tokens-per-step", "2048", "--device-bytes", "80GB",
                "--host-bytes", "64GiB", "--device-name", "H100", "--cpu-rate", "4e9"]) == 0
    out = capsys.readouterr().out
    assert "plan" in out and "predicted" in out and "MFU" in out
    args = ["estimate", "--preset", "small", "--tokens-per-step", "2048", "--device-bytes", "80GB", "--host-bytes",
            "64GiB", "--device-name", "H100", "--cpu-rate", "4e9", "--json"]
    activations = []
    for extra in ([], ["--loss-chunk-tokens", "512"]):
        assert cli(args + extra) == 0
        activations.append(json.loads(capsys.readouterr().out)["activation_bytes"])
    assert activations[1] < activations[0]


def test_the_8_byte_state_fits_a_25b_model_the_full_state_does_not(capsys):
    """25.8B parameters on one H200 with 120 GiB of host: 16 bytes a parameter (412 GB) fit neither,
    8 (206 GB) fit both together; the command line takes the state's options."""
    model = _meta_gpt("25b")
    full = gx.estimate(model, gx.GeminiConfig(placement_policy="auto"), tokens_per_step=8192, host_bytes="120GiB",
                       **H200)
    assert full["fits"]["host"] is False
    small = gx.GeminiConfig(placement_policy="auto", precision="bf16", optimizer_state_dtype="bf16",
                            master_weights=False)
    e = gx.estimate(model, small, tokens_per_step=8192, host_bytes="120GiB", **H200)
    assert e["plan"]["optim_sets_on_host"] > 0 and e["host_bytes"] <= 120 * 2**30
    assert e["device_bytes"] + e["host_bytes"] >= 8 * 25.7e9, "8 bytes a parameter, somewhere"
    with pytest.raises(NotImplementedError, match="master_weights=False with precision='bf16' and optimizer_state"):
        gx.estimate(model, gx.GeminiConfig(master_weights=False), tokens_per_step=8192, **H200)
    assert cli(["estimate", "--preset", "25b", "--tokens-per-step", "8192", "--device-bytes", "150109880320",
                "--host-bytes", "120GiB", "--device-name", "H200", "--cpu-rate", "4.6e9",
                "--optimizer-state-dtype", "bf16", "--no-master-weights"]) == 0
    assert "predicted" in capsys.readouterr().out


def test_at_few_tokens_the_hosts_dispatch_bounds_the_gpu_part():
    """Each pass costs the host a fixed time per parameter tensor: at 1024 tokens a 6.7B GPT's GPU
    work (about 0.1 s) is shorter than three passes' dispatch; at 16k tokens the FLOPs bound."""
    model = _meta_gpt("6.7b")
    tensors = len(list(model.parameters()))
    per_pass = tensors * HOST_DISPATCH_S_PER_TENSOR_PASS
    for checkpointing, passes in ((True, 3), (False, 2)):
        few = gx.estimate(model, tokens_per_step=1024, host_bytes="125.5GiB", checkpointing=checkpointing, **H200)
        assert few["step_parts_s"]["gpu"] == pytest.approx(passes * per_pass)
    many = gx.estimate(model, tokens_per_step=16384, host_bytes="125.5GiB", **H200)
    assert many["step_parts_s"]["gpu"] > 5 * 3 * per_pass


def test_long_sequences_add_their_attention_work_and_a_measured_rate_replaces_the_peaks():
    """Per token, layer and causal forward 2 d (s - 1024) FLOPs beyond 1024-token sequences, in the
    forward, its recompute and the backward (2.5 forwards): at 16k tokens of one sequence the 6.7B
    GPT's GPU part grows by that work at the same efficiency; 1024-token sequences add nothing."""
    model = _meta_gpt("6.7b")
    cfg = GPT_PRESETS["6.7b"]
    base = gx.estimate(model, tokens_per_step=16384, host_bytes="125.5GiB", **H200)
    assert gx.estimate(model, tokens_per_step=16384, host_bytes="125.5GiB", seq_len=1024,
                       **H200)["step_parts_s"]["gpu"] == base["step_parts_s"]["gpu"]
    long = gx.estimate(model, tokens_per_step=16384, host_bytes="125.5GiB", seq_len=16384, **H200)
    attention = 2 * cfg.d_model * (16384 - 1024) * 16384 * cfg.n_layers * (1 + 1 + 2.5)
    n = sum(p.numel() for p in model.parameters())
    linear = 16384 * (2 * n * 2 + 4 * n)  # the forward, its recompute, the backward
    assert long["step_parts_s"]["gpu"] == pytest.approx(base["step_parts_s"]["gpu"] * (linear + attention) / linear)
    with pytest.raises(ValueError, match="seq_len must be a positive int"):
        gx.estimate(model, tokens_per_step=16384, host_bytes="125.5GiB", seq_len=0, **H200)
    # a measured rate in place of the peak's efficiency: half the rate, twice the GPU's part
    half = gx.estimate(model, tokens_per_step=16384, host_bytes="125.5GiB",
                       gpu_flops_per_s=base["rates"]["gpu_flops_per_s"] / 2, **H200)
    assert half["step_parts_s"]["gpu"] == pytest.approx(2 * base["step_parts_s"]["gpu"])
    with pytest.raises(ValueError, match="gpu_flops_per_s must be > 0"):
        gx.estimate(model, tokens_per_step=16384, host_bytes="125.5GiB", gpu_flops_per_s=0, **H200)


def test_steps_from_backward_overlap_the_next_forward_in_its_order():
    """Two host sets at the back of four equal ones, a 1 s backward and forward, 1 element/s: the
    back set is ready at 0.25 s and done at 1.25 s, the other at 2.25 s, which the forward reaches
    at 1.5 s: 0.75 s waited, where counting all past the backward as exposed says 1.25 s."""
    from gemini_ext.placement.optimizer_split import predicted_exposed_optimizer_seconds as exposed
    args = ([1, 1, 1, 1], [False, False, True, True], 1.0, 1.0)
    assert exposed(*args, during_backward=True, forward_seconds=1.0) == pytest.approx(0.75)
    assert exposed(*args, during_backward=True) == pytest.approx(1.25)


def test_the_command_line_speaks_in_flags_says_what_does_not_fit_and_prints_its_rates(capsys):
    """User errors are one line naming the flags (no traceback, exit status 2); a plan larger than
    the device is printed with how much it is over (exit status 1); the CPU rate used is printed
    with its source; the chunk search's flags exist."""
    if not torch.cuda.is_available():
        assert cli(["estimate", "--preset", "tiny", "--tokens-per-step", "64"]) == 2
        err = capsys.readouterr().err
        assert "--device-bytes" in err and "--device-name" in err and "device_bytes=" not in err, err
        assert "Traceback" not in err
    assert cli(["estimate", "--preset", "7b", "--tokens-per-step", "64"]) == 2  # a wrong argument
    assert "unknown preset '7b'" in capsys.readouterr().err
    # each fix a message names is a flag the command has
    machine = ["--device-bytes", "80GB", "--host-bytes", "64GiB", "--cpu-rate", "4e9"]
    assert cli(["estimate", "--preset", "small", "--tokens-per-step", "2048", *machine]) == 2
    err = capsys.readouterr().err
    assert "no --device-name was given" in err and "--device-name (one of 'H200'" in err and "--peak-tflops" in err
    assert cli(["estimate", "--preset", "small", "--tokens-per-step", "2048", *machine, "--device-name", "H100",
                "--policy", "const"]) == 2
    assert "Pass e.g. --const-gpu-budget '8GiB'" in capsys.readouterr().err
    assert cli(["estimate", "--preset", "small", "--tokens-per-step", "2048", *machine, "--device-name", "H100",
                "--policy", "const", "--const-gpu-budget", "8GiB"]) == 0
    assert capsys.readouterr().out.startswith("plan ")
    # a host too small for what the device cannot take either: the plan, its overage, exit status 1
    assert cli(["estimate", "--preset", "6.7b", "--tokens-per-step", "8192", "--device-bytes", "80GB",
                "--device-name", "H100", "--host-bytes", "16GiB", "--cpu-rate", "4e9"]) == 1
    out = capsys.readouterr().out
    assert out.startswith("plan ") and "does not fit: the host needs" in out and "GiB over" in out, out
    assert cli(["estimate", "--preset", "tiny", "--tokens-per-step", "0", "--device-bytes", "80GB",
                "--device-name", "H100", "--cpu-rate", "4e9"]) == 2
    assert "--tokens-per-step must be a positive int" in capsys.readouterr().err
    assert cli(["estimate", "--preset", "1.3b", "--tokens-per-step", "8192", "--device-bytes", "4GiB",
                "--device-name", "H100", "--host-bytes", "64GiB", "--cpu-rate", "4e9"]) == 1
    out = capsys.readouterr().out
    assert "does not fit: the device needs" in out and "GiB over" in out and "--tokens-per-step" in out, out
    assert "CPU Adam 4.00 G elements/s (given)" in out, out
    assert cli(["estimate", "--preset", "small", "--tokens-per-step", "2048", "--device-bytes", "80GB",
                "--host-bytes", "64GiB", "--device-name", "H100", "--search-range-m", "0.5",
                "--min-chunk-size-m", "0.25", "--json"]) == 0
    e = json.loads(capsys.readouterr().out)
    assert e["fits"] == {"device": True, "device_capacity_bytes": 80 * 10**9, "device_total_bytes": 80 * 10**9,
                         "host": True,
                         "host_available_bytes": 64 * 2**30}
    assert e["plan"]["chunk_size"] <= 2**19 and e["rates"]["cpu_optimizer_source"] == "measured here"
    # the chunk search's warning as the command prints it: the flag, and no knob it lacks
    from gemini_ext.__main__ import in_flags
    assert in_flags("found chunks of 5 elements; search_range_m=256 finds 4. Pass search_range_m=256 (or a "
                    "chunk_config_dict) to use that memory.") == \
        "found chunks of 5 elements; --search-range-m 256 finds 4. Pass --search-range-m 256 to use that memory."


def test_activation_offload_moves_the_blocks_inputs_to_the_host():
    """activation_offload="on": the inputs of all blocks but two leave the device (L d bf16 bytes
    per token each) and the host holds every one; the copies add what the blocks' passes do not
    hide, nothing at 16k tokens on the H200's link and more at a slow one."""
    model = _meta_gpt("6.7b")
    shape = model_shape(model)
    tokens = 16384
    off = gx.estimate(model, tokens_per_step=tokens, host_bytes="125.5GiB", **H200)
    on = gx.estimate(model, gx.GeminiConfig(placement_policy="auto", activation_offload="on"), tokens_per_step=tokens,
                     host_bytes="125.5GiB", **H200)
    per_block = tokens * shape.width * 2
    assert off["activation_bytes"] - on["activation_bytes"] == per_block * (shape.layers - 2)
    assert on["activation_offload"]["host_bytes"] == per_block * shape.layers
    assert on["step_parts_s"]["activation_copies"] == 0.0 and off["step_parts_s"]["activation_copies"] == 0.0
    assert on["step_time_s"] == pytest.approx(sum(on["step_parts_s"].values()))
    # a GPU so fast that the host's dispatch bounds the passes (1.2 ms a block): the copies (2.4 ms) show
    slow = gx.estimate(model, gx.GeminiConfig(placement_policy="auto", activation_offload="on"),
                       tokens_per_step=tokens, host_bytes="125.5GiB", gpu_flops_per_s=1e18, **H200)
    assert slow["step_parts_s"]["activation_copies"] > 0


def test_planned_activations_keep_blocks_where_the_chunks_leave_room():
    """activation_checkpointing="auto": the core's plan over the room the chunks leave. On the
    whole H200 a 6.7B model's chunks leave room for some blocks' activations (less recompute, a
    shorter step than checkpointing every block); under a 24 GiB budget at most the one the
    measured forward kept (its room is given back), and the other inputs
    go to the host with offload on."""
    model = _meta_gpt("6.7b")
    layers = model_shape(model).layers
    every = gx.estimate(model, gx.GeminiConfig(placement_policy="auto", activation_checkpointing="on"),
                        tokens_per_step=16384, host_bytes="125.5GiB", **H200)
    auto = gx.estimate(model, gx.GeminiConfig(placement_policy="auto", activation_checkpointing="auto"),
                       tokens_per_step=16384, host_bytes="125.5GiB", **H200)
    plan = auto["activation_plan"]
    assert 0 < plan["keep"] < layers and plan["keep"] + plan["recompute"] == layers and plan["fits"], plan
    assert auto["step_parts_s"]["gpu"] < every["step_parts_s"]["gpu"]
    assert auto["activation_bytes"] > every["activation_bytes"] and auto["fits"]["device"], auto
    assert every["activation_plan"] is None
    small = gx.estimate(model, gx.GeminiConfig(placement_policy="auto", activation_checkpointing="auto",
                                               activation_offload="on", gpu_memory_limit="24GiB"),
                        tokens_per_step=16384, host_bytes="125.5GiB", **H200)
    kept = small["activation_plan"]["keep"]  # at most the block the measured forward kept: its room is given back
    assert kept <= 1 and small["activation_plan"]["offload"] == layers - kept, small
    assert small["activation_offload"]["host_bytes"] == (layers - kept) * 16384 * 4096 * 2


def test_a_gated_mlp_counts_its_inner_width():
    """transformers' Llama (gate and up projections of the intermediate size): 30 d + 8 i bytes of
    activations per token and block; the project's GPT (one 4 d projection) and a Mixtral-style MoE
    (experts held as stacked tensors, not Linear layers): 34 d."""
    transformers = pytest.importorskip("transformers")

    def meta(cls, **fields):
        with torch.device("meta"):
            return transformers.AutoModelForCausalLM.from_config(getattr(transformers, cls)(**fields))
    llama = model_shape(meta("LlamaConfig", hidden_size=64, intermediate_size=176, num_hidden_layers=3,
                             num_attention_heads=4, num_key_value_heads=2, vocab_size=100))
    assert (llama.layers, llama.width, llama.gated_mlp_width) == (3, 64, 176)
    assert llama.block_activation_bytes_per_token() == 30 * 64 + 8 * 176
    moe = model_shape(meta("MixtralConfig", hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, vocab_size=100))
    gpt = model_shape(_meta_gpt("small"))
    assert moe.gated_mlp_width == gpt.gated_mlp_width == 0
    assert gpt.block_activation_bytes_per_token() == 34 * gpt.width


def test_the_planners_first_iteration_sets_the_chunk_budget_as_the_engine_measured_it():
    """activation_checkpointing and activation_offload "auto": the placement plans from the first
    iteration, whose forward recomputes every block (block 0's activations counted by a forward of
    its own, dropped at once) and whose backward recomputes one: one block's activations beside the
    inputs in flight. transformers' LLaMA-7B config on an H100, 4 x 2048 tokens' loss pieces of
    8192. The engine that kept block 0 through its first iteration measured, at 16 x 2048 tokens and
    40 GiB, a non-model peak of 14.1 GiB and gave the chunks 21.7 GiB (3 optimizer sets on the
    device); one block less leaves them 9.3 GiB more, less the 1.5 GiB the device holds outside torch
    (the CUDA context, counted against a gpu_memory_limit as on a card of that size): 7 sets, and the
    plan fits its room. At 32 x 2048
    tokens and 24 GiB the budget stays below the parameters' 13.2 GiB, so they stream."""
    transformers = pytest.importorskip("transformers")
    with torch.device("meta"):
        llama = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(
            hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
            num_key_value_heads=32, vocab_size=32000, max_position_embeddings=2048))
    h100 = dict(device_bytes=85017493504, device_name="H100", host_bytes="125GiB", cpu_optimizer_elements_per_s=5e9,
                loss_chunk_tokens=8192, seq_len=2048)
    planned = dict(placement_policy="auto", max_norm=1.0, activation_checkpointing="auto", activation_offload="auto")
    mid = gx.estimate(llama, gx.GeminiConfig(gpu_memory_limit="40GiB", **planned), tokens_per_step=16 * 2048, **h100)
    assert mid["plan"]["chunk_budget_bytes"] == pytest.approx((21.7 + 9.3 - 1.5) * 2**30, rel=0.05), mid["plan"]
    assert mid["plan"]["evicted_param_bytes"] == 0 and mid["plan"]["optim_sets_on_device"] == 7, mid["plan"]
    assert mid["activation_plan"]["fits"] and mid["warm_up"]["refused"] is False, mid["activation_plan"]
    low = gx.estimate(llama, gx.GeminiConfig(gpu_memory_limit="24GiB", **planned), tokens_per_step=32 * 2048, **h100)
    assert low["plan"]["chunk_budget_bytes"] < 13.2 * 2**30 and low["plan"]["evicted_param_bytes"] > 7 * 2**30, \
        low["plan"]
