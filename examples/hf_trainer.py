"""A HuggingFace Llama trained with transformers' Trainer under gemini_ext, saved, and reloaded
with plain transformers.

    python examples/hf_trainer.py                       # a small Llama, 300 steps, on the GPU if there is one
    python examples/hf_trainer.py --steps 20 --out /tmp/llama

The model comes from a config (no weights are downloaded); the data is synthetic token sequences
with a learnable pattern, so the loss goes down. `GeminiTrainer` is `transformers.Trainer` with a
`gemini_config`: the optimizer is the engine's AdamW, the scheduler, clipping, accumulation,
logging and checkpoints are the Trainer's. Several processes: `torchrun --nproc-per-node N
examples/hf_trainer.py`.
"""

from __future__ import annotations

import argparse
import os

import torch
import transformers

import gemini_ext as gx
from gemini_ext.integrations.transformers import GeminiTrainer


class PatternTokens(torch.utils.data.Dataset):
    """Sequences that follow `i * stride mod vocab` with a little noise."""

    def __init__(self, n: int, seq: int, vocab: int, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.items = []
        for _ in range(n):
            start, stride = torch.randint(0, vocab, (1,), generator=g).item(), torch.randint(1, 8, (1,),
                                                                                             generator=g).item()
            ids = (start + torch.arange(seq) * stride) % vocab
            noise = torch.rand(seq, generator=g) < 0.05
            ids[noise] = torch.randint(0, vocab, (int(noise.sum()),), generator=g)
            self.items.append(ids)

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return {"input_ids": self.items[i], "labels": self.items[i]}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--out", default="hf_trainer_output")
    p.add_argument("--device", default="auto", choices=["auto", "cuda", "sim"])
    p.add_argument("--precision", default=None, choices=["bf16", "fp32"], help="default: bf16 on cuda, fp32 on sim")
    args = p.parse_args(argv)
    vocab = 1024
    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                                      num_hidden_layers=args.layers, num_attention_heads=max(1, args.hidden // 64),
                                      max_position_embeddings=args.seq)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    device = gx.resolve_device(gx.GeminiConfig(device=args.device))
    cuda = device == "cuda"
    bf16 = (args.precision or ("bf16" if cuda else "fp32")) == "bf16"
    training = transformers.TrainingArguments(
        output_dir=args.out, per_device_train_batch_size=args.batch, gradient_accumulation_steps=2,
        max_steps=args.steps, learning_rate=1e-3, weight_decay=0.1, lr_scheduler_type="cosine",
        warmup_steps=args.steps // 10, max_grad_norm=1.0, logging_steps=max(1, args.steps // 10), save_strategy="no",
        report_to=[], bf16=bf16, use_cpu=not cuda, disable_tqdm=True, seed=0)
    gemini = gx.GeminiConfig(device=device, precision="bf16" if bf16 else "fp32", placement_policy="auto")
    trainer = GeminiTrainer(model=model, args=training, gemini_config=gemini,
                            train_dataset=PatternTokens(args.steps * args.batch * 2, args.seq, vocab))
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    trainer.save_model(args.out)
    trainer.close()
    if training.process_index == 0:
        reloaded = transformers.LlamaForCausalLM.from_pretrained(args.out)  # plain transformers from here on
        same = all(torch.equal(a, b.detach().cpu()) for a, b in zip(reloaded.parameters(), model.parameters()))
        print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f} over {args.steps} steps; saved to {args.out}, "
              f"reloaded with from_pretrained: {'identical' if same else 'DIFFERENT'} parameters")
        return {"losses": losses, "reloaded_identical": same, "out": os.path.abspath(args.out)}
    return {"losses": losses}


if __name__ == "__main__":
    main()
