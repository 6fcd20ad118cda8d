"""gx.estimate: the plan, the memory and a predicted step time of training a model under the
engine, before any device memory is touched (the model may be built on meta).

The plan is the engine's own: engine_plan.py runs the layout, the placement policy, the
activations' budget and the core's activation plan in the engine's order, fed predicted figures
(shape.py) where the engine measures them. Only the target machine's rates are models (target.py,
each constant cited to the docs/BENCHMARKS.md row it was fitted on), and the step time adds them
up (step_time.py, see [Note: the step-time model]).
"""

from .api import estimate
from .shape import LOGIT_BYTES_PER_VOCAB, Shape, logits_bytes, model_shape
from .target import HOST_DISPATCH_S_PER_TENSOR_PASS

__all__ = ["HOST_DISPATCH_S_PER_TENSOR_PASS", "LOGIT_BYTES_PER_VOCAB", "Shape", "estimate",
           "logits_bytes", "model_shape"]
