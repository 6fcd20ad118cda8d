"""Chunk moves vs per-tensor copies: host<->device bandwidth through the ChunkManager.

Moves a GPT-like set of tensors between pinned host memory and the device three ways, in one run:
  chunks      gemini_ext's ChunkManager moving whole chunks (async on its copy streams, then waits)
  per-tensor  torch copies of each tensor on its own (pinned source, non_blocking, then a sync)
  flat        one torch copy of all the bytes at once (the link's ceiling)
and prints a table of time and GB/s per direction (median of --repeats): link GB/s counts the
bytes that crossed (chunks include their padding), payload GB/s only the tensors' bytes. On a machine without a
GPU it runs on the sim device (memcpy speeds; use --smoke for the test suite).

    python bench/chunk_moves.py                 # 288 tensors, 772 MB, 32 MB chunks
    python bench/chunk_moves.py --smoke         # tiny, sim, used by the tests
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import gemini_ext as gx

MB = 10**6


def tensor_sizes(total_bytes: int, count: int, element_bytes: int) -> list[int]:
    """`count` tensor numels in a GPT-like 4:1 mix of large and small, summing to about total."""
    weights = [4.0 if i % 4 != 3 else 0.05 for i in range(count)]
    scale = total_bytes / element_bytes / sum(weights)
    return [max(1, int(w * scale)) for w in weights]


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def timed(fn, device: str, repeats: int) -> float:
    fn()  # warm-up
    sync(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["auto", "cuda", "sim"], default="auto")
    p.add_argument("--total-mb", type=float, default=772)
    p.add_argument("--tensors", type=int, default=288)
    p.add_argument("--chunk-mb", type=float, default=32,
                   help="smallest chunk size; the chunk-size search picks the size in [chunk-mb, 2 x chunk-mb]")
    p.add_argument("--no-search", action="store_true", help="use exactly --chunk-mb")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json-out", default=None)
    p.add_argument("--smoke", action="store_true", help="tiny sizes on sim, for the test suite")
    args = p.parse_args(argv)
    if args.smoke:
        args.device, args.total_mb, args.tensors, args.chunk_mb, args.repeats = "sim", 8, 24, 1, 2
    device = args.device if args.device != "auto" else ("cuda" if gx.cuda_available() else "sim")
    dtype = torch.bfloat16
    esize = 2
    sizes = tensor_sizes(int(args.total_mb * MB), args.tensors, esize)
    total_bytes = sum(sizes) * esize
    chunk_numel = max(int(args.chunk_mb * MB) // esize, max(sizes))
    if not args.no_search:  # as the engine does: the size with the least padding in range
        found = gx._C.search_chunk_size(sizes, chunk_numel, chunk_numel, max(1, chunk_numel // 1024), 32)
        chunk_numel = found["chunk_size_numel"]

    if device == "cuda":
        ctx = gx._C.DeviceContext("cuda", device_index=torch.cuda.current_device())
        torch_device = torch.device("cuda")
    else:
        ctx = gx._C.DeviceContext("sim", capacity_bytes=4 * total_bytes + (64 << 20))
        torch_device = torch.device("cpu")
    mgr = gx._C.ChunkManager(ctx)
    host = mgr.host_tier
    mgr.create_group("p", dtype, chunk_numel, host)
    handles = [mgr.register_tensor("p", f"t{i}", n, [n]) for i, n in enumerate(sizes)]
    mgr.finalize()
    for h in handles:
        mgr.tensor_view(h, host).fill_(1.0)
        mgr.transition(h, gx.TensorState.HOLD)
    chunks = range(mgr.num_chunks)

    def chunks_to(tier):
        def run():
            for c in chunks:
                mgr.move(c, tier, async_=True)
            for c in chunks:
                mgr.wait(c)
        return run

    # Peers: the same tensors as separate torch tensors in pinned memory / on the device.
    pin = device == "cuda"
    host_tensors = [torch.ones(n, dtype=dtype, pin_memory=pin) for n in sizes]
    dev_tensors = [torch.empty(n, dtype=dtype, device=torch_device) for n in sizes]
    flat_host = torch.ones(sum(sizes), dtype=dtype, pin_memory=pin)
    flat_dev = torch.empty(sum(sizes), dtype=dtype, device=torch_device)

    def per_tensor(h2d: bool):
        def run():
            for h, d in zip(host_tensors, dev_tensors):
                (d.copy_(h, non_blocking=True) if h2d else h.copy_(d, non_blocking=True))
        return run

    def flat(h2d: bool):
        return lambda: (flat_dev.copy_(flat_host, non_blocking=True) if h2d
                        else flat_host.copy_(flat_dev, non_blocking=True))

    # Chunk moves, each direction timed alone: H2D from the host tier, then D2H back.
    h2d, d2h = [], []
    for i in range(args.repeats + 1):  # the first round warms the pools up and is dropped
        sync(device)
        t0 = time.perf_counter()
        chunks_to("device")()
        sync(device)
        t1 = time.perf_counter()
        chunks_to(host)()
        sync(device)
        t2 = time.perf_counter()
        if i > 0:
            h2d.append(t1 - t0)
            d2h.append(t2 - t1)
    chunk_bytes = sum(mgr.chunk_info(c)["shard_numel"] for c in chunks) * esize  # payload + padding
    rows = []
    for method, direction, seconds in (
            ("chunks", "H2D", statistics.median(h2d)), ("chunks", "D2H", statistics.median(d2h)),
            ("per-tensor", "H2D", timed(per_tensor(True), device, args.repeats)),
            ("per-tensor", "D2H", timed(per_tensor(False), device, args.repeats)),
            ("flat", "H2D", timed(flat(True), device, args.repeats)),
            ("flat", "D2H", timed(flat(False), device, args.repeats))):
        moved = chunk_bytes if method == "chunks" else total_bytes
        rows.append({"method": method, "direction": direction, "bytes_moved": moved, "ms": seconds * 1e3,
                     "link_GB_per_s": moved / seconds / 1e9, "payload_GB_per_s": total_bytes / seconds / 1e9})

    print(f"device={device}  tensors={len(sizes)}  payload={total_bytes / MB:.1f} MB  "
          f"chunks={mgr.num_chunks} x {chunk_numel * esize / MB:.1f} MB"
          f"{'' if args.no_search else ' (searched)'}  (median of {args.repeats})")
    print(f"{'method':<12}{'dir':<5}{'MB moved':>10}{'ms':>10}{'link GB/s':>11}{'payload GB/s':>14}")
    for r in rows:
        print(f"{r['method']:<12}{r['direction']:<5}{r['bytes_moved'] / MB:>10.1f}{r['ms']:>10.2f}"
              f"{r['link_GB_per_s']:>11.2f}{r['payload_GB_per_s']:>14.2f}")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"device": device, "chunks": mgr.num_chunks, "chunk_bytes": chunk_numel * esize, "rows": rows},
                      f, indent=2)
    return rows


if __name__ == "__main__":
    main()
