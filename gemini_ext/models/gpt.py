"""A plain GPT (pre-LayerNorm decoder, tied embedding) with the presets of MEASUREMENTS.md."""

from __future__ import annotations

import dataclasses
import functools
import math

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 32000
    max_seq_len: int = 1024
    d_model: int = 2048
    n_layers: int = 24
    n_heads: int = 16
    mlp_ratio: int = 4
    dropout: float = 0.0
    tie_embeddings: bool = True  # the output head shares the token embedding's weight
    # The key part of the qkv bias has an exactly zero gradient (softmax ignores a constant added
    # to every score), so Adam turns its rounding noise into full-size updates; parity tests that
    # compare two implementations element by element turn it off.
    qkv_bias: bool = True
    # The loss over this many tokens at a time, each piece under activation checkpointing: its
    # logits (with their fp32 copy and gradients, about 12.6 bytes per vocabulary entry and token)
    # live for one piece only, recomputed in backward. 0: over the whole batch at once.
    loss_chunk_tokens: int = 0

    def num_parameters(self) -> int:
        d, f = self.d_model, self.d_model * self.mlp_ratio
        per_layer = 4 * d + (3 * d * d + (3 * d if self.qkv_bias else 0)) + (d * d + d) + (d * f + f) + (f * d + d)
        head = 0 if self.tie_embeddings else self.vocab_size * d
        return self.vocab_size * d + self.max_seq_len * d + self.n_layers * per_layer + 2 * d + head


