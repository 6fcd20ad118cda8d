"""search_chunk_configuration: the chunk size that wastes the fewest bytes, without building.

The search itself runs in C++ (csrc/core/chunk_search.*); this module lists the parameters in
placement order and converts units. Parameters are placed in execution order when one is given
(the scheduler's recorded trace), in definition order otherwise; tied parameters count once.
"""

from __future__ import annotations

import time
from typing import Iterable

import torch

from ._native import _C

_ELEMENTS_PER_M = 2**20  # search_range_m and min_chunk_size_m count 2**20 elements
_MAX_SEARCH_INTERVAL_NUMEL = 32 * 1024
_PRECISION_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
ALIGNMENT_NUMEL = 32  # the engine aligns every slot to 32 elements: 64 bytes of 16-bit, 128 of fp32


def unique_parameters(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """(name, parameter) pairs in definition order, each shared parameter once (first name)."""
    return list(model.named_parameters(remove_duplicate=True))


def default_search_interval(search_range_numel: int) -> int:
    """About 1024 candidates over the range, at most 32 Ki elements apart."""
    return max(1, min(_MAX_SEARCH_INTERVAL_NUMEL, search_range_numel // 1024))


def search_chunk_configuration(model: torch.nn.Module, search_range_m: float = 128, min_chunk_size_m: float = 32,
                               *, search_interval: int | None = None,
                               execution_order: Iterable[torch.nn.Parameter] | None = None,
                               precision: str | None = None, world_size: int = 1, alignment_bytes: int | None = None,
                               filter_exlarge_params: bool = True) -> dict:
    """Returns {'chunk_size' (elements), 'wasted_bytes', 'wasted_frac', 'num_chunks', 'search_ms',
    'order' ('execution' or 'definition'), 'candidates'} for `model`'s parameters.

    `precision` ('bf16', 'fp16', 'fp32') sets the element size of the chunks; None takes each
    parameter's own dtype size (the largest if they differ). `alignment_bytes` None aligns slots
    to ALIGNMENT_NUMEL elements, as the engine does.
    """
    if search_range_m < 0 or min_chunk_size_m < 0:
        raise ValueError(f"search_range_m / min_chunk_size_m: expected >= 0, got {search_range_m} / "
                         f"{min_chunk_size_m}.")
    named = unique_parameters(model)
    if not named:
        raise ValueError(f"search_chunk_configuration: {type(model).__name__} has no parameters to place.")
    params = [p for _, p in named]
    order = "definition"
    if execution_order is not None:
        by_id = {id(p): p for p in params}
        seen, ordered = set(), []
        for p in execution_order:
            if id(p) not in by_id:
                raise ValueError("execution_order: contains a tensor that is not a parameter of the model.")
            if id(p) not in seen:
                seen.add(id(p))
                ordered.append(p)
        ordered += [p for p in params if id(p) not in seen]  # never used in the trace: at the end
        params, order = ordered, "execution"
    if precision is None:
        element_bytes = max(p.element_size() for p in params)
    elif precision in _PRECISION_BYTES:
        element_bytes = _PRECISION_BYTES[precision]
    else:
        raise ValueError(f"precision: expected one of {tuple(_PRECISION_BYTES)} or None, got {precision!r}.")
    search_range_numel = int(search_range_m * _ELEMENTS_PER_M)
    interval = search_interval if search_interval is not None else default_search_interval(search_range_numel)
    start = time.perf_counter()
    result = _C.search_chunk_size([p.numel() for p in params], search_range_numel,
                                  int(min_chunk_size_m * _ELEMENTS_PER_M), interval,
                                  (ALIGNMENT_NUMEL if alignment_bytes is None
                                   else max(1, alignment_bytes // element_bytes)),
                                  world_size, filter_exlarge_params)
    elapsed_ms = (time.perf_counter() - start) * 1e3
    payload_bytes = result["total_numel"] * element_bytes
    wasted_bytes = result["wasted_numel"] * element_bytes
    return {
        "chunk_size": result["chunk_size_numel"],
        "wasted_bytes": wasted_bytes,
        "wasted_frac": wasted_bytes / (payload_bytes + wasted_bytes),
        "num_chunks": result["num_chunks"],
        "candidates": result["candidates"],
        "search_ms": elapsed_ms,
        "order": order,
    }


WASTE_HINT_FRAC = 0.05  # a search that wastes more than this looks further before enable() warns


def wider_search(model: torch.nn.Module, found: dict, search_range_m: float, min_chunk_size_m: float,
                 precision: str | None = None) -> tuple[float, dict] | None:
    """When `found` (a search over `search_range_m`) wastes more than WASTE_HINT_FRAC of its
    chunks: the first of twice and four times the range whose chunk size wastes at most half as
    much, with its result, so that enable() can name the range to pass. None otherwise. (Large
    matrices a little under the range's end waste most: a 30B GPT's 205M-element MLP weights
    fill a 229M-element chunk each, 10% wasted, where chunks of two of them waste 1%.)"""
    if found["wasted_frac"] <= WASTE_HINT_FRAC:
        return None
    for factor in (2, 4):
        wider = search_chunk_configuration(model, search_range_m * factor, min_chunk_size_m, precision=precision)
        if wider["wasted_frac"] <= found["wasted_frac"] / 2:
            return search_range_m * factor, wider
    return None
