"""The result's plot (matplotlib, imported only when a plot is drawn)."""
from __future__ import annotations

import pathlib

from moe_ar_tools.bench.config import BASELINES


def plot(result: dict, path: pathlib.Path) -> None:
    """Latency against tokens, log-log, one line per system, one subplot per shape and profile."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    recs = [r for r in result["records"] if r["valid"] and r["median_us"] is not None]
    panels = sorted({(r["hidden"], r["top_k"], r["shared"], r["profile"]) for r in result["records"]})
    if not panels:
        return
    profiles = sorted({p[3] for p in panels})
    shapes = sorted({p[:3] for p in panels}, key=lambda s: (-s[0], -s[1], not s[2]))
    fig, axes = plt.subplots(len(shapes), len(profiles), figsize=(7 * len(profiles), 4.2 * len(shapes)),
                             squeeze=False)
    for i, shape in enumerate(shapes):
        for j, profile in enumerate(profiles):
            ax = axes[i][j]
            mine = [r for r in recs if (r["hidden"], r["top_k"], r["shared"]) == shape and r["profile"] == profile]
            lines: dict = {}
            for r in mine:
                label = r["system"] + (f" ({r['variant']})" if r.get("variant") else "")
                lines.setdefault(label, []).append((r["tokens"], r["median_us"]))
            for label in sorted(lines, key=lambda s: (s != "auto", s not in BASELINES and "+" not in s, s)):
                pts = sorted(lines[label])
                forced = label != "auto" and "+" not in label
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", markersize=3,
                        linestyle="--" if forced else "-", linewidth=1 if forced else 2, label=label)
            roof = sorted({(r["tokens"], r["roofline_us"]) for r in result["records"]
                           if (r["hidden"], r["top_k"], r["shared"]) == shape and r["profile"] == profile
                           and r["system"] == "auto"})
            if roof:
                ax.plot([p[0] for p in roof], [p[1] for p in roof], "k:", label="roofline")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_title(f"H {shape[0]}, top_k {shape[1]}, {'shared' if shape[2] else 'no shared'}, "
                         f"profile {profile}", fontsize=10)
            ax.set_xlabel("tokens")
            ax.set_ylabel("us per call")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=7)
    fig.suptitle(f"{result['machine']} ({result['gpu']}, world {result['world_size']}, {result['dtype']}) "
                 f"{result['date']}", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
