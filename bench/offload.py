"""Offloaded training side by side: plain PyTorch, FSDP2 + CPU offload and gemini_ext under each
policy, on the same model, batch and device-memory budget, each in a fresh process.

    python bench/offload.py --preset 1.3b --budget 16GiB          # a 16 GiB budget (GPU)
    python bench/offload.py --preset 1.3b                         # the whole device
    python bench/offload.py --preset 6.7b --batch 1 --init-device cuda --only plain,gemini-auto
    python bench/offload.py --smoke                               # tiny model, CPU + sim (tests)

Systems (--only picks some):
  plain            the model on the GPU, bf16 autocast, fused AdamW on the GPU (where it fits)
  fsdp2-offload    FSDP2 with CPUOffloadPolicy(pin_memory=True) and fused CPU AdamW
  gemini-static    gemini_ext, optimizer state on the host, the CPU step overlapped (default)
  gemini-serial    the same with overlap_optimizer=False: the CPU step inside optimizer.step()
  gemini-auto      gemini_ext's auto policy (optimizer state on the device where it fits)
  deepspeed-offload        DeepSpeed ZeRO-3, parameters and optimizer offloaded, DeepSpeedCPUAdam
  deepspeed-offload-optim  DeepSpeed ZeRO-3, the optimizer offloaded
  colossalai-static        ColossalAI GeminiPlugin static (offload_optim_frac=1.0), HybridAdam
  colossalai-auto          ColossalAI GeminiPlugin auto, HybridAdam
The DeepSpeed and ColossalAI rows (bench/peers_train.py) run where the package is importable on a
CUDA machine and are reported as skipped elsewhere; --peer-stubs passes the folder of import-only
stand-ins ColossalAI needs where some of its optional imports are missing.
The budget caps torch's allocator for the peers (set_per_process_memory_fraction) and is
gemini_ext's gpu_memory_limit (chunks plus activations).

A first process measures the rates the overlap bound is made of, in the same run: the GPU's
forward + backward time on this model and batch (bf16 weights, nothing offloaded; estimated from
FLOPs at the measured matmul rate when the model does not fit), CPU Adam parameters per second
(gemini_ext's kernel, bf16 gradient and parameter copy), and pinned H2D / D2H bandwidth (32 MB
copies). The bound for a row is max(GPU compute, CPU Adam of its host-resident parameters, its
PCIe bytes / bandwidth). Model TFLOP/s counts 6 x parameters x tokens (no attention FLOPs).
Writes markdown, JSON and a PNG bar chart next to --out.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GEMINI = os.path.join(REPO, "examples", "train_gpt.py")
PEER = os.path.join(REPO, "bench", "fsdp2_train.py")
OTHER_PEERS = os.path.join(REPO, "bench", "peers_train.py")
OPTIMIZERS = ("adamw", "sgd", "lion")  # gemini_ext/models/optimizers.py (not imported: this driver loads no torch)

RATES = r"""
import json, sys, time
import torch
sys.path.insert(0, REPO)
import gemini_ext as gx
from gemini_ext.models import GPT, GPT_PRESETS, synthetic_batch, checkpoint_blocks
preset, batch, seq, ckpt = ARGS
out = {}
cfg = GPT_PRESETS[preset]
seq = seq or cfg.max_seq_len
# CPU Adam: gemini_ext's kernel as the offloaded step runs it (fp32 state, bf16 grad and copy)
n = 1 << 26 if torch.cuda.is_available() else 1 << 20
p, m, v = (torch.zeros(n) for _ in range(3))
g = torch.randn(n).bfloat16()
p16 = torch.empty(n, dtype=torch.bfloat16)
def adam():
    gx._C.cpu_adam_step(p, m, v, g, p16, step=1, lr=1e-4, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1,
                        adamw=True, grad_scale=1.0, isa="")
