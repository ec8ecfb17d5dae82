"""Timeline picture of a run: step number over wall time, attempts, faults, recoveries, checkpoint saves."""
from __future__ import annotations

import io
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from training.contract.files import replace_file
from training.report.goodput import Fault, GoodputReport, Timeline

MAX_MARKED_STEPS = 300  # markers on every step only while they stay distinguishable
MAX_LISTED_FAULTS = 12  # the caption lists these; report.json has all
# Red and orange mark faults, cyan checkpoint saves: attempts take the other tab10 colours.
ATTEMPT_COLOURS = ("tab:blue", "tab:green", "tab:purple", "tab:brown", "tab:pink", "tab:olive", "tab:gray")


def plot_timeline(timeline: Timeline, report: GoodputReport, path: Path) -> Path:
    captions = [_caption(i, f) for i, f in enumerate(timeline.faults[:MAX_LISTED_FAULTS], 1)]
    if len(timeline.faults) > MAX_LISTED_FAULTS:
        captions.append(f"... and {len(timeline.faults) - MAX_LISTED_FAULTS} more in report.json")
    caption_in = 0.2 * (len(captions) + 1)
    # A bare Figure on the Agg canvas: no pyplot global state, no display needed.
    fig = Figure(figsize=(12, 6.5 + caption_in), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    ax, below = fig.subplots(2, 1, height_ratios=(6.5, caption_in))
    below.axis("off")
    below.text(0, 1, "\n".join(captions) or "no faults", va="top", family="monospace", fontsize="small")
    _steps(ax, timeline)
    _saves(ax, timeline)
    _faults(ax, timeline)
    ax.set_xlim(0, timeline.wall_s or 1.0)
    ax.set_ylim(bottom=0)
    ax.set_xlabel("wall time since run start (s)")
    ax.set_ylabel("optimizer step completed")
    ax.grid(alpha=0.3)
    ax.set_title(f"Run timeline ({report.status}): training goodput {report.training_goodput:.1%}, "
                 f"infra goodput {report.infra_goodput:.1%}, {len(report.faults)} fault(s), "
                 f"{report.attempts} attempt(s)", pad=16)
    # Every span and line is labelled; the legend shows each label once.
    handles, labels = ax.get_legend_handles_labels()
    by_label = dict(zip(labels, handles))
    ax.legend(by_label.values(), by_label.keys(), loc="upper left", fontsize="small")
    path.parent.mkdir(parents=True, exist_ok=True)
    picture = io.BytesIO()
    fig.savefig(picture, format="png")
    replace_file(path, picture.getvalue())
    return path


def _steps(ax, tl: Timeline) -> None:
    kinds = {a.number: a.restart_kind for a in tl.attempts}
    marker = "." if len(tl.runs) <= MAX_MARKED_STEPS else None
    for i, number in enumerate(sorted({r.attempt for r in tl.runs})):
        runs = [r for r in tl.runs if r.attempt == number]
        ax.plot([r.end_s for r in runs], [r.step for r in runs], color=ATTEMPT_COLOURS[i % len(ATTEMPT_COLOURS)],
                marker=marker, lw=1.5, label=f"attempt {number} ({kinds.get(number, 'fresh')})")
    lost = [r for r in tl.runs if not r.useful]
    if lost:
        ax.scatter([r.end_s for r in lost], [r.step for r in lost], marker="x", color="black", s=22,
                   zorder=3, label=f"lost step (rolled back): {len(lost)}")


def _saves(ax, tl: Timeline) -> None:
    for s in tl.saves:
        ax.axvspan(s.start_s, s.end_s, color="tab:cyan", alpha=0.35, lw=0, label="checkpoint save: training blocked")
    # Short saves are a pixel wide: a tick under each keeps them visible.
    ax.plot([s.end_s for s in tl.saves], [0] * len(tl.saves), "^", color="tab:cyan", ms=7, clip_on=False)


def _faults(ax, tl: Timeline) -> None:
    top = ax.get_xaxis_transform()  # x in data, y in axes fraction
    for i, f in enumerate(tl.faults, 1):
        ax.axvline(f.at_s, color="tab:red", lw=1.5, label="fault (#: see below)")
        # A short tag over the axes: the details go in the caption, where they cannot hide the steps.
        ax.text(f.at_s, 1.0, f"#{i}", transform=top, ha="center", va="bottom", color="tab:red", weight="bold")
        if f.detection_s is not None:
            ax.axvline(f.at_s + f.detection_s, color="tab:orange", ls=":", lw=1.5, label="fault detected")
        if f.recovery_s is not None:
            ax.axvspan(f.at_s, f.at_s + f.recovery_s, color="tab:red", alpha=0.12, lw=0,
                       label="recovery (fault to next step)")


def _caption(i: int, f: Fault) -> str:
    if f.detection_s is not None:
        detected = f"detected after {f.detection_s:.1f} s ({f.detected_by})"
    else:
        detected = "detection time unknown" if f.detected_by else "not detected"
    outcome = (f"recovered in {f.recovery_s:.1f} s, {f.steps_lost} step(s) lost"
               if f.recovery_s is not None else "not recovered")
    where = f" on rank {f.rank}" if f.rank is not None else ""
    return (f"#{i:<2} {f.at_s:8.1f} s  {f.kind}{where}: {detected}, "
            f"{f.restart_kind or 'no'} restart, {outcome}")