GPT_PRESETS = {
    "tiny": GPTConfig(vocab_size=256, max_seq_len=64, d_model=64, n_layers=2, n_heads=4),
    "small": GPTConfig(vocab_size=8192, max_seq_len=256, d_model=256, n_layers=4, n_heads=8),
    "125m": GPTConfig(vocab_size=32000, max_seq_len=1024, d_model=768, n_layers=12, n_heads=12),
    "350m": GPTConfig(vocab_size=32000, max_seq_len=1024, d_model=1024, n_layers=24, n_heads=16),
    # The sizes of MEASUREMENTS.md (1.34B, 6.7B) have an untied output head.
    "1.3b": GPTConfig(vocab_size=32000, max_seq_len=1024, d_model=2048, n_layers=24, n_heads=16, tie_embeddings=False),
    "6.7b": GPTConfig(vocab_size=32000, max_seq_len=1024, d_model=4096, n_layers=32, n_heads=32, tie_embeddings=False),
    "13b": GPTConfig(vocab_size=32000, max_seq_len=1024, d_model=5120, n_layers=40, n_heads=40, tie_embeddings=False),
    "15b": GPTConfig(vocab_size=32000, max_seq_len=1024, d_model=5120, n_layers=48, n_heads=40, tie_embeddings=False),
    # Beyond one GPU (bench/capacity.py --gpus N): 20.3B, 30.1B, 40.8B and 81.0B parameters; the
    # two largest are built on the meta device (no GPU holds them whole in fp32). 25.8B: one GPU
    # with the 8-byte state (GeminiConfig.master_weights=False).
    "20b": GPTConfig(vocab_size=32000, max_seq_len=1024, d_model=6144, n_layers=44, n_heads=48, tie_embeddings=False),
    "25b": GPTConfig(vocab_size=32000, max_seq_len=1024, d_model=6144, n_layers=56, n_heads=48, tie_embeddings=False),
    "30b": GPTConfig(vocab_size=32000, max_seq_len=1024, d_model=7168, n_layers=48, n_heads=56, tie_embeddings=False),
    "40b": GPTConfig(vocab_size=32000, max_seq_len=1024, d_model=8192, n_layers=50, n_heads=64, tie_embeddings=False),
    "80b": GPTConfig(vocab_size=32000, max_seq_len=1024, d_model=8192, n_layers=100, n_heads=64, tie_embeddings=False),
}


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=cfg.qkv_bias)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.fc1 = nn.Linear(cfg.d_model, cfg.mlp_ratio * cfg.d_model)
        self.fc2 = nn.Linear(cfg.mlp_ratio * cfg.d_model, cfg.d_model)
        self.proj.residual_projection = self.fc2.residual_projection = True  # scaled at init (GPT-2)
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.n_heads, d // self.n_heads).unbind(2)
        attn = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                                              dropout_p=self.dropout if self.training else 0.0)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        if not isinstance(cfg.loss_chunk_tokens, int) or cfg.loss_chunk_tokens < 0:
            raise ValueError(f"GPTConfig.loss_chunk_tokens must be an int >= 0 (0: the loss over the whole batch at "
                             f"once), got {cfg.loss_chunk_tokens!r}.")
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.max_seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.head.weight = self.tok_emb.weight
        self.apply(self.init_weights)

    def init_weights(self, module: nn.Module, generator: torch.Generator | None = None) -> None:
        """GPT-2's initialisation of one module's own tensors, in place: N(0, 0.02) weights
        (0.02 / sqrt(2 n_layers) for the projections into the residual stream), zero biases,
        LayerNorm at identity. The constructor applies it to every module; a model built on the
        meta device passes it to gx.enable(..., param_init_fn=model.init_weights), which calls it
        module by module in the order of `model.apply`: from the same random state, the values
        equal `model.apply(model.init_weights)` on a model built on that device. `generator`
        draws from a stream of its own instead of torch's default one."""
        if module is self.head and self.cfg.tie_embeddings:
            return  # its weight is the token embedding's, initialised there
        if isinstance(module, (nn.Linear, nn.Embedding)):
            scaled = getattr(module, "residual_projection", False)
            nn.init.normal_(module.weight, std=0.02 / math.sqrt(2 * self.cfg.n_layers) if scaled else 0.02,
                            generator=generator)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)
        if isinstance(module, nn.LayerNorm):
            module.reset_parameters()

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        t = idx.shape[1]
        if t > self.cfg.max_seq_len:
            raise ValueError(f"GPT: sequence length {t} exceeds max_seq_len {self.cfg.max_seq_len}.")
        pos = torch.arange(t, device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(pos)
        for block in self.blocks:
            x = block(x)
        x = self.ln_f(x)
        if targets is None:
            return self.head(x)
        hidden, targets = x.reshape(-1, x.shape[-1]), targets.reshape(-1)
        chunk = self.cfg.loss_chunk_tokens
        if chunk <= 0 or hidden.shape[0] <= chunk:
            return F.cross_entropy(self.head(hidden).float(), targets)
        # the mean over the targets F.cross_entropy counts (ignore_index -100 left out)
        total = sum(torch.utils.checkpoint.checkpoint(self._loss_sum, hidden[i:i + chunk], targets[i:i + chunk],
                                                      use_reentrant=False)
                    for i in range(0, hidden.shape[0], chunk))
        return total / (targets != -100).sum()

    def _loss_sum(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.head(hidden).float(), targets, reduction="sum")


class Checkpointed(nn.Module):
    """Runs a block under non-reentrant activation checkpointing (what gemini_ext's hooks support),
    through a checkpoint function it carries as transformers' layers do (`gradient_checkpointing`,
    `_gradient_checkpointing_func`), so that an engine can take part in the call."""

    gradient_checkpointing = True

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block
        self._gradient_checkpointing_func = functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._gradient_checkpointing_func(self.block, x)


def checkpoint_blocks(model: GPT) -> None:
    """Wraps every block of `model` in Checkpointed (the examples' and benches' --checkpoint)."""
    for i, block in enumerate(model.blocks):
        model.blocks[i] = Checkpointed(block)


def synthetic_batch(cfg: GPTConfig, batch: int, seq_len: int, step: int, device, seed: int = 0,
                    active_vocab: int = 512):
    """A learnable synthetic task: each sequence counts up by a per-sequence stride, modulo the
    first `active_vocab` tokens, so that the loss falls visibly within a few dozen steps."""
    vocab = min(active_vocab, cfg.vocab_size)
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    start = torch.randint(0, vocab, (batch, 1), generator=g)
    stride = torch.randint(1, 4, (batch, 1), generator=g)
    seq = (start + stride * torch.arange(seq_len + 1)) % vocab
    return seq[:, :-1].to(device), seq[:, 1:].to(device)
