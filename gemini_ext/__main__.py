"""gemini-ext (or python -m gemini_ext) info | export CKPT OUT [--dtype bf16] [--config config.json] [--max-shard-size 5GB]
| estimate (--preset NAME | --hf-config config.json) --tokens-per-step N [--world-size N] [machine options]"""

import argparse
import dataclasses
import os
import sys


def main(argv=None) -> int:
    prog = "gemini-ext" if os.path.basename(sys.argv[0]) == "gemini-ext" else "python -m gemini_ext"
    parser = argparse.ArgumentParser(prog=prog, description="gemini_ext command line")
    from . import __version__

    parser.add_argument("--version", action="version", version=f"gemini_ext {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="print the build (CPU/CUDA, CUDA version, SIMD ISA), torch, allocator and device")
    exp = sub.add_parser("export", help="write a checkpoint (any format, any world size) as safetensors (sharded with "
                                        "--max-shard-size), "
                                        "streaming tensor by tensor")
    exp.add_argument("checkpoint", help="a directory written by engine.save_checkpoint()")
    exp.add_argument("out", help="the .safetensors file to write, or with --config a directory")
    exp.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="fp32",
                     help="floating tensors in this dtype (default fp32: the masters exactly)")
    exp.add_argument("--config", default=None,
                     help="a HuggingFace config.json: OUT becomes a directory from_pretrained reads")
    exp.add_argument("--max-shard-size", default=None,
                     help="shards of at most this size, e.g. 5GB, with model.safetensors.index.json (OUT is a "
                          "directory, as transformers' save_pretrained writes it)")
    exp.add_argument("--no-progress", action="store_true")
    est = sub.add_parser("estimate", help="the plan, device and host memory and a predicted step time of a model "
                                          "built on meta (gx.estimate), before any memory is touched")
    model = est.add_mutually_exclusive_group(required=True)
    model.add_argument("--preset", help="a GPT preset of gemini_ext.models (e.g. 15b)")
    model.add_argument("--hf-config", help="a HuggingFace config.json (a causal LM built from it on meta)")
    est.add_argument("--tokens-per-step", type=int, required=True, help="tokens per optimizer step, all ranks")
    est.add_argument("--world-size", type=int, default=1)
    est.add_argument("--no-checkpointing", action="store_true", help="activations kept (default: checkpointed per block)")
    est.add_argument("--loss-chunk-tokens", type=int, default=None,
                     help="the loss over this many tokens at a time, checkpointed (default: the preset's, 0)")
    est.add_argument("--policy", default="auto")
    est.add_argument("--max-norm", type=float, default=1.0)
    est.add_argument("--step-in-backward", action="store_true",
                     help="GeminiConfig.optimizer_step_in_backward (needs --max-norm 0)")
    est.add_argument("--precision", choices=["bf16", "fp16", "fp32"], default="bf16")
    est.add_argument("--optimizer-state-dtype", choices=["fp32", "bf16"], default="fp32")
    est.add_argument("--no-master-weights", action="store_true",
                     help="with --optimizer-state-dtype bf16: the 8-byte state (GeminiConfig.master_weights=False)")
    est.add_argument("--device-bytes", default=None, help="another machine's device memory, e.g. 141GB")
    est.add_argument("--host-bytes", default=None, help="another machine's available host memory, e.g. 125GiB")
    est.add_argument("--peak-tflops", type=float, default=None)
    est.add_argument("--device-name", default=None, help="e.g. H200 (its peak from the table)")
    est.add_argument("--cpu-rate", type=float, default=None, help="CPU Adam elements/s there (default: measured here)")
    est.add_argument("--json", action="store_true", help="print the whole estimate as JSON")
    args = parser.parse_args(argv)
    if args.command == "info":
        from .info import print_info

        print_info()
    elif args.command == "export":
        from .export import export

        summary = export(args.checkpoint, args.out, args.dtype, args.config, progress=not args.no_progress,
                         max_shard_size=args.max_shard_size)
        files = f" in {len(summary['files'])} files" if len(summary["files"]) > 1 else ""
        print(f"wrote {summary['path']}: {summary['tensors']} tensors{files}, {summary['bytes'] / 2**20:.1f} MiB "
              f"({args.dtype}); peak anonymous memory {summary['peak_anon_bytes'] / 2**20:.1f} MiB")
    elif args.command == "estimate":
        _estimate(args)
    return 0


def _estimate(args) -> None:
    import json

    import torch

    from . import GeminiConfig, format_bytes
    from .estimate import estimate

    with torch.device("meta"):
        if args.preset:
            from .models import GPT, GPT_PRESETS

            if args.preset not in GPT_PRESETS:
                raise SystemExit(f"gemini-ext estimate: unknown preset {args.preset!r}; choose from {sorted(GPT_PRESETS)}")
            preset = GPT_PRESETS[args.preset]
            if args.loss_chunk_tokens is not None:
                preset = dataclasses.replace(preset, loss_chunk_tokens=args.loss_chunk_tokens)
            model = GPT(preset)
        else:
            from transformers import AutoConfig, AutoModelForCausalLM

            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(args.hf_config))
    config = GeminiConfig(placement_policy=args.policy, max_norm=args.max_norm, precision=args.precision,
                          optimizer_state_dtype=args.optimizer_state_dtype, master_weights=not args.no_master_weights,
                          optimizer_step_in_backward=args.step_in_backward)
    device_bytes = int(args.device_bytes) if args.device_bytes and args.device_bytes.isdigit() else args.device_bytes
    host_bytes = int(args.host_bytes) if args.host_bytes and args.host_bytes.isdigit() else args.host_bytes
    e = estimate(model, config, tokens_per_step=args.tokens_per_step, world_size=args.world_size,
                 checkpointing=not args.no_checkpointing, loss_chunk_tokens=args.loss_chunk_tokens,
                 device_bytes=device_bytes, host_bytes=host_bytes,
                 peak_tflops=args.peak_tflops, device_name=args.device_name,
                 cpu_optimizer_elements_per_s=args.cpu_rate)
    if args.json:
        print(json.dumps(e, indent=2))
        return
    plan, parts = e["plan"], e["step_parts_s"]
    print(f"plan         {plan['chunk_sets']} chunk sets of {plan['chunk_size']:,} elements; optimizer state of "
          f"{plan['optim_sets_on_device']} on the device, {plan['optim_sets_on_host']} on the host "
          f"({plan['link_lane_sets']} of them stepped over the link), {plan['host_stepped_parameters'] / 1e9:.2f}B "
          f"parameters stepped from the host")
    print(f"memory       device {format_bytes(e['device_bytes'])} (activations {format_bytes(e['activation_bytes'])}), "
          f"host {format_bytes(e['host_bytes'])} per rank")
    print(f"step         {e['step_time_s']:.3f} s predicted (GPU {parts['gpu']:.3f}, device optimizer "
          f"{parts['device_optimizer']:.3f}, gradients' copy {parts['gradients_tail']:.3f}, wait for the host's "
          f"{parts['optimizer_wait']:.3f}, "
          f"fetches {parts['fetch_stall']:.3f}): {e['tokens_per_s']:,.0f} tokens/s, "
          f"MFU {e['mfu']:.1%} of {e['inputs']['peak_tflops']:.0f} TFLOP/s")


if __name__ == "__main__":
    sys.exit(main())
