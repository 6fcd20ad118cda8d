"""The placement policies: pure functions of measurements that return a placement (base.py says
what they share). One file per policy family: `static` and `const` (static.py), `auto` (auto.py).
A new policy is a new file here, registered with `@register` and imported below.
"""

from .base import (HOST_RESERVE_BYTES, NON_MODEL_HEADROOM, NON_MODEL_HEADROOM_MIN, POLICY_CLASSES, HostPlan,
                   Measurements, Placement, PlacementPolicy, SetPlacement, budget_decision,
                   host_reserve_bytes, make_policy, measured_chunk_budget, register,
                   warm_up_chunk_budget)
from .auto import AutoPolicy
from .static import ConstPolicy, StaticPolicy

__all__ = ["HOST_RESERVE_BYTES", "NON_MODEL_HEADROOM", "NON_MODEL_HEADROOM_MIN", "POLICY_CLASSES", "AutoPolicy",
           "ConstPolicy", "HostPlan", "Measurements", "Placement", "PlacementPolicy", "SetPlacement", "StaticPolicy",
           "budget_decision", "host_reserve_bytes", "make_policy",
           "measured_chunk_budget", "register", "warm_up_chunk_budget"]
