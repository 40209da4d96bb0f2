"""How every PNG this project writes looks: one colour per backend, and a footer that says
what the plot shows.

A plot is read on its own, pasted into a chat or a slide, far from the JSON it came from. So
each PNG that `python -m moe_comm report` and the benchmarks write carries, in its footer, the
recipe(s), the hardware, the date and the backend options of what it plots; and a backend has
the same colour in every plot (its class's `color`, from matplotlib's tab10 so the rest of a
figure matches), so plots of one report read together.
"""

import textwrap
import zlib

# Series plotted beside the backends that are not one (experiments/bench_comm.py's torch
# symmetric-memory all-to-all), and the colour of any other name.
OTHER_SERIES = {"torch_symm": "#9467bd"}
OTHER_COLOR = "#7f7f7f"
# A backend whose class names no colour gets one of these, by its name (the same in every plot).
SPARE_COLORS = ("#ff7f0e", "#8c564b", "#e377c2", "#bcbd22", "#17becf")
# Runs of one backend that differ in something else (recipe, shape, SM budget) keep the
# backend's colour and differ in line style and marker.
LINE_STYLES = ("-", "--", ":", "-.")
MARKERS = ("o", "s", "^", "D")

FOOTER_FONT_SIZE = 7


def backend_color(backend: str) -> str:
    from moe_comm.backends import backend_class, names

    if backend not in names():
        return OTHER_SERIES.get(backend, OTHER_COLOR)
    return backend_class(backend).color or SPARE_COLORS[zlib.crc32(backend.encode()) % len(SPARE_COLORS)]


def save(fig, path, footer: list[str], top_in: float = 0.0) -> None:
    """Footer under the plot (`add_footer`), then the PNG, with the same lines in its
    "Description" text chunk so tools (and tests) can read what the plot shows."""
    add_footer(fig, footer, top_in)
    fig.savefig(path, dpi=120, metadata={"Description": "\n".join(footer)})


def add_footer(fig, lines: list[str], top_in: float = 0.0) -> None:
    """Lay the figure out and put `lines` under it, growing the figure so the axes keep
    their size. Long lines wrap at the figure's width. `top_in` inches stay free above the
    axes for a figure-wide title and legend, which the caller places there."""
    width_chars = int(fig.get_figwidth() * 72 / (FOOTER_FONT_SIZE * 0.66))
    wrapped = [part for line in lines for part in textwrap.wrap(line, width_chars, subsequent_indent="  ")]
    footer_in = (len(wrapped) * FOOTER_FONT_SIZE * 1.35 + 8) / 72
    height_in = fig.get_figheight() + footer_in + top_in
    fig.set_figheight(height_in)
    fig.tight_layout(rect=(0, footer_in / height_in, 1, 1 - top_in / height_in))
    fig.text(0.01, 4 / 72 / height_in, "\n".join(wrapped), fontsize=FOOTER_FONT_SIZE,
             ha="left", va="bottom", color="0.25", linespacing=1.35)
