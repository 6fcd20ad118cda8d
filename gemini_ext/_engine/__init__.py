"""The engine's parts; gemini_ext/engine.py is the facade that assembles them.

- build.py: what enable() builds, in order, as an EngineParts (parts.py, which also holds the
  iteration's end).
- contract.py: EngineInternals, what optim, checkpoint and clipping use of an engine.
- layout.py: chunk groups and each parameter's chunk and slot.
- fill.py, materialize.py: the parameters' values into chunks (meta-built models materialised).
- hooks.py: module hooks whose bodies are the C++ manager's; input_hints.py: what a failed forward
  whose inputs differ in dtype or device from the parameters is told.
- loss_scale_boundary.py: where the fp16 loss scale enters and leaves a backward pass.
- param_access.py: parameters touched outside the hooks; gathered(); full state dicts.
- sharded_state.py: the engine's state as each rank's share, for torch.distributed.checkpoint.
- guards.py: foreign optimizers and torch's clipping on managed parameters.
- clipping.py: engine.clip_grad_norm_, folded into the next step.
- throughput.py: tokens per second and MFU.
- buffers.py, restore.py: buffers on the compute device; ordinary parameters back at close.
- registry.py: which engine manages which model.
- device.py, process_groups.py: the compute device and the data-parallel groups.
- activations/: the activations package (checkpointing, offload, the plan; its own __init__ lists it).
"""
