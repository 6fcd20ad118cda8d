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
    "cpu_adam": ("cpu_adam.py", "the CPU Adam kernel against torch and the host's memory bandwidth"),
}


@dataclasses.dataclass(frozen=True)
class Preset:
    runner: str
    args: tuple
    reproduces: str  # the figure, and where it is reported
    needs_gpu: bool = True  # its figures are a GPU's: refused where torch sees none

    def command(self) -> list[str]:
        return [f"bench/{RUNNERS[self.runner][0]}", *self.args]


_LLAMA_40 = ("--models", "llama-7b", "--budgets", "40GiB", "--steps", "7", "--timeout", "95")
_ACT = ("--models", "llama-7b", "--max-norm", "1.0", "--loss-chunk-tokens", "8192", "--steps", "4")
PRESETS = {
    "llama7b-40g-clip-within-norm": Preset(
        "hf_models", _LLAMA_40 + ("--max-norm", "1.0", "--loss-scale", "0.015625", "--systems", "gemini"),
        "README: LLaMA-7B, 4 x 2048 tokens, 40 GiB, clipping at 1.0 with the norm within it (BENCHMARKS.md, "
        "'Clipping without the wait')"),
    "llama7b-40g-clip-every-step": Preset(
        "hf_models", _LLAMA_40 + ("--max-norm", "1.0", "--systems", "gemini"),
        "README: the same where every step clips"),
    "llama7b-40g-no-clip": Preset(
        "hf_models", _LLAMA_40 + ("--systems", "gemini"), "README: the same without clipping"),
    "llama7b-40g-no-clip-peers": Preset(
        "hf_models", ("--models", "llama-7b", "--budgets", "40GiB", "--systems", "gemini,fsdp2-offload,"
                      "deepspeed-offload-optim", "--timeout", "220"),
        "README: FSDP2 + CPU offload and DeepSpeed ZeRO-3 (optimizer offloaded) without clipping at 40 GiB "
        "(BENCHMARKS.md, 'transformers' LLaMA-7B, Mistral-7B and a Mixtral-style MoE side by side')"),
    "llama7b-24g-clip-peers": Preset(
        "hf_models", ("--models", "llama-7b", "--budgets", "24GiB", "--max-norm", "1.0", "--systems",
                      "gemini,fsdp2-offload,deepspeed-offload-optim", "--timeout", "170"),
        "README: FSDP2 + CPU offload with clipping at 24 GiB, beside gemini_ext and DeepSpeed"),
    "llama7b-map": Preset(
        "hf_map", ("--models", "llama-7b", "--budgets", "24GiB,40GiB,whole", "--shapes",
                   "4x2048,16x2048,32x2048,1x65536", "--steps", "4", "--timeout", "160"),
        "BENCHMARKS.md, 'The map': every budget and shape, GPU alone and the estimate per row"),
    "llama7b-map-32k": Preset(
        "hf_map", ("--models", "llama-7b", "--budgets", "24GiB,40GiB,whole", "--shapes", "16x2048", "--steps", "4",
                   "--timeout", "130"),
        "README: LLaMA-7B at 16 x 2048 tokens with activations planned, at 40 GiB and on the whole H100"),
    "llama7b-64k-one-sequence": Preset(
        "hf_models", _ACT + ("--budgets", "24GiB", "--batch", "1", "--seq", "65536", "--systems",
                             "gemini-act,gpu-alone", "--timeout", "170"),
        "BENCHMARKS.md, 'Activations planned with the chunks': one 65,536-token sequence at 24 GiB"),
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
    "cpu-adam": Preset("cpu_adam", ("--params-m", "200", "--repeats", "4"),
                       "BENCHMARKS.md, the CPU Adam kernel against the host's memory bandwidth", needs_gpu=False),
    "smoke": Preset("hf_map", ("--smoke",), "a tiny Llama on sim: the map's row format anywhere (tests)",
                    needs_gpu=False),
}
