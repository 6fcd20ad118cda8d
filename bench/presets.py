"""The benchmarks' one entry point's registry: the runners (one script per kind of comparison, each
running every system in a fresh process and writing markdown and JSON rows), the systems and the
models they know, and named presets, each the exact command behind a figure of README.md or
docs/BENCHMARKS.md. `python -m bench` reads this file (bench/__main__.py)."""

from __future__ import annotations

import dataclasses

RUNNERS = {  # name -> (script under bench/, what it compares)
    "hf_models": ("hf_models.py", "transformers' causal LMs: gemini_ext's modes, FSDP2, DeepSpeed, plain, GPU alone"),
    "hf_map": ("hf_map.py", "one model over budgets x shapes: gemini_ext with activations planned, GPU alone, the "
                            "bound and gx.estimate's prediction per row"),
    "offload": ("offload.py", "the project's GPT: gemini_ext's policies, FSDP2, DeepSpeed, ColossalAI, plain"),
    "large_models": ("large_models.py", "the project's GPT at 6.7B-25.8B on one GPU, with the estimate per row"),
    "trainer_workers": ("trainer_workers.py", "transformers' Trainer with DataLoader workers: host memory"),
    "rl_phases": ("rl_phases.py", "a GRPO-shaped loop: generation, training, the weight stream, offload and reload"),
    "trl_grpo": ("trl_grpo.py", "TRL's GRPOTrainer under gemini_ext (the mixin), alone, and under DeepSpeed offload"),
    "cpu_adam": ("cpu_adam.py", "the CPU Adam kernel against torch and the host's memory bandwidth"),
}


# The runners whose rows a preset's record keeps (bench/records.py), and the option naming their output.
RECORDED_BY = {"hf_models": "--out", "hf_map": "--out", "rl_phases": "--json-out", "trl_grpo": "--out"}
PEAK_TFLOPS = 989.0  # the runners' default: the dense bf16 peak of an H100 SXM and of an H200


@dataclasses.dataclass(frozen=True)
class Preset:
    runner: str
    args: tuple
    reproduces: str  # the figure, and where it is reported
    needs_gpu: bool = True  # its figures are a GPU's: refused where torch sees none

    def command(self) -> list[str]:
        return [f"bench/{RUNNERS[self.runner][0]}", *self.args]


# LLaMA-7B, 4 x 2048 tokens (HF's gradient checkpointing), at 40 GiB, 24 GiB and the whole device.
_LLAMA_4K = ("--models", "llama-7b", "--budgets", "40GiB,24GiB,whole", "--steps", "7", "--timeout", "150",
             "--systems", "gemini")