adam()
t0 = time.perf_counter(); reps = 5
for _ in range(reps): adam()
out["cpu_adam_params_per_s"] = reps * n / (time.perf_counter() - t0)
if torch.cuda.is_available():
    dev = torch.device("cuda")
    host = torch.empty(32 << 20, dtype=torch.uint8).pin_memory()
    gpu = torch.empty(32 << 20, dtype=torch.uint8, device=dev)
    for name, fn in (("h2d", lambda: gpu.copy_(host, non_blocking=True)),
                     ("d2h", lambda: host.copy_(gpu, non_blocking=True))):
        fn(); torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(20): fn()
        torch.cuda.synchronize()
        out[name + "_bytes_per_s"] = 20 * host.numel() / (time.perf_counter() - t0)
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    a @ a; torch.cuda.synchronize(); t0 = time.perf_counter()
    for _ in range(10): a @ a
    torch.cuda.synchronize()
    out["matmul_flops_per_s"] = 10 * 2 * 8192**3 / (time.perf_counter() - t0)
    del a
    torch.manual_seed(0)
    n_params = cfg.num_parameters()
    try:
        model = GPT(cfg).to(dev, torch.bfloat16)
        if ckpt:
            checkpoint_blocks(model)
        x, y = synthetic_batch(cfg, batch, seq, 0, dev)
        times = []
        for i in range(4):
            torch.cuda.synchronize(); t0 = time.perf_counter()
            model(x, y).backward()
            torch.cuda.synchronize(); times.append(time.perf_counter() - t0)
            model.zero_grad(set_to_none=True)
        out["gpu_compute_s"] = sorted(times[1:])[1]
        out["gpu_compute_measured"] = True
    except torch.OutOfMemoryError:
        out["gpu_compute_s"] = 6 * n_params * batch * seq * (4 / 3 if ckpt else 1) / out["matmul_flops_per_s"]
        out["gpu_compute_measured"] = False
print(json.dumps(out))
"""


def systems(budget: str | None) -> dict[str, tuple[str, list[str]]]:
    peer_budget = ["--device-budget", budget] if budget else []
    gx_budget = ["--gpu-limit", budget] if budget else []
    return {
        "plain": (PEER, ["--plain", *peer_budget]),
        "fsdp2-offload": (PEER, ["--offload", *peer_budget]),
        "gemini-static": (GEMINI, ["--policy", "static", *gx_budget]),
        "gemini-serial": (GEMINI, ["--policy", "static", "--no-overlap", *gx_budget]),
        "gemini-auto": (GEMINI, ["--policy", "auto", *gx_budget]),
        **{name: (OTHER_PEERS, ["--system", name, *peer_budget])
           for name in ("deepspeed-offload", "deepspeed-offload-optim", "colossalai-static", "colossalai-auto")},
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# torchrun's own failure report: lines that say "error" without saying which
TORCHRUN_REPORT = ("error_file:", "To enable traceback see", "ChildFailedError", "elastic/errors")


def last_error(proc: subprocess.CompletedProcess) -> str:
    """The cause of a failed run, in one line: the child's last exception line (e.g.
    "torch.OutOfMemoryError: CUDA out of memory ..."), else the signal torchrun saw (a child killed
    by the host's out-of-memory killer raises nothing), else the last line of stderr. Once a process
    group exists torchrun's children prefix their lines with "[rankN]:"; the rank whose traceback
    came first is the cause (the others fail after it, waiting on it), so its last exception is named."""
    first_seen: dict[str, int] = {}
    last_exception: dict[str, str] = {}
    lines = []
    for i, raw in enumerate((proc.stderr + proc.stdout).splitlines()):
        m = re.match(r"^\[(rank\d+)\]:\s*(.*)$", raw.strip())
        rank, ln = (m.group(1), m.group(2).strip()) if m else ("", raw.strip())
        lines.append(ln)
        if re.match(r"^[\w.]*(Error|Exception|Interrupt)\b[^:]*:", ln) and not any(n in ln for n in TORCHRUN_REPORT):
            first_seen.setdefault(rank, i)
            last_exception[rank] = ln
    if last_exception:
        rank = min(first_seen, key=first_seen.get)
        return (f"[{rank}] " if rank else "") + last_exception[rank]
    signals = [ln for ln in lines if re.search(r"Signal \d+ \(\w+\) received", ln)]
    if signals:
        return signals[-1].split(":", 1)[-1].strip() + ", no Python exception"
    if proc.returncode is not None and proc.returncode < 0:  # a rank run without torchrun, ended by a signal
        number = -proc.returncode
        try:
            name = signal.Signals(number).name
        except ValueError:
            name = "unknown"
        return f"Signal {number} ({name}) ended the rank, no Python exception"
    rest = [ln for ln in lines if ln]
    return rest[-1] if rest else "?"


def failure(proc: subprocess.CompletedProcess, out_json: str | None) -> dict:
    """A failed run's record: the exit code, the cause, and stderr's tail to read the rest. What
    the run wrote to out_json before it failed (examples/train_gpt.py records its steps before
    close()) is kept as partial_summary."""
    partial = None
    if out_json is not None and os.path.exists(out_json):
        try:
            with open(out_json) as f:
                partial = json.load(f)
        except (OSError, ValueError):
            partial = None  # cut off mid-write: the cause below says why
    if partial is None:
        what = ", no summary"
    elif partial.get("closed") is False:
        what = f", after its {len(partial.get('step_seconds', []))} steps (partial_summary)"
    else:
        what = ""
    record = {"error": f"exit {proc.returncode}{what}: {last_error(proc)}", "stderr_tail": proc.stderr[-3000:]}
    if partial is not None:
        record["partial_summary"] = partial
    return record


class JobTimedOut(Exception):
    """A job outlived its timeout; every process of it has been killed. Carries stderr so far."""

    def __init__(self, timeout: int, stderr: str):
        super().__init__(f"timed out after {timeout} s")
        self.record = {"error": f"timed out after {timeout} s (all of its processes killed)",
                       "stderr_tail": stderr[-3000:]}


def process_tree(root: int) -> list[int]:
    """root and every process below it (Linux /proc); children found before any is killed."""
    parent_of = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    # "pid (comm) state ppid ...": comm may hold spaces, so split after its ')'
                    parent_of[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue  # gone meanwhile
    tree, frontier = [root], [root]
    while frontier:
        frontier = [pid for pid, ppid in parent_of.items() if ppid in frontier]
        tree += frontier
    return tree


def launch(script: str, args: list[str], ranks: int, env: dict | None = None) -> tuple[list[str], dict]:
    """The command and environment that run `script` as `ranks` processes of this host. More than
    one runs under torchrun. One runs as the process itself with the environment torchrun gives a
    group of one (rank 0 of 1, a free port): the same run without a launcher process, whose own
    import of torch costs about a second and a half of CPU per job, and with the rank's exit
    status (a negative one where a signal ended it) as the job's."""
    env = dict(os.environ if env is None else env)
    port = str(free_port())
    if ranks == 1:
        env.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=port)
        return [sys.executable, "-u", script, *args], env
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "--master-port", port,
            script, *args], env


