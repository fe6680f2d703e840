"""Draw a resume audit: one scalar (loss) over steps, one colour per attempt, resumes marked.

matplotlib is an optional extra (``pip install 'ckptsdk[plot]'``), imported only when a plot is
drawn, and only through its object API with the Agg canvas (no pyplot, no global state, no
display needed). Reading the run log belongs in ``record.py``, judging it in ``audit.py``.
"""

from __future__ import annotations

import logging
import math
import os
from typing import Any

from ckptsdk.backends.base import Backend
from ckptsdk.errors import ConfigError, MissingDependencyError
from ckptsdk.runlog.audit import AuditReport, audit

logger = logging.getLogger(__name__)

__all__ = ["plot_audit"]


def _import_matplotlib() -> tuple[Any, Any]:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise MissingDependencyError(
            "drawing the audit plot needs matplotlib, which is not installed; "
            "install it with: pip install 'ckptsdk[plot]'",
            extra="plot",
        ) from exc
    return Figure, FigureCanvasAgg


def plot_audit(
    source: AuditReport | Backend, path: str | os.PathLike[str], *, scalar: str = "loss", dpi: int = 110
) -> str:
    """Plot ``scalar`` over steps, coloured by attempt, with each resume point marked.

    Args:
        source: a backend (its run log is audited first) or an :class:`AuditReport` made in this
            process (a report parsed back from JSON has no step series; pass the backend then).
        path: the PNG file to write (local path); written to a temp name, then renamed.
        scalar: which logged scalar to draw; falls back to the first one logged if absent.
        dpi: resolution.

    Returns:
        The path written.

    Raises:
        MissingDependencyError: matplotlib is not installed (``extra == "plot"``).
        ConfigError: the report carries no step series, or nothing was logged.

    Example:
        >>> from ckptsdk.backends import open_backend
        >>> plot_audit(open_backend("gs://bucket/run1"), "audit.png")  # doctest: +SKIP
        'audit.png'
    """
    Figure, FigureCanvasAgg = _import_matplotlib()
    report = source if isinstance(source, AuditReport) else audit(source, series=True)
    if not report.series:
        if report.attempts and any(a.steps for a in report.attempts):
            raise ConfigError(
                "this audit report has no step series (read back from JSON, or made without "
                "audit(..., series=True)); pass the backend to plot_audit instead"
            )
        raise ConfigError(f"nothing to plot: no steps were logged under {report.url or 'this root'}/runlog/")
    logged = sorted({n for rows in report.series.values() for _, vals in rows for n in vals})
    if scalar not in logged:
        if not logged:
            raise ConfigError(f"nothing to plot: no scalars were logged under {report.url}/runlog/")
        logger.info("plot_audit: no %r logged; drawing %r instead", scalar, logged[0])
        scalar = logged[0]

    fig = Figure(figsize=(9, 4.8), dpi=dpi)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    colors = [f"C{i % 10}" for i in range(len(report.series))]
    summaries = {a.attempt: a for a in report.attempts}
    for i, (color, (attempt, rows)) in enumerate(zip(colors, sorted(report.series.items()), strict=True)):
        pts = [(s, v[scalar]) for s, v in rows if scalar in v]
        if not pts:
            continue
        steps = [s for s, _ in pts]
        # Non-finite points cannot be drawn; show them as gaps plus a red cross on the axis.
        vals = [v if math.isfinite(v) else math.nan for _, v in pts]
        # Later attempts drawn thinner on top, so a bit-exact overlap shows both colours.
        width = max(0.8, 2.8 - 0.9 * i)
        ax.plot(steps, vals, color=color, linewidth=width, alpha=0.9, label=f"attempt {attempt}")
        bad = [s for s, v in pts if not math.isfinite(v)]
        if bad:
            ax.plot(bad, [0.0] * len(bad), "x", color="red", markersize=5)
        resumed = summaries[attempt].resumed_from_step if attempt in summaries else None
        if resumed is not None:
            ax.axvline(resumed, color=color, linestyle="--", linewidth=1.0)
            ax.annotate(
                f"attempt {attempt} resumes\nfrom step {resumed}",
                xy=(resumed, 1.0),
                xycoords=("data", "axes fraction"),
                xytext=(4, -4),
                textcoords="offset points",
                va="top",
                fontsize=8,
                color=color,
            )
    for ov in report.overlaps:
        ax.axvspan(ov.first_step, ov.last_step, color="0.85", alpha=0.5, zorder=0)
    if report.diverged_at is not None:
        ax.axvline(report.diverged_at, color="red", linewidth=1.2)
    diff = report.scalars.get(scalar)
    suffix = f", max |diff| {diff.max_abs_diff:.3g} over {diff.compared_steps} shared steps" if diff else ""
    ax.set_title(f"{scalar} by attempt: {report.verdict}{suffix}", fontsize=10)
    ax.set_xlabel("step")
    ax.set_ylabel(scalar)
    ax.grid(True, alpha=0.3)
    ax.legend(loc="best", fontsize=8)
    fig.tight_layout()

    path = os.fspath(path)
    tmp = os.path.join(os.path.dirname(os.path.abspath(path)), f".ckptsdk-tmp.{os.getpid()}.{os.path.basename(path)}")
    try:
        fig.savefig(tmp, format="png")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path
