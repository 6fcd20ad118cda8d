"""python -m gemini_ext info"""

import argparse
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gemini_ext", description="gemini_ext command line")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="print the build (CPU/CUDA, CUDA version, SIMD ISA), torch, allocator and device")
    args = parser.parse_args(argv)
    if args.command == "info":
        from .info import print_info

        print_info()
    return 0


if __name__ == "__main__":
    sys.exit(main())
