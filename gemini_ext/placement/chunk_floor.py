"""The fewest device bytes the chunks can train or generate in: the chunk sets a forward holds at
once (one computing, one fetched ahead, one whose gradients are being reduced), the largest ones.
The placement's budgets, the activations' warm-up, generation and the estimate all hold a budget
to this one floor."""

from __future__ import annotations

CHUNK_SETS_AT_ONCE = 3


def chunk_floor_bytes(set_shard_bytes) -> int:
    """The bytes of the largest CHUNK_SETS_AT_ONCE chunk sets (their shards on this rank; 0 for none)."""
    return sum(sorted(set_shard_bytes)[-CHUNK_SETS_AT_ONCE:])
