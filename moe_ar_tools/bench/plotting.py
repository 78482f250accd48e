"""The one plot of every world size: latency against tokens, log-log, a grid of panels with one line
per system, the roofline dotted (matplotlib, imported only when a plot is drawn). Each world size's
report lays out its panels (multi_gpu/summary.py, world_one/report.py)."""
from __future__ import annotations

import io
import pathlib
from dataclasses import dataclass, field
from typing import Optional


@dataclass
class Line:
    label: str
    points: list                  # (tokens, us per call)
    style: str = "-"
    width: float = 2.0


@dataclass
class Panel:
    title: str
    lines: list = field(default_factory=list)
    roofline: list = field(default_factory=list)   # (tokens, us), dotted
    roofline_label: str = "roofline"
    hline: Optional[tuple] = None                   # (us, label): a level drawn across, dash-dotted


def draw(grid: list, path: pathlib.Path, title: str, panel_size: tuple = (7.0, 4.2), title_size: int = 11) -> None:
    """grid: rows of Panels (a row may be shorter); one PNG at `path`."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    cols = max(len(row) for row in grid)
    fig, axes = plt.subplots(len(grid), cols, figsize=(panel_size[0] * cols, panel_size[1] * len(grid)),
                             squeeze=False)
    for i, row in enumerate(grid):
        for j, panel in enumerate(row):
            ax = axes[i][j]
            for line in panel.lines:
                pts = sorted(line.points)
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", markersize=3, linestyle=line.style,
                        linewidth=line.width, label=line.label)
            if panel.roofline:
                roof = sorted(panel.roofline)
                ax.plot([p[0] for p in roof], [p[1] for p in roof], "k:", label=panel.roofline_label)
            if panel.hline:
                ax.axhline(panel.hline[0], color="grey", linestyle="-.", linewidth=1, label=panel.hline[1])
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_title(panel.title, fontsize=10)
            ax.set_xlabel("tokens")
            ax.set_ylabel("us per call")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=title_size)
    fig.tight_layout()
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=110)
    plt.close(fig)
    # 256 colours (Pillow: matplotlib's own dependency): the lines look the same, the file is a third
    from PIL import Image
    Image.open(png).convert("RGB").quantize(256).save(path, format="PNG", optimize=True)
