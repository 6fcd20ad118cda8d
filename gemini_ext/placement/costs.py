"""What a chunk costs and where it can be: the tiers a chunk's copies live on and the bytes per
element of a trainable chunk set's optimizer side. Placement plans with these figures; the
layout and the tracer name tiers with them."""

from __future__ import annotations

import torch

STATE_DTYPE = torch.float32  # masters and optimizer state
HOST_TIERS = ("pinned_host", "pageable_host")
TIERS = ("device", *HOST_TIERS)  # where a chunk's copies may be


def set_bytes_per_element(compute_dtype: torch.dtype, num_state_kinds: int,
                          state_dtype: torch.dtype = STATE_DTYPE, has_master: bool | None = None) -> int:
    """Bytes per element of a trainable chunk set's optimizer side, wherever it lives: its
    gradient (compute dtype), the fp32 master (16-bit precisions with master_weights only) and each optimizer state
    kind (fp32, or bf16 under optimizer_state_dtype="bf16"). The parameter chunk itself is not
    counted. Every plan that sizes optimizer state (host room, device room, moves) uses this one
    figure. has_master: None for 16-bit precisions' default (an fp32 master); False without one
    (master_weights=False: the 16-bit parameter is stepped in place)."""
    if has_master is None:
        has_master = compute_dtype != STATE_DTYPE
    master = STATE_DTYPE.itemsize if has_master else 0
    return compute_dtype.itemsize + master + state_dtype.itemsize * num_state_kinds


def layout_figures(layout) -> dict:
    """The placement's measurements a chunk layout fixes (policies.Measurements' fields): the Placer's
    and gx.estimate's one source of them."""
    return dict(set_shard_bytes=tuple(layout.shard_bytes), trainable=tuple(s.trainable for s in layout.sets),
                set_bytes_per_element=set_bytes_per_element(layout.compute_dtype, layout.planned_state_kinds,
                                                            layout.state_dtype, layout.has_master),
                master_itemsize=4 if layout.has_master else 0, compute_itemsize=layout.compute_dtype.itemsize,
                frozen_master_bytes=layout.frozen_master_shard_bytes())