def run_job(cmd: list[str], timeout: int, env: dict | None = None) -> subprocess.CompletedProcess:
    """Runs cmd to completion. On timeout every process under it is killed: killing torchrun alone
    leaves its ranks running (it starts each in a session of its own), holding the GPUs' memory,
    so that every later run on those GPUs would run out of device memory."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO, env=env)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        for pid in process_tree(proc.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        out, err = proc.communicate()
        raise JobTimedOut(timeout, err) from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def peer_unavailable(name: str) -> str | None:
    """Why a DeepSpeed or ColossalAI row cannot run here, or None."""
    package = name.split("-")[0]
    if importlib.util.find_spec(package) is None:
        return f"{package} is not importable here"
    import torch
    if not torch.cuda.is_available():
        return f"{package} offload needs a CUDA device"
    return None


def run_system(script: str, extra: list[str], common: list[str], timeout: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out_json = os.path.join(tmp, "summary.json")
        cmd, env = launch(script, [*common, *extra, "--json-out", out_json,
                                   *(["--no-progress"] if script == GEMINI else [])], ranks=1)
        try:
            proc = run_job(cmd, timeout, env)
        except JobTimedOut as e:
            return e.record
        if proc.returncode != 0 or not os.path.exists(out_json):
            return failure(proc, out_json)
        with open(out_json) as f:
            return json.load(f)


def measure_rates(preset: str, batch: int, seq: int | None, checkpoint: bool, timeout: int) -> dict:
    code = RATES.replace("REPO", repr(REPO)).replace("ARGS", repr((preset, batch, seq, checkpoint)))
    try:
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout} s"}
    if proc.returncode != 0:
        return {"error": last_error(proc)}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def host_params_and_pcie(name: str, s: dict) -> tuple[int, float | None]:
    """(parameters the CPU steps, PCIe bytes per step or None when not measured)."""
    n = s["parameters"]
    if name.startswith("gemini"):
        # the last logged iteration (steady state: the first includes the initial placement)
        last_iteration = s["per_step"][-1]
        pcie = last_iteration["h2d_bytes"] + last_iteration["d2h_bytes"]
        last = s.get("last_optimizer_step") or {}
        return int(last.get("host_params", n)) + int(last.get("link_params", 0)), pcie
    if name in ("fsdp2-offload", "colossalai-static") or name.startswith("deepspeed"):
        return n, None  # every parameter stepped on the CPU; PCIe bytes not reported by these systems
    return 0, None


def add_derived(name: str, s: dict, rates: dict, fsdp2_tokens: float | None) -> dict:
    tokens_per_step = s["batch"] * s["seq_len"]
    row = dict(s)
    row["model_tflops"] = 6 * s["parameters"] * s["tokens_per_s"] / 1e12
    row["vs_fsdp2_offload"] = s["tokens_per_s"] / fsdp2_tokens if fsdp2_tokens else None
    host_params, pcie = host_params_and_pcie(name, s)
    row["pcie_bytes_per_param"] = pcie / s["parameters"] if pcie is not None else None
    parts = {}
    if "gpu_compute_s" in rates:
        parts["gpu"] = rates["gpu_compute_s"]
    if "cpu_adam_params_per_s" in rates:
        parts["cpu_adam"] = host_params / rates["cpu_adam_params_per_s"]
    if pcie is not None and "h2d_bytes_per_s" in rates:
        parts["pcie"] = pcie / min(rates["h2d_bytes_per_s"], rates["d2h_bytes_per_s"])
    row["bound_parts_s"] = parts
    if "gpu" in parts:
        bound = max(parts.values())
        row["bound_s"] = bound
        row["step_vs_bound"] = s["step_s_median"] / bound
    row["tokens_per_step"] = tokens_per_step
    return row


def ms(seconds):
    return None if seconds is None else seconds * 1e3


def fmt(v, spec: str, missing: str = "-") -> str:
    return missing if v is None else format(v, spec)


def write_outputs(out: str, header: str, rows: list[dict], rates: dict, args) -> str:
    lines = [header, "", "| system | tokens/s | model TFLOP/s | step ms | vs FSDP2 offload | step / bound | exposed "
             "optimizer ms | peak device GiB | peak host GiB | PCIe B/param | last loss |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "skipped" in r or "error" in r:
            why = "skipped: " + r["skipped"] if "skipped" in r else "failed: " + r["error"][:90]
            lines.append(f"| {r['name']} | {why} ||||||||||")
            continue
        lines.append(
            f"| {r['name']} | {r['tokens_per_s']:,.0f} | {r['model_tflops']:.1f} | {r['step_s_median'] * 1e3:.1f} | "
            f"{fmt(r['vs_fsdp2_offload'], '.2f')} | {fmt(r.get('step_vs_bound'), '.2f')} | "
            f"{fmt(ms(r.get('exposed_optimizer_s_median')), '.1f')} | "
            f"{r['peak_device_bytes_max_rank'] / 2**30:.2f} | {r['peak_host_rss_bytes_max_rank'] / 2**30:.2f} | "
            f"{fmt(r['pcie_bytes_per_param'], '.2f')} | {r['last_loss']:.4f} |")
    rate_line = ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in rates.items())
    lines += ["", f"Rates measured in this run: {rate_line}"]
    text = "\n".join(lines)
    if out:
        os.makedirs(os.path.dirname(os.path.abspath(out)) or ".", exist_ok=True)
        with open(out + ".md", "w") as f:
            f.write(text + "\n")
        with open(out + ".json", "w") as f:
            json.dump({"args": vars(args), "rates": rates, "rows": rows}, f, indent=2)
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        ok = [r for r in rows if "tokens_per_s" in r]
        fig, ax = plt.subplots(figsize=(max(4, 1.4 * len(ok)), 3.5))
        ax.bar([r["name"] for r in ok], [r["tokens_per_s"] for r in ok], color="#4c72b0")
        ax.set_ylabel("tokens/s")
        ax.set_title(header.split(",")[0], fontsize=9)
        ax.tick_params(axis="x", labelrotation=30, labelsize=8)
        fig.tight_layout()
        fig.savefig(out + ".png", dpi=120)
        plt.close(fig)
    return text


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="1.3b")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=None)
    p.add_argument("--budget", default=None, help="device-memory budget, e.g. 16GiB (default: the whole device)")
    p.add_argument("--max-norm", type=float, default=1.0, help="gradient clipping in every system (0: off)")
    p.add_argument("--optim", choices=OPTIMIZERS, default="adamw",
                   help="the optimizer of every system (gemini_ext/models/optimizers.py); deepspeed and colossalai "
                        "rows support adamw only")
    p.add_argument("--checkpoint", action="store_true", help="activation checkpointing in every system")
    p.add_argument("--init-device", choices=["cpu", "cuda"], default=None,
                   help="where plain PyTorch, FSDP2 and gemini_ext build the model (default: the host; on the GPU a "
                        "6.7B model is built in seconds, on the host torch's initialisation takes minutes)")
    p.add_argument("--only", default=None, help="comma-separated subset of: " + ", ".join(systems(None)))
    p.add_argument("--timeout", type=int, default=900, help="seconds per system")
    p.add_argument("--out", default=None, help="path prefix for .md, .json and .png")
    p.add_argument("--smoke", action="store_true", help="gpt-tiny: gemini_ext on sim, the peers on the CPU")
    p.add_argument("--peer-stubs", default=None, help="import-only stand-ins for ColossalAI (see peers_train.py)")
    args = p.parse_args(argv)
    names = list(systems(None))
    if args.smoke:
        args.preset, args.steps, args.batch, args.seq, args.budget = "tiny", 3, 2, 16, None
        names = ["plain", "gemini-static", "gemini-serial", "gemini-auto"]
    if args.only:
        names = [n.strip() for n in args.only.split(",")]
        unknown = set(names) - set(systems(None))
        if unknown:
            p.error(f"--only: unknown systems {sorted(unknown)}; choose from {list(systems(None))}")
    common = ["--preset", args.preset, "--steps", str(args.steps), "--batch", str(args.batch),
              "--max-norm", str(args.max_norm)]
    if args.optim != "adamw":
        others = [n for n in names if systems(None)[n][0] == OTHER_PEERS]
        if others:
            p.error(f"--optim {args.optim}: {others} train with AdamW only; pick systems with --only")
        common += ["--optim", args.optim]
    if args.seq:
        common += ["--seq", str(args.seq)]
    if args.checkpoint:
        common.append("--checkpoint")
    rates = measure_rates(args.preset, args.batch, args.seq, args.checkpoint, args.timeout)
    print(f"rates: {rates}", flush=True)
    results = []
    for name in names:
        script, extra = systems(args.budget)[name]
        if args.smoke and script == GEMINI:
            extra = extra + ["--device", "sim"]
        if args.init_device and script in (GEMINI, PEER):
            extra = extra + ["--init-device", args.init_device]
        if script == OTHER_PEERS and args.peer_stubs:
            extra = extra + ["--stubs", os.path.abspath(args.peer_stubs)]
        why_not = peer_unavailable(name) if script == OTHER_PEERS else None
        s = {"skipped": why_not} if why_not else run_system(script, extra, common, args.timeout)
        results.append((name, s))
        print(f"{name}: " + (s.get("error") or s.get("skipped") or f"{s['tokens_per_s']:,.0f} tokens/s"), flush=True)
    fsdp2 = next((s["tokens_per_s"] for n, s in results if n == "fsdp2-offload" and "tokens_per_s" in s), None)
    rows = []
    for name, s in results:
        rows.append({"name": name, **(add_derived(name, s, rates, fsdp2) if "tokens_per_s" in s else s)})
    header = (f"gpt-{args.preset}, {args.batch} x {args.seq or 'max'} tokens, budget {args.budget or 'whole device'}, "
              f"clipping {args.max_norm or 'off'}" + (", activation checkpointing" if args.checkpoint else "") +
              f", {args.steps} steps (median after the first)")
    print()
    print(write_outputs(args.out, header, rows, rates, args))
    return rows


if __name__ == "__main__":
    main()
