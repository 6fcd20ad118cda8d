"""CPU SGD, Lion and Adagrad: gemini_ext's fused kernels against torch's own CPU implementation
of the same optimizer on the same arrays, as an offloaded mixed-precision chunk needs them: a bf16
gradient in, the fp32 master and state updated, a bf16 copy of the parameter out.

torch's optimizers step fp32 tensors, so its side is three passes: cast the gradient up, step
(fused=True where torch has a fused CPU kernel: SGD and Adagrad; Lion, which torch lacks, is
gx.optim.Lion's foreach torch ops), cast the parameter down. Ours is one pass. Both sides use all
cores (torch's intra-op threads; our ThreadPool). Median of --repeats steps, per size.

    python bench/cpu_optim.py                     # 100 M and 400 M parameters
    python bench/cpu_optim.py --smoke             # tiny, for the test suite
"""

from __future__ import annotations

import argparse
import json

import torch

import gemini_ext as gx
from cpu_adam import timed  # bench/: the median of timed repeats after two warm-ups

CASES = {  # name: (torch class, torch kwargs, our hyperparameters, state kinds)
    "sgd": (torch.optim.SGD, {"lr": 1e-3, "momentum": 0.9, "weight_decay": 0.1, "fused": True},
            {"lr": 1e-3, "momentum": 0.9, "dampening": 0.0, "weight_decay": 0.1, "nesterov": 0.0, "maximize": 0.0}, 1),
    "lion": (gx.optim.Lion, {"lr": 1e-4, "weight_decay": 0.1},
             {"lr": 1e-4, "beta1": 0.9, "beta2": 0.99, "weight_decay": 0.1}, 1),
    "adagrad": (torch.optim.Adagrad, {"lr": 1e-2, "weight_decay": 0.1, "fused": True},
                {"lr": 1e-2, "lr_decay": 0.0, "weight_decay": 0.1, "eps": 1e-10, "initial_accumulator_value": 0.0,
                 "maximize": 0.0}, 1),
}


def measure(name: str, n: int, repeats: int) -> list[dict]:
    opt_cls, torch_kw, hyper, num_states = CASES[name]
    torch.manual_seed(0)
    grad16 = (torch.randn(n) * 1e-3).to(torch.bfloat16)
    tp = torch.nn.Parameter(torch.randn(n))
    tp.grad = grad16.float()
    topt = opt_cls([tp], **torch_kw)
    t16 = torch.empty(n, dtype=torch.bfloat16)

    def torch_step():
        tp.grad.copy_(grad16)
        topt.step()
        t16.copy_(tp.detach())

    master, states = torch.randn(n), [torch.zeros(n) for _ in range(num_states)]
    out16 = torch.empty(n, dtype=torch.bfloat16)
    step = [0]

    def ours():
        step[0] += 1
        gx._C.cpu_optim_step(name, master, states, grad16, out16, step=step[0], hyper=hyper)

    kind = "fused" if torch_kw.get("fused") else "foreach torch ops"
    rows = []
    for system, fn in ((f"torch {opt_cls.__name__} ({kind}) + casts", torch_step), ("gemini_ext, one pass", ours)):
        seconds = timed(fn, repeats)
        rows.append({"optimizer": name, "params": n, "system": system, "ms": seconds * 1e3,
                     "Gparams_per_s": n / seconds / 1e9})
    rows[1]["speedup"] = rows[0]["ms"] / rows[1]["ms"]
    return rows


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--params-m", default="100,400", help="comma-separated sizes in millions of parameters")
    p.add_argument("--only", default=",".join(CASES), help="comma-separated subset of: " + ", ".join(CASES))
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--json-out", default=None)
    p.add_argument("--smoke", action="store_true")
    args = p.parse_args(argv)
    sizes = [float(s) for s in args.params_m.split(",")]
    if args.smoke:
        sizes, args.repeats = [0.2], 2
    rows = []
    for n in sizes:
        for name in args.only.split(","):
            rows += measure(name.strip(), int(n * 1e6), args.repeats)
    info = gx._C.build_info()
    print(f"torch {torch.__version__} with {torch.get_num_threads()} threads, gemini_ext ISA {info['simd_isa']}, "
          f"median of {args.repeats}; bf16 gradient in, fp32 master and state, bf16 copy out")
    print(f"{'optimizer':<10}{'M params':>9}  {'system':<40}{'ms':>9}{'G params/s':>12}{'x torch':>9}")
    for r in rows:
        speedup = f"{r['speedup']:>9.2f}" if "speedup" in r else f"{'':>9}"
        print(f"{r['optimizer']:<10}{r['params'] / 1e6:>9.0f}  {r['system']:<40}{r['ms']:>9.2f}"
              f"{r['Gparams_per_s']:>12.2f}{speedup}")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(rows, f, indent=2)
    return rows


if __name__ == "__main__":
    main()
