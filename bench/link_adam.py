"""Host-resident Adam state stepped two ways at once: the CPU kernel, and the device kernel reading
and writing the same pinned host memory over the link (zero-copy, no device memory).
    python3 bench/link_adam.py --params-m 800           # on a GPU machine
Rows: parameters per second of the CPU kernel alone (all cores), of the device kernel over mapped
host memory alone, and of both together on disjoint shares of the same arrays (the device's share
launched first, asynchronously, then the CPU's; the time until both are done). fp32 master and
moments, bf16 gradient in and bf16 parameter copy out: 28 bytes per parameter each way counted.
"""

from __future__ import annotations

import argparse
import time

import torch

import gemini_ext as gx

HYPER = dict(lr=1e-4, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, adamw=True, grad_scale=1.0)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--params-m", type=float, default=800)
    p.add_argument("--shares", default="0.3,0.4,0.5", help="device shares to run together with the CPU")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--blocks", type=int, default=gx._C.LINK_LANE_BLOCKS, help="the device kernel's block cap (0: none)")
    args = p.parse_args(argv)
    n = int(args.params_m * 2**20)
    dev = torch.device("cuda")
    pin = dict(pin_memory=True)
    master, m, v = (torch.zeros(n, **pin) for _ in range(3))
    grad = torch.empty(n, dtype=torch.bfloat16, **pin).fill_(1e-3)
    p16 = torch.empty(n, dtype=torch.bfloat16, **pin)
    mapped = [gx._C.mapped_device_view(t, dev) for t in (master, m, v, grad, p16)]
    step = [0]

    def cpu(a, b):
        step[0] += 1
        if b > a:
            gx._C.cpu_adam_step(master[a:b], m[a:b], v[a:b], grad[a:b], p16[a:b], step=step[0], **HYPER)

    def link(a, b):
        if b > a:
            mm, mmv, mv, mg, mp = (t[a:b] for t in mapped)
            gx._C.device_adam_step(mm, mmv, mv, mg, mp, step=step[0] + 1, max_blocks=args.blocks, **HYPER)

    def timed(fn):
        best = float("inf")
        for _ in range(args.repeats):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t0)
        return best

    rows = [("CPU kernel alone", timed(lambda: cpu(0, n))),
            ("device kernel over mapped host memory", timed(lambda: link(0, n)))]
    for share in (float(s) for s in args.shares.split(",")):
        k = int(n * share) // 64 * 64
        rows.append((f"both, device share {share:.0%}", timed(lambda: (link(0, k), cpu(k, n)))))
    # what the device kernel over the link costs compute running beside it: bf16 matmuls on the
    # default stream, alone and while the kernel steps the whole array on a stream of its own
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    side = torch.cuda.Stream()

    def matmuls():
        for _ in range(40):
            a @ a

    alone = timed(matmuls)

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(side):
        link(0, n)
    start.record()
    matmuls()
    end.record()
    torch.cuda.synchronize()
    slowed = start.elapsed_time(end) / 1e3
    # bit-exactness of the two kernels on the same inputs (fresh copies)
    a = [t[:1 << 20].clone() for t in (master, m, v)]
    b = [x.clone().pin_memory() for x in a]
    g = grad[:1 << 20]
    o16, d16 = torch.empty_like(g), torch.empty_like(g).pin_memory()
    gx._C.cpu_adam_step(a[0], a[1], a[2], g, o16, step=7, **HYPER)
    mv = [gx._C.mapped_device_view(x, dev) for x in (*b, g.clone().pin_memory(), d16)]
    gx._C.device_adam_step(*mv[:4], mv[4], step=7, **HYPER)
    torch.cuda.synchronize()
    exact = all(torch.equal(x, y) for x, y in zip(a + [o16], b + [d16]))
    print(f"{n / 1e6:.0f}M parameters, {torch.get_num_threads()} CPU threads; kernels bit-equal: {exact}")
    print("| run | ms | G params/s | GB/s over 28 B/param |\n|---|---|---|---|")
    for name, s in rows:
        print(f"| {name} | {s * 1e3:.1f} | {n / s / 1e9:.2f} | {28 * n / s / 1e9:.0f} |")
    print(f"\n40 bf16 8192^2 matmuls: {alone * 1e3:.1f} ms alone, {slowed * 1e3:.1f} ms beside the device kernel "
          f"over the link ({args.blocks or 'uncapped'} blocks)")


if __name__ == "__main__":
    main()
