"""Chrome trace JSON (offload.telemetry.save_trace, or bench_offload_step.py --trace) -> PNG timeline.

One row per lane ("tid"), one bar per complete event ("ph": "X", "ts"/"dur" in microseconds), colored by
the event's kind (the part of its name before ':'; an I/O named by its shard takes its lane's name), the
longest events labelled. Gaps in the "main" row are the training thread computing.

    python benchmarks/plot_trace.py trace.json out.png [--labels 12]
"""
from __future__ import annotations

import argparse
import json

LANE_ORDER = ["main", "gather", "reduce", "optimizer", "nvme read", "nvme write", "copy"]


def load_events(path: str) -> list[dict]:
    with open(path) as f:
        doc = json.load(f)
    events = doc["traceEvents"] if isinstance(doc, dict) else doc
    return [e for e in events if e.get("ph") == "X" and "dur" in e]


def _kind(e: dict) -> str:
    name = e["name"]
    return name.split(":")[0] if ":" in name else str(e["tid"])


def plot(events: list[dict], out: str, labels: int = 12, title: str | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not events:
        raise SystemExit("no complete ('ph': 'X') events in the trace")
    lanes = sorted({str(e["tid"]) for e in events},
                   key=lambda t: (LANE_ORDER.index(t) if t in LANE_ORDER else len(LANE_ORDER), t))
    row = {lane: i for i, lane in enumerate(lanes)}
    t0 = min(e["ts"] for e in events)
    kinds = sorted({_kind(e) for e in events})
    cmap = plt.get_cmap("tab20")
    color = {k: cmap(i % 20) for i, k in enumerate(kinds)}

    fig, ax = plt.subplots(figsize=(14, 1.0 + 0.6 * len(lanes)))
    for e in events:
        start, dur = (e["ts"] - t0) / 1e3, e["dur"] / 1e3  # ms
        ax.barh(row[str(e["tid"])], dur, left=start, height=0.7, color=color[_kind(e)],
                edgecolor="black", linewidth=0.2)
    for e in sorted(events, key=lambda e: -e["dur"])[:labels]:  # the longest events get their names
        start, dur = (e["ts"] - t0) / 1e3, e["dur"] / 1e3
        ax.text(start + dur / 2, row[str(e["tid"])], e["name"], ha="center", va="center", fontsize=6,
                clip_on=True)
    ax.set_yticks(range(len(lanes)), lanes)
    ax.invert_yaxis()
    ax.set_xlabel("ms since the first event")
    span = max(e["ts"] + e["dur"] for e in events) - t0
    ax.set_title(title or f"{len(events)} events over {span / 1e3:.1f} ms")
    handles = [plt.Rectangle((0, 0), 1, 1, color=color[k]) for k in kinds]
    ax.legend(handles, kinds, loc="upper center", bbox_to_anchor=(0.5, -0.12 - 0.02 * len(lanes)),
              ncol=min(len(kinds), 8), fontsize=7, frameon=False)
    fig.tight_layout()
    fig.savefig(out, dpi=150)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace")
    ap.add_argument("out")
    ap.add_argument("--labels", type=int, default=12, help="label the N longest events")
    ap.add_argument("--title", default=None)
    args = ap.parse_args(argv)
    events = load_events(args.trace)
    plot(events, args.out, args.labels, args.title)
    print(f"{args.out}: {len(events)} events on {len({e['tid'] for e in events})} lanes")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
