"""Point labels on a matplotlib axes, placed so that no two overlap.

Each label tries offsets around its point, nearest first (right, left, above, below, the diagonals, then
rings further out), and takes the first whose box meets no label placed before it and no point's
marker and stays inside the figure; a label moved away from its point gets a thin line to it. Points
that coincide (two codecs of the same bytes and score) get labels apart instead of printed over each
other.
Call it after the figure's layout is final (`tight_layout`): boxes are measured in display pixels.
"""

from __future__ import annotations

import math

RINGS = (4, 12, 22, 34, 48, 64, 82, 104)  # offsets from the point, in points
ANGLES = (0, 180, 90, -90, 30, -30, 150, -150, 60, -60, 120, -120)  # degrees, nearest-looking first
NEAR = 12  # a label further out than this gets a line to its point
MARK = 4  # half the side of a point's marker, in pixels


def candidates():
    for r in RINGS:
        for a in ANGLES:
            yield r * math.cos(math.radians(a)), r * math.sin(math.radians(a)) * 0.6


def place_labels(ax, points: list[tuple[float, float, str]], fontsize: float = 7) -> list:
    """Annotate each `(x, y, label)` in data coordinates; returns the annotations (none overlapping when
    some offset allows it; otherwise the nearest spot)."""
    from matplotlib.text import Text  # matplotlib loads only where a plot is drawn
    from matplotlib.transforms import Bbox  # (likewise)

    fig = ax.figure
    renderer = fig.canvas.get_renderer()
    inside = fig.bbox.padded(-2)
    marks = [Bbox.from_bounds(px - MARK, py - MARK, 2 * MARK, 2 * MARK)
             for px, py in (ax.transData.transform((x, y)) for x, y, _ in points)]
    placed, texts = list(marks), []  # a label covers no other label and no point
    for x, y, label in sorted(points, key=lambda p: (p[0], -p[1], p[2])):
        for dx, dy in candidates():
            far = math.hypot(dx, dy) > NEAR
            t = ax.annotate(label, (x, y), xytext=(dx, dy), textcoords="offset points", fontsize=fontsize,
                            ha="left" if dx > 1e-9 else "right" if dx < -1e-9 else "center", va="center",
                            annotation_clip=False,
                            arrowprops=dict(arrowstyle="-", lw=0.4, color="0.55", shrinkA=0, shrinkB=2)
                            if far else None)
            t.update_positions(renderer)  # where the offset puts it (else it is measured at the point)
            box = Text.get_window_extent(t, renderer).padded(1)
            fits = inside.contains(box.x0, box.y0) and inside.contains(box.x1, box.y1)
            if fits and not any(box.overlaps(b) for b in placed):
                break
            t.remove()
        else:  # nowhere free: the nearest spot, said as it is
            t = ax.annotate(label, (x, y), xytext=(4, 0), textcoords="offset points", fontsize=fontsize,
                            va="center")
            t.update_positions(renderer)
            box = Text.get_window_extent(t, renderer).padded(1)
        placed.append(box)
        texts.append(t)
    return texts
