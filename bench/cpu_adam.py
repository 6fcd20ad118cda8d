"""CPU Adam: gemini_ext's fused kernel against torch.optim.AdamW(fused=True) on the same arrays.

For an offloaded mixed-precision chunk the CPU step must read a bf16 gradient and produce a bf16
copy of the updated parameter. torch's fused AdamW steps fp32 tensors only, so its pipeline is
three passes (cast the gradient up, step, cast the parameter down); ours is one. Rows:
  torch fused AdamW, fp32 grad          the step alone (the best torch can do)
  torch fused AdamW + casts, bf16 in/out  what an offloaded bf16 chunk needs from torch
  gemini_ext, fp32 grad                 our step alone
  gemini_ext, bf16 grad + bf16 copy     our one-pass equivalent of the second row
  gemini_ext, ... bf16 moments          optimizer_state_dtype="bf16": m and v stochastically rounded
                                        (in place, and out of place as a speculative step runs)
  gemini_ext correction / undo          a step guessed during backward, made the clipped step /
                                        taken back (the in-place speculation's second pass)
Both sides use all cores (torch's intra-op threads; our ThreadPool). Median of --repeats steps.

The host step is bound by memory traffic, so each row also gives its bytes per parameter (what it
must read and write once: 28 with fp32 master and moments, a bf16 gradient and a bf16 copy; 20
with bf16 moments) and the bandwidth that makes, against the same cores' own measured bandwidth:
a copy (STREAM's convention: 8 bytes per fp32 element read and written) and an in-place
`b += s * c` (12 bytes, no write-allocate: the closest to the in-place step's access pattern).

    python bench/cpu_adam.py                    # 100 M parameters
    python bench/cpu_adam.py --smoke            # tiny, for the test suite
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import gemini_ext as gx


def timed(fn, repeats: int) -> float:
    fn()
    fn()  # warm-up: page faults, thread start
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)



def _bandwidth(n: int, repeats: int) -> dict:
    """GB/s of a copy and an in-place add over fp32 arrays of 4 x n elements (freed on return)."""
    dst, src = torch.rand(4 * n), torch.rand(4 * n)
    timings = {"copy": (timed(lambda: dst.copy_(src), repeats), 8 * 4 * n),
               "add in place": (timed(lambda: dst.add_(src, alpha=0.5), repeats), 12 * 4 * n)}
    return {k: nbytes / s / 1e9 for k, (s, nbytes) in timings.items()}

def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--params-m", type=float, default=100.0, help="millions of parameters")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--json-out", default=None)
    p.add_argument("--smoke", action="store_true")
    args = p.parse_args(argv)
    if args.smoke:
        args.params_m, args.repeats = 0.2, 2
    n = int(args.params_m * 1e6)
    hyper = dict(lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)
    torch.manual_seed(0)
    grad16 = (torch.randn(n) * 1e-3).to(torch.bfloat16)

    # torch: a parameter with fp32 grad, fused AdamW on the CPU
    tp = torch.nn.Parameter(torch.randn(n))
    tp.grad = grad16.float()
    topt = torch.optim.AdamW([tp], fused=True, **hyper)
    t16 = torch.empty(n, dtype=torch.bfloat16)

    def torch_step():
        topt.step()

    def torch_step_with_casts():
        tp.grad.copy_(grad16)
        topt.step()
        t16.copy_(tp.detach())

    # ours: the same arrays
    gp, gm, gv = torch.randn(n), torch.zeros(n), torch.zeros(n)
    g32 = grad16.float()
    g16out = torch.empty(n, dtype=torch.bfloat16)
    step = [0]

    spare = [torch.empty(n), torch.empty(n), torch.empty(n)]  # the speculative step's outputs

    bm, bv = torch.zeros(n, dtype=torch.bfloat16), torch.zeros(n, dtype=torch.bfloat16)  # bf16 moments
    spare16 = [torch.empty(n), torch.empty(n, dtype=torch.bfloat16), torch.empty(n, dtype=torch.bfloat16)]

    def ours(grad, out, out_of_place=False, bf16_moments=False):
        m, v = (bm, bv) if bf16_moments else (gm, gv)

        def run():
            step[0] += 1
            gx._C.cpu_adam_step(gp, m, v, grad, out, step=step[0], lr=hyper["lr"], beta1=0.9, beta2=0.999,
                                eps=hyper["eps"], weight_decay=hyper["weight_decay"], adamw=True,
                                out=(spare16 if bf16_moments else spare) if out_of_place else None,
                                random_key=step[0])
        return run

    def correct(true_scale):
        def run():
            gx._C.cpu_adam_correct(gp, gm, gv, grad16, g16out, step=max(step[0], 2), lr=hyper["lr"], beta1=0.9,
                                   beta2=0.999, eps=hyper["eps"], weight_decay=hyper["weight_decay"],
                                   taken_scale=1.0, true_scale=true_scale)
        return run

    # the machine's bandwidth on the same cores: fp32 arrays of 4 x n elements (1.6 GB at 100 M)
    bandwidth = _bandwidth(n, args.repeats)

    traffic = {"torch fused AdamW, fp32 grad": 28, "torch fused AdamW + casts, bf16 in/out": 28,
               "gemini_ext, fp32 grad": 28}  # bytes per parameter, read and written once
    rows = []
    for name, fn in (("torch fused AdamW, fp32 grad", torch_step),
                     ("torch fused AdamW + casts, bf16 in/out", torch_step_with_casts),
                     ("gemini_ext, fp32 grad", ours(g32, None)),
                     ("gemini_ext, bf16 grad + bf16 copy", ours(grad16, g16out)),
                     ("gemini_ext out of place, bf16 grad + copy", ours(grad16, g16out, out_of_place=True)),
                     ("gemini_ext, bf16 grad + copy, bf16 moments", ours(grad16, g16out, bf16_moments=True)),
                     ("gemini_ext out of place, ..., bf16 moments",
                      ours(grad16, g16out, out_of_place=True, bf16_moments=True)),
                     ("gemini_ext correction, bf16 grad + copy", correct(0.5)),
                     ("gemini_ext undo, bf16 grad + copy", correct(None))):
        seconds = timed(fn, args.repeats)
        nbytes = traffic.get(name, 20 if "bf16 moments" in name else 28)
        rows.append({"system": name, "ms": seconds * 1e3, "Gparams_per_s": n / seconds / 1e9,
                     "bytes_per_param": nbytes, "GB_per_s": nbytes * n / seconds / 1e9})
    base_fp32, base_mixed = rows[0]["ms"], rows[1]["ms"]
    for r in rows:
        r["vs_torch_fp32"] = base_fp32 / r["ms"]
        r["vs_torch_mixed"] = base_mixed / r["ms"]

    best = max(bandwidth.values())
    for r in rows:
        r["of_bandwidth"] = r["GB_per_s"] / best

    info = gx._C.build_info()
    print(f"{n / 1e6:.1f} M params, torch {torch.__version__} with {torch.get_num_threads()} threads, "
          f"gemini_ext ISA {info['simd_isa']}, median of {args.repeats}; memory bandwidth on these cores: "
          + ", ".join(f"{k} {v:.1f} GB/s" for k, v in bandwidth.items()))
    print(f"{'system':<44}{'ms':>9}{'G params/s':>12}{'B/param':>9}{'GB/s':>8}{'of bw':>7}{'x torch fp32':>14}"
          f"{'x torch mixed':>15}")
    for r in rows:
        print(f"{r['system']:<44}{r['ms']:>9.2f}{r['Gparams_per_s']:>12.2f}{r['bytes_per_param']:>9}"
              f"{r['GB_per_s']:>8.1f}{r['of_bandwidth']:>7.0%}{r['vs_torch_fp32']:>14.2f}{r['vs_torch_mixed']:>15.2f}")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"params": n, "rows": rows, "bandwidth_GB_per_s": bandwidth}, f, indent=2)
    return rows


if __name__ == "__main__":
    main()
