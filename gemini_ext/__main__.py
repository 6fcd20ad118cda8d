"""gemini-ext (or python -m gemini_ext) info
| export CKPT OUT [--dtype bf16] [--config config.json] [--max-shard-size 5GB]
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
                     help="a HuggingFace config.json (or the directory holding it), checked against the checkpoint: "
                          "OUT becomes a directory from_pretrained reads")
    exp.add_argument("--max-shard-size", default=None,
                     help="shards of at most this size, e.g. 5GB, with model.safetensors.index.json (OUT is a "
                          "directory, as transformers' save_pretrained writes it)")
    exp.add_argument("--no-progress", action="store_true")
    _add_estimate_parser(sub)
    args = parser.parse_args(argv)
    if args.command == "info":
        from .info import print_info

        print_info()
    elif args.command == "export":
        from .export import export

        try:
            summary = export(args.checkpoint, args.out, args.dtype, args.config, progress=not args.no_progress,
                             max_shard_size=args.max_shard_size)
        except (ValueError, TypeError, FileNotFoundError) as exc:  # the caller's input: one line, no traceback
            print(f"{prog} export: {str(exc).removeprefix('export: ')}", file=sys.stderr)
            return 2
        files = f" in {len(summary['files'])} files" if len(summary["files"]) > 1 else ""
        print(f"wrote {summary['path']}: {summary['tensors']} tensors{files}, {summary['bytes'] / 2**20:.1f} MiB "
              f"({args.dtype}); peak anonymous memory {summary['peak_anon_bytes'] / 2**20:.1f} MiB")
    elif args.command == "estimate":
        return _estimate(args)
    return 0


def _add_estimate_parser(sub) -> None:
    est = sub.add_parser("estimate", help="the plan, device and host memory and a predicted step time of a model "
                                          "built on meta (gx.estimate), before any memory is touched")
    model = est.add_mutually_exclusive_group(required=True)
    model.add_argument("--preset", help="a GPT preset of gemini_ext.models (e.g. 15b)")
    model.add_argument("--hf-config", help="a HuggingFace config.json (a causal LM built from it on meta)")
    est.add_argument("--tokens-per-step", type=int, required=True, help="tokens per optimizer step, all ranks")
    est.add_argument("--world-size", type=int, default=1)
    est.add_argument("--no-checkpointing", action="store_true",
                     help="activations kept (default: checkpointed per block)")
    est.add_argument("--loss-chunk-tokens", type=int, default=None,
                     help="the loss over this many tokens at a time, checkpointed (default: the preset's, 0)")
    est.add_argument("--policy", default="auto", choices=["static", "auto", "const"])
    est.add_argument("--const-gpu-budget", default=None,
                     help="GeminiConfig.const_gpu_budget: the chunks' device budget under --policy const, e.g. 8GiB")
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
    est.add_argument("--cpu-rate", type=float, default=None,
                     help="CPU Adam elements/s there (default: measured here, and printed; it varies with the host's "
                          "load from run to run, so pass it to compare runs)")
    est.add_argument("--search-range-m", type=float, default=None,
                     help="GeminiConfig.search_range_m: the chunk search's range in 2**20 elements (default 128)")
    est.add_argument("--min-chunk-size-m", type=float, default=None,
                     help="GeminiConfig.min_chunk_size_m (default 32)")
    est.add_argument("--gpu-memory-limit", default=None, help="GeminiConfig.gpu_memory_limit, e.g. 24GiB")
    est.add_argument("--gpu-flops-per-s", type=float, default=None,
                     help="the GPU's achieved rate on this model, e.g. from its forward and backward alone "
                          "(default: the device's peak times the estimate's efficiency)")
    est.add_argument("--seq-len", type=int, default=None,
                     help="tokens per sequence: the attention-score work of sequences longer than 1024 (default 1024)")
    est.add_argument("--json", action="store_true", help="print the whole estimate as JSON")


# gx.estimate's and GeminiConfig's keywords as the estimate command spells them, for its messages.
ESTIMATE_FLAGS = {"device_bytes": "--device-bytes", "host_bytes": "--host-bytes", "peak_tflops": "--peak-tflops",
                  "device_name": "--device-name", "cpu_optimizer_elements_per_s": "--cpu-rate",
                  "tokens_per_step": "--tokens-per-step", "world_size": "--world-size",
                  "loss_chunk_tokens": "--loss-chunk-tokens", "search_range_m": "--search-range-m",
                  "min_chunk_size_m": "--min-chunk-size-m", "gpu_memory_limit": "--gpu-memory-limit",
                  "max_norm": "--max-norm", "optimizer_step_in_backward": "--step-in-backward",
                  "optimizer_state_dtype": "--optimizer-state-dtype", "master_weights": "--no-master-weights",
                  "placement_policy": "--policy", "const_gpu_budget": "--const-gpu-budget", "seq_len": "--seq-len",
                  "gpu_flops_per_s": "--gpu-flops-per-s",
                  "activation_bytes_per_token_override": "--hf-config of a model with an embedding and blocks"}


def in_flags(message: str) -> str:
    """`message` with gx.estimate's keywords (`device_bytes=`, `gx.estimate(device_bytes=...)`) as the flags."""
    import re

    message = re.sub(r"gx\.estimate\((\w+)=\.\.\.\)", r"\1", message).replace("gx.estimate: ", "")
    message = message.replace(" (or a chunk_config_dict)", "")  # a config field the command has no flag for
    for key, flag in sorted(ESTIMATE_FLAGS.items(), key=lambda kv: -len(kv[0])):
        message = re.sub(rf"\b{key}=(?=[\w.'\"])", flag + " ", message)  # search_range_m=256: --search-range-m 256
        message = re.sub(rf"\b{key}=?(?=\W|$)", flag, message)
    return message


