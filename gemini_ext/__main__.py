"""gemini-ext (or python -m gemini_ext) info | export CKPT OUT [--dtype bf16] [--config config.json] [--max-shard-size 5GB]"""

import argparse
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