# The activations planned by the engine: over HF's checkpointing and over the engine's own.
_MAP = ("--models", "llama-7b", "--systems", "gemini-hf-act,gemini-act", "--steps", "4")
PRESETS = {
    "llama7b-gpu-alone": Preset(
        "hf_models", ("--models", "llama-7b", "--budgets", "whole", "--systems", "gpu-alone", "--steps", "7",
                      "--timeout", "150"),
        "README: the GPU alone at 4 x 2048 tokens (forward and backward, parameters resident, no optimizer)"),
    "llama7b-no-clip": Preset(
        "hf_models", _LLAMA_4K, "README: LLaMA-7B, 4 x 2048 tokens, without clipping"),
    "llama7b-clip-within-norm": Preset(
        "hf_models", _LLAMA_4K + ("--max-norm", "1.0", "--loss-scale", "0.015625"),
        "README: the same, clipping at 1.0 with the norm within it (the loss scaled by 1/64; BENCHMARKS.md, "
        "'Clipping without the wait')"),
    "llama7b-clip-every-step": Preset(
        "hf_models", _LLAMA_4K + ("--max-norm", "1.0"), "README: the same where every step clips"),
    "llama7b-fsdp2-clip": Preset(
        "hf_models", ("--models", "llama-7b", "--budgets", "40GiB,24GiB", "--max-norm", "1.0", "--steps", "7",
                      "--systems", "fsdp2-offload", "--timeout", "300"),
        "README: FSDP2 + CPU offload with clip_grad_norm_ at 1.0, 4 x 2048 tokens, 40 and 24 GiB"),
    "llama7b-deepspeed-24g-clip": Preset(
        "hf_models", ("--models", "llama-7b", "--budgets", "24GiB", "--max-norm", "1.0", "--steps", "7",
                      "--systems", "deepspeed-offload-optim", "--timeout", "420"),
        "README: DeepSpeed ZeRO-3 with its CPU Adam (optimizer offloaded) and clipping at 1.0, 24 GiB "
        "(MEASUREMENTS.md says how to install it)"),
    "llama7b-map-16x2048": Preset(
        "hf_map", _MAP + ("--shapes", "16x2048", "--budgets", "40GiB,24GiB,whole", "--timeout", "160"),
        "README and BENCHMARKS.md, 'The map': 16 x 2048 tokens with activations planned, the GPU alone and the "
        "estimate per row"),
    "llama7b-map-32x2048": Preset(
        "hf_map", _MAP + ("--shapes", "32x2048", "--budgets", "40GiB,24GiB,whole", "--timeout", "200"),
        "README and BENCHMARKS.md, 'The map': 32 x 2048 tokens"),
    "llama7b-map-65536": Preset(
        "hf_map", _MAP + ("--shapes", "1x65536", "--budgets", "24GiB,whole", "--timeout", "220"),
        "README and BENCHMARKS.md, 'The map': one 65,536-token sequence at 24 GiB and on the whole device"),
    "gpt1.3b-24g-peers": Preset(
        "offload", ("--preset", "1.3b", "--budget", "24GiB", "--steps", "6", "--timeout", "200", "--only",
                    "plain,fsdp2-offload,gemini-static,gemini-auto,deepspeed-offload,deepspeed-offload-optim,"
                    "colossalai-static,colossalai-auto"),
        "README: the 1.34B GPT at 24 GiB against FSDP2, DeepSpeed and ColossalAI (BENCHMARKS.md, 'Offloaded "
        "training side by side'; ColossalAI needs --peer-stubs, MEASUREMENTS.md)"),
    "trainer-7b-workers": Preset(
        "trainer_workers", ("--preset", "7b", "--budget", "40GiB", "--workers", "2", "--steps", "8"),
        "BENCHMARKS.md, 'DataLoader workers beside a 7B model'"),
    "llama7b-rl-phases-40g": Preset(
        "rl_phases", ("--model", "llama-7b", "--budget", "40GiB", "--iterations", "2"),
        "BENCHMARKS.md, 'Reinforcement learning's phases': generate 8 x 256 tokens, train 8 x 1024, the weight "
        "stream, offload and reload at 40 GiB"),
    "llama7b-rl-phases-40g-8byte": Preset(
        "rl_phases", ("--model", "llama-7b", "--budget", "40GiB", "--iterations", "2", "--state", "8-byte"),
        "BENCHMARKS.md, 'Reinforcement learning's phases': the same with the 8-byte state, whose every state "
        "the host can hold"),
    "llama7b-trl-grpo-40g": Preset(
        "trl_grpo", ("--model", "llama-7b", "--budget", "40GiB", "--steps", "4"),
        "BENCHMARKS.md, 'TRL's GRPO at 7B': generation, scoring and the step per iteration, 2 prompts x 4 "
        "completions of 256 tokens, beside the same loop alone and under DeepSpeed ZeRO-3 offload"),
    "cpu-adam": Preset("cpu_adam", ("--params-m", "200", "--repeats", "4"),
                       "BENCHMARKS.md, the CPU Adam kernel against the host's memory bandwidth", needs_gpu=False),
    "smoke": Preset("hf_map", ("--smoke", "--state", "8-byte"),
                    "a tiny Llama on sim with the 8-byte state: the map's rows and their record anywhere (tests)",
                    needs_gpu=False),
}


def peak_tflops(preset: Preset) -> float | None:
    """The peak its MFU is against: the preset's --peak-tflops, else the runners' default (none on sim)."""
    if not preset.needs_gpu:
        return None
    args = list(preset.args)
    return float(args[args.index("--peak-tflops") + 1]) if "--peak-tflops" in args else PEAK_TFLOPS