def _estimate_model(args):
    """The model to estimate, built on meta: a preset of gemini_ext's GPT or a transformers config;
    None (with the message printed) for an unknown preset."""
    import torch

    with torch.device("meta"):
        if args.preset:
            from .models import GPT, GPT_PRESETS

            if args.preset not in GPT_PRESETS:
                print(f"gemini-ext estimate: unknown preset {args.preset!r}; choose from {sorted(GPT_PRESETS)}",
                      file=sys.stderr)
                return None
            preset = GPT_PRESETS[args.preset]
            if args.loss_chunk_tokens is not None:
                preset = dataclasses.replace(preset, loss_chunk_tokens=args.loss_chunk_tokens)
            return GPT(preset)
        from transformers import AutoConfig, AutoModelForCausalLM

        return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(args.hf_config))


def _estimate(args) -> int:
    import json
    import warnings

    import torch

    from . import GeminiConfig, _C, format_bytes
    from .estimate import estimate

    model = _estimate_model(args)
    if model is None:
        return 2

    def number(text):
        return int(text) if text and text.isdigit() else text

    search = {k: v for k, v in (("search_range_m", args.search_range_m), ("min_chunk_size_m", args.min_chunk_size_m))
              if v is not None}
    try:
        config = GeminiConfig(placement_policy=args.policy, max_norm=args.max_norm, precision=args.precision,
                              optimizer_state_dtype=args.optimizer_state_dtype,
                              master_weights=not args.no_master_weights,
                              optimizer_step_in_backward=args.step_in_backward,
                              gpu_memory_limit=number(args.gpu_memory_limit),
                              const_gpu_budget=number(args.const_gpu_budget), **search)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            e = estimate(model, config, tokens_per_step=args.tokens_per_step, world_size=args.world_size,
                         checkpointing=not args.no_checkpointing, loss_chunk_tokens=args.loss_chunk_tokens,
                         device_bytes=number(args.device_bytes), host_bytes=number(args.host_bytes),
                         peak_tflops=args.peak_tflops, device_name=args.device_name,
                         cpu_optimizer_elements_per_s=args.cpu_rate, seq_len=args.seq_len,
                         gpu_flops_per_s=args.gpu_flops_per_s)
    except (ValueError, TypeError, NotImplementedError, _C.OutOfMemoryError, torch.OutOfMemoryError) as exc:
        print(f"gemini-ext estimate: {in_flags(str(exc))}", file=sys.stderr)
        return 2
    for w in caught:
        print(f"warning: {in_flags(str(w.message))}", file=sys.stderr)
    if args.json:
        print(json.dumps(e, indent=2))
        return 0 if e["fits"]["device"] and e["fits"]["host"] is not False else 1
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
    rates = e["rates"]
    print(f"rates        GPU {rates['gpu_flops_per_s'] / 1e12:.0f} TFLOP/s achieved; CPU Adam "
          f"{rates['cpu_optimizer_elements_per_s'] / 1e9:.2f} G elements/s ({rates['cpu_optimizer_source']}); "
          f"host-to-device {rates['h2d_bytes_per_s'] / 1e9:.0f} GB/s")
    fits = e["fits"]
    if not fits["device"]:
        over = e["device_bytes"] - fits["device_capacity_bytes"]
        print(f"does not fit: the device needs {format_bytes(e['device_bytes'])} and has "
              f"{format_bytes(fits['device_capacity_bytes'])} ({format_bytes(over)} over; activations "
              f"{format_bytes(e['activation_bytes'])}): lower --tokens-per-step per rank, add ranks (--world-size) or "
              "take a larger device (--device-bytes)")
    if fits["host"] is False:
        over = e["host_bytes"] - fits["host_available_bytes"]
        print(f"does not fit: the host needs {format_bytes(e['host_bytes'])} per rank and has "
              f"{format_bytes(fits['host_available_bytes'])} ({format_bytes(over)} over): add ranks (--world-size), "
              "a larger host (--host-bytes) or a smaller state (--optimizer-state-dtype bf16)")
    return 0 if fits["device"] and fits["host"] is not False else 1


if __name__ == "__main__":
    sys.exit(main())
