"""PNG plots (matplotlib, Agg backend): acceptance by category and ReDrafter shape; latency and
throughput versus load per decoding mode."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def plot_acceptance(acceptance: dict, path: Path) -> Path:
    """Grouped bars: mean tokens per step per category, one bar per ``num_beams x draft_len`` shape."""
    shapes = acceptance["shapes"]
    categories = sorted({c for s in shapes for c in s["by_category"]})
    width = 0.8 / max(1, len(shapes))
    fig, ax = plt.subplots(figsize=(max(5, 1.2 * len(categories) + 2), 3.5))
    for i, shape in enumerate(shapes):
        values = [shape["by_category"].get(c, {}).get("tokens_per_step") or 0 for c in categories]
        ax.bar([x + i * width for x in range(len(categories))], values, width,
               label=f"{shape['num_beams']}x{shape['draft_len_per_beam']}")
    ax.set_xticks([x + width * (len(shapes) - 1) / 2 for x in range(len(categories))], categories)
    ax.set_ylabel("tokens per step")
    ax.set_title("ReDrafter acceptance by category (num_beams x draft_len_per_beam)")
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_load(staged: dict, path: Path) -> Path:
    """Three panels versus closed-loop concurrency: median TPOT (ms), p99 TTFT (ms), output tokens/s."""
    levels = staged["levels"]
    panels = (("TPOT p50 (ms)", lambda s: s["tpot_ms"]["p50"]), ("TTFT p99 (ms)", lambda s: s["ttft_ms"]["p99"]),
              ("output tokens/s", lambda s: s["output_throughput"]))
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.5))
    for ax, (label, get) in zip(axes, panels):
        for mode, summaries in staged["closed_loop"].items():
            ax.plot(levels, [get(s) for s in summaries], marker="o", label=mode)
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels, [str(level) for level in levels])
        ax.set_xlabel("concurrency")
        ax.set_ylabel(label)
        ax.legend(fontsize="small")
    fig.suptitle("latency and throughput versus load")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
