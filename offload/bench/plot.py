"""A PNG of whatever a bench result holds: one panel per benchmark (matplotlib, no display needed)."""
from __future__ import annotations


def plot_results(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [k for k in ("pcie", "memcpy", "adam", "nvme") if k in result and result[k].get("available", True)]
    fig, axes = plt.subplots(1, max(1, len(panels)), figsize=(5 * max(1, len(panels)), 4), squeeze=False)
    for ax, key in zip(axes[0], panels):
        r = result[key]
        if key == "memcpy":
            for memory in sorted({row["memory"] for row in r["rows"]}):
                for size in sorted({row["bytes"] for row in r["rows"]}):
                    rows = [x for x in r["rows"] if x["memory"] == memory and x["bytes"] == size and x["impl"] == "offload"]
                    ax.plot([x["threads"] for x in rows], [x["GBps"] for x in rows], marker="o",
                            label=f"{memory} {size >> 20} MiB")
            ax.set_xlabel("kernel threads")
            ax.set_ylabel("GB/s copied")
        elif key == "pcie":
            for pinned in (True, False):
                rows = [x for x in r["rows"] if x["pinned"] == pinned and x["gpu"] == 0]
                ax.semilogx([x["bytes"] for x in rows], [x["h2d_GBps"] for x in rows], marker="o",
                            label=f"h2d {'pinned' if pinned else 'pageable'}")
                ax.semilogx([x["bytes"] for x in rows], [x["d2h_GBps"] for x in rows], marker="x",
                            label=f"d2h {'pinned' if pinned else 'pageable'}")
            ax.set_xlabel("bytes")
            ax.set_ylabel("GB/s")
        elif key == "adam":
            ax.bar(["offload fused", "torch fused"], [r["offload_params_per_s"] / 1e9, r["torch_fused_params_per_s"] / 1e9])
            ax.set_ylabel("G params / s")
        elif key == "nvme":
            rows = r.get("sweep", [])
            for op in ("read", "write"):
                for qd in sorted({x["queue_depth"] for x in rows if x["op"] == op}):
                    pts = sorted((x["block_size"], x["engine_gbps"]) for x in rows
                                 if x["op"] == op and x["queue_depth"] == qd)
                    ax.semilogx([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{op} qd {qd}")
            ax.set_xlabel("block bytes")
            ax.set_ylabel("GB/s")
        ax.set_title(key)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
