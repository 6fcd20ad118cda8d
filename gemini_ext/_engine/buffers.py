"""Buffers inside the block: placed on the compute device, given back at close losing nothing.

[Note: buffers lose nothing]
A buffer goes to the compute device (rank 0's value when sharded) keeping its dtype, as under
autocast; cast_buffers=True casts floating ones to the compute dtype. At close, a buffer the
model did not change (the same tensor, still equal to the cast of the original: kernels such as
batch_norm update buffers in place without bumping their version counter) gets back the tensor
it held before, bit for bit; one the model changed or replaced (BatchNorm statistics) goes back
to its original dtype and device holding what the model left.
"""

from __future__ import annotations

import warnings

import torch


class BufferPlacement:
    def __init__(self, model: torch.nn.Module, device: torch.device, compute_dtype: torch.dtype, cast: bool,
                 from_rank0):
        self._entries = []  # (module, key, the tensor before enable, the tensor installed)
        with torch.no_grad():
            for module in model.modules():
                for key, buf in module._buffers.items():
                    if buf is None:
                        continue
                    dtype = compute_dtype if (cast and buf.is_floating_point()) else buf.dtype
                    base = from_rank0(buf)
                    if base is not buf:
                        base = base.to(buf.device)
                    installed = base
                    if installed.device != device or installed.dtype != dtype:
                        installed = installed.to(device, dtype)
                    module._buffers[key] = installed
                    self._entries.append((module, key, base, installed))
        if not cast and compute_dtype != torch.float32:
            norms = [type(m).__name__ for m in model.modules()
                     if isinstance(m, torch.nn.modules.batchnorm._NormBase) and m.affine and m.track_running_stats]
            if norms:
                warnings.warn(f"gemini_ext: the model has {len(norms)} {norms[0]} layer(s), whose running statistics "
                              f"stay float32 (cast_buffers=False) while their weights compute in {compute_dtype}; "
                              "torch's batch_norm needs both in one dtype. Pass cast_buffers=True (the statistics "
                              f"then run in {compute_dtype}; close() gives them back as float32).", stacklevel=5)

    def restore(self) -> None:
        # see [Note: buffers lose nothing]
        """Every buffer back to its original dtype and device (see the note above)."""
        with torch.no_grad():
            for module, key, base, installed in self._entries:
                buf = module._buffers.get(key)
                if buf is installed and (buf is base or torch.equal(buf, base.to(device=buf.device, dtype=buf.dtype))):
                    module._buffers[key] = base
                elif buf is not None:
                    module._buffers[key] = buf.to(device=base.device, dtype=base.dtype)
        self._entries = []
