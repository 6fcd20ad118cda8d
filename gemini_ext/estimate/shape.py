"""What gx.estimate reads from a model for its activation and FLOP models, and the activations it
predicts the engine measures: per block what the probe counts (core/activation_plan.h's figures),
and the loss's logits beside them.

[Note: the activation model]
- Per token and block without checkpointing: 34 d bytes for the GPT's block (GELU MLP of 4 d,
  flash attention, no s^2 term); for a gated MLP of inner width i (Llama's SwiGLU) 30 d + 8 i: in
  bf16 the attention's inputs and outputs, q and k before and after the rotary embedding, two
  RMSNorms' fp32 inputs, and the gate, up, activation and product of the MLP. transformers'
  LLaMA-7B on an H100: the engine counted 52.6 d per token, the formula gives 51.5 d.
- A block's input: d bf16 bytes per token.
- The loss's logits: LOGIT_BYTES_PER_VOCAB x V per token (bf16 logits, their fp32 copy, its fp32
  and bf16 gradients; measured 897 and 665 kB per token at 15.4B and 6.7B on the H200, the formula
  gives 895 and 665), for one piece of tokens where the loss is computed in checkpointed pieces.
  They live after the blocks' forward, beside a recomputed block's activations in its backward; the
  larger of the two is what counts beside the blocks' inputs.
"""

from __future__ import annotations

import dataclasses

import torch

from .._engine.activations.probe import BACKWARD_PER_FORWARD  # a block's backward over its forward, as measured

BLOCK_BYTES_PER_WIDTH = 34  # a block's saved tensors per token and unit of width (GPT: GELU MLP of 4 d)
GATED_BLOCK_BYTES_PER_WIDTH = 30  # a gated-MLP block's (Llama): attention, two RMSNorms kept in fp32, rotary
GATED_BYTES_PER_MLP_WIDTH = 8  # ... and per unit of the MLP's inner width: gate, up, their activation, product
INPUT_BYTES_PER_WIDTH = 2  # a block's input per token and unit of width (bf16)
LOGIT_BYTES_PER_VOCAB = 12.6  # per token: bf16 logits, fp32 copy, fp32 and bf16 gradients (H200, 6.7B and 15.4B)


@dataclasses.dataclass(frozen=True)
class Shape:
    """Layers, width, vocabulary, and the width of a gated MLP's inner projections (0: not gated)."""
    layers: int
    width: int
    vocab: int
    gated_mlp_width: int = 0

    def block_activation_bytes_per_token(self) -> int:
        """A block's saved tensors per token without checkpointing (see [Note: the activation model])."""
        if self.gated_mlp_width:
            return GATED_BLOCK_BYTES_PER_WIDTH * self.width + GATED_BYTES_PER_MLP_WIDTH * self.gated_mlp_width
        return BLOCK_BYTES_PER_WIDTH * self.width

    def input_bytes_per_token(self) -> int:
        return INPUT_BYTES_PER_WIDTH * self.width


def model_shape(model: torch.nn.Module) -> Shape | None:
    """Layers (the longest ModuleList), width and vocabulary (the largest embedding), or None; the
    MLP is gated where two Linear layers of the first block share the widest output, wider than the
    width (gate and up projections)."""
    embeddings = [m for m in model.modules() if isinstance(m, torch.nn.Embedding)]
    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList)]
    if not embeddings or not lists:
        return None
    vocab = max(embeddings, key=lambda e: e.num_embeddings)
    blocks = max(lists, key=len)
    outs = [m.out_features for m in blocks[0].modules() if isinstance(m, torch.nn.Linear)] if len(blocks) else []
    inner = max(outs, default=0)  # an MLP wider than the model; two of that width: gated
    gated = inner if inner > vocab.embedding_dim and outs.count(inner) >= 2 else 0
    return Shape(len(blocks), vocab.embedding_dim, vocab.num_embeddings, gated)


def loss_chunk_tokens_of(model: torch.nn.Module, given: int | None) -> int:
    """`given`; else the pieces a model's config names (`model.cfg.loss_chunk_tokens`, as gemini_ext's
    GPT has it); else 0, the loss over the whole batch at once."""
    if given is None:
        return int(getattr(getattr(model, "cfg", None), "loss_chunk_tokens", 0) or 0)
    if not isinstance(given, int) or given < 0:
        raise ValueError(f"gx.estimate: loss_chunk_tokens must be an int >= 0 (0: the loss over the whole batch "
                         f"at once), got {given!r}.")
    return given


def logits_bytes(shape: Shape, tokens: int, loss_chunk_tokens: int = 0) -> float:
    """The loss's logits and their gradients: its piece of `loss_chunk_tokens` tokens, or every token."""
    logit_tokens = min(tokens, loss_chunk_tokens) if loss_chunk_tokens > 0 else tokens
    return logit_tokens * shape.vocab * LOGIT_BYTES_PER_VOCAB


def probed_blocks(shape: Shape, tokens: int, forward_seconds: float) -> list[tuple]:
    """What the engine's probe would measure per block: (activation bytes, input bytes, forward s,
    backward s), the blocks alike, the forward's time in equal parts."""
    forward_block = forward_seconds / shape.layers
    block = (tokens * shape.block_activation_bytes_per_token(), tokens * shape.input_bytes_per_token(),
             forward_block, BACKWARD_PER_FORWARD * forward_block)
    return [block] * shape.layers


def outside_blocks_bytes(shape: Shape, tokens: int, loss_chunk_tokens: int) -> int:
    """The loss's logits beyond a recomputed block's activations (see [Note: the activation model])."""
    logits = int(logits_bytes(shape, tokens, loss_chunk_tokens))
    return max(0, logits - tokens * shape.block_activation_bytes_per_token())
