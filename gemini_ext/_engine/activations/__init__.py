"""The activations package (manager.py's ActivationManager, the one part the engine holds):

- blocks.py: the model's repeated blocks and how each block's call runs (kept, recomputed, offloaded).
- calls.py: the checkpoint calls the model makes for its layers; the check that this torch saves
  a checkpoint's inputs where the offload sees them.
- offload.py, host_buffers.py: checkpointed blocks' inputs to host memory and back.
- probe.py, planner.py: the first forward measured; the per-block plan within the room the chunks leave.
- budget.py: the arithmetic of that room and of the first iteration's warm-up, which gx.estimate
  calls too.
"""

from .blocks import find_blocks, require_blocks
from .manager import ActivationManager

__all__ = ["ActivationManager", "find_blocks", "require_blocks"]
