"""Reference models used by the examples, the parity tests and the benchmarks."""

from .gpt import GPT, GPTConfig, GPT_PRESETS, Checkpointed, checkpoint_blocks, synthetic_batch

__all__ = ["GPT", "GPTConfig", "GPT_PRESETS", "Checkpointed", "checkpoint_blocks", "synthetic_batch"]
