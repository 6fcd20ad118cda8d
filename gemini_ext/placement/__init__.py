"""Where each chunk set lives: decided by a policy, applied by the placer, from measurements.

- policies/: the placement policies (base.py; static.py: static, const; auto.py): decide from
  Measurements, move nothing.
- placer.py: gathers the measurements, asks the policy and has the manager carry the decision out.
- optimizer_split.py: how much optimizer state the device should step, from measured rates.
- rates.py: the machine's measured rates (CPU optimizer, host-to-device copies).
- tracer.py: per-iteration memory and traffic figures (MemoryTracer) and set-up phases.
- host_memory.py: what the host has (MemAvailable, the process's RSS).
- costs.py: the tiers and the bytes per element that every plan uses.
Nothing here imports the engine or its parts (test_architecture.py).
"""
