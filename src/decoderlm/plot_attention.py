"""Attention heat-maps to a PNG (matplotlib, no display needed), for reports and papers.

One head: a T×T map of the weights query i (rows, top to bottom) gives key j (columns), the tokens
on both axes, as attention-visualisation tools draw them (Vig, 2019, BertViz). All heads of a
layer: a grid of such maps sharing one colour scale. Weights come from
`decoderlm.inference.attention_maps`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

from matplotlib.axes import Axes
from matplotlib.figure import Figure
from torch import Tensor

MAX_LABELS = 48  # tick labels per axis; longer sequences label every ⌈T / MAX_LABELS⌉-th token
CMAP = "viridis"  # perceptually uniform, readable in greyscale


def token_label(text: str) -> str:
    """A token as a tick label: spaces as '·', newlines and tabs escaped, never empty."""
    shown = text.replace(" ", "·").replace("\n", "\\n").replace("\t", "\\t")
    return shown or "∅"


def _draw(ax: Axes, weights: Tensor, labels: Sequence[str], title: str) -> object:
    """One map on ax; weights (T, T). Returns the image (for the colour bar)."""
    t = weights.shape[-1]
    image = ax.imshow(weights.float().numpy(), cmap=CMAP, vmin=0.0, vmax=1.0)
    step = math.ceil(t / MAX_LABELS)
    ticks = list(range(0, t, step))
    size = max(4.0, min(9.0, 360 / len(ticks)))
    ax.set_xticks(ticks, [labels[i] for i in ticks], rotation=90, fontsize=size)
    ax.set_yticks(ticks, [labels[i] for i in ticks], fontsize=size)
    ax.set_xlabel("key")
    ax.set_ylabel("query")
    ax.set_title(title, fontsize=10)
    return image


def plot_attention(
    weights: Tensor, tokens: Sequence[str], out: str | Path, layer: int, head: int | None = None
) -> Path:
    """Write the map of (layer, head), or a grid of all heads of `layer` if head is None.

    weights: (H, T, T), the layer's weights for one sequence; tokens: the T token texts.
    """
    out = Path(out)
    labels = [token_label(t) for t in tokens]
    heads = range(weights.shape[0]) if head is None else [head]
    cols = math.ceil(math.sqrt(len(heads)))
    rows = math.ceil(len(heads) / cols)
    side = max(4.0, min(12.0, 4.0 + len(tokens) / 12)) if head is not None else 4.0
    fig = Figure(figsize=(side * cols + 1, side * rows), layout="constrained")  # Agg canvas
    axes = fig.subplots(rows, cols, squeeze=False).ravel()
    for ax, h in zip(axes, heads, strict=False):
        image = _draw(ax, weights[h], labels, f"layer {layer}, head {h}")
    for ax in axes[len(heads) :]:
        ax.set_axis_off()
    fig.colorbar(image, ax=list(axes), label="attention weight", shrink=0.8)
    fig.savefig(out, dpi=150)
    return out
