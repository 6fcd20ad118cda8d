"""The engine's parts; gemini_ext/engine.py is the facade that assembles them.

- contract.py: EngineInternals, what optim, checkpoint and clipping use of an engine.
- layout.py: chunk groups and each parameter's chunk and slot.
- fill.py, materialize.py: the parameters' values into chunks (meta-built models materialised).
- hooks.py: module hooks whose bodies are the C++ manager's.
- loss_scale_boundary.py: where the fp16 loss scale enters and leaves a backward pass.
- param_access.py: parameters touched outside the hooks; gathered(); full state dicts.
- guards.py: foreign optimizers and torch's clipping on managed parameters.
- clipping.py: engine.clip_grad_norm_, folded into the next step.
- buffers.py, restore.py: buffers on the compute device; ordinary parameters back at close.
- registry.py: which engine manages which model.
- device.py, process_groups.py: the compute device and the data-parallel groups.
"""
