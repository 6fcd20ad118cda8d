"""One step's lanes as a picture: torch.profiler's trace of a step drawn as one row per lane (matplotlib).

    python bench/timeline.py TRACE.json --out step.png   # a trace from torch.profiler's export_chrome_trace

Rows, from the trace's complete events: the caller's passes (the runner's `bench.forward`,
`bench.backward`, `bench.step` ranges), the GPU's kernels, each copy direction (the GPU's memcpy
events; on sim, the engine's `gx.move`/`gx.copy`/`gx.prefetch`/`gx.fetch` ranges), the CPU lane's and
the link lane's host steps (`gx.cpu ...`, `gx.link ...`: csrc/core/trace_ranges.h) and the caller's
waits (`gx.wait ...`). Each row's title gives its busy seconds (overlaps merged).
"""

from __future__ import annotations

import argparse
import json

# (row, test on a complete event), top to bottom
ROWS = (
    ("passes", lambda e: e["name"] in ("bench.forward", "bench.backward", "bench.step")),
    ("GPU kernels", lambda e: e.get("cat") == "kernel"),
    ("copies host to device", lambda e: (e.get("cat") == "gpu_memcpy" and "HtoD" in e["name"]) or (
        e["name"].startswith(("gx.fetch ", "gx.prefetch ")) or (
            e["name"].startswith(("gx.move ", "gx.copy ")) and e["name"].endswith(" device")))),
    ("copies device to host", lambda e: (e.get("cat") == "gpu_memcpy" and "DtoH" in e["name"]) or (
        e["name"].startswith(("gx.move ", "gx.copy ")) and not e["name"].endswith(" device"))),
    ("CPU lane: host steps", lambda e: e["name"].startswith("gx.cpu ")),
    ("link lane", lambda e: e["name"].startswith("gx.link ")),
    ("waits", lambda e: e["name"].startswith("gx.wait ")),
)
COLORS = ("#4c72b0", "#55a868", "#c44e52", "#dd8452", "#8172b3", "#937860", "#da8bc3")


def lanes(trace: dict) -> dict:
    """{row: [(start µs, duration µs), ...]} of the trace's complete events, from its first event."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e and "name" in e]
    rows = {name: [] for name, _ in ROWS}
    for e in events:
        for name, test in ROWS:
            if test(e):
                rows[name].append((float(e["ts"]), float(e["dur"])))
                break
    starts = [s for spans in rows.values() for s, _ in spans]
    origin = min(starts) if starts else 0.0
    return {name: sorted((s - origin, d) for s, d in spans) for name, spans in rows.items()}


def busy_seconds(spans: list) -> float:
    """The row's time covered by at least one span (overlaps merged)."""
    total, end = 0.0, None
    for s, d in sorted(spans):
        if end is None or s > end:
            total, end = total + d, s + d
        elif s + d > end:
            total, end = total + (s + d - end), s + d
    return total / 1e6


def draw(trace: dict, out: str, title: str = "one step's lanes") -> dict:
    """Writes the PNG and returns each row's busy seconds."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = {k: v for k, v in lanes(trace).items() if v}
    fig, ax = plt.subplots(figsize=(12, 0.6 * len(rows) + 1.2))
    labels, busy = [], {}
    for k, (name, spans) in enumerate(rows.items()):
        busy[name] = busy_seconds(spans)
        ax.broken_barh([(s / 1e3, max(d / 1e3, 0.01)) for s, d in spans], (k - 0.4, 0.8),
                       facecolors=COLORS[k % len(COLORS)])
        labels.append(f"{name} ({busy[name]:.3f} s)")
    ax.set_yticks(range(len(labels)), labels)
    ax.invert_yaxis()
    ax.set_xlabel("ms from the step's first event")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return busy


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace")
    p.add_argument("--out", required=True)
    p.add_argument("--title", default="one step's lanes")
    args = p.parse_args(argv)
    with open(args.trace) as f:
        busy = draw(json.load(f), args.out, args.title)
    for name, seconds in busy.items():
        print(f"{name:28s} {seconds:.3f} s busy")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
