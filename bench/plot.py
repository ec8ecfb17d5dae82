"""One PNG comparing the mechanisms: recovery per fault, goodput, and the checkpoint stall."""
from __future__ import annotations

import textwrap
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from bench.checks import REFERENCE_RECOVERY_S
from bench.mechanisms import MECHANISMS
from bench.results import BenchResult


def plot_result(r: BenchResult, path: Path) -> Path:
    rows = len(_mechanisms(r))  # the recovery and goodput panels: one row per mechanism, labels on the left
    fig = Figure(figsize=(20, max(5.5, 0.42 * rows + 2)), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)  # a bare Figure on Agg: no pyplot state, no display
    recovery, goodput, stall = fig.subplots(1, 3, width_ratios=(1.5, 1.1, 1))
    _recovery(recovery, r)
    _goodput(goodput, r)
    _stall(stall, r)
    fig.suptitle(f"Bench {r.date} ({r.profile.name}, {r.machine.device}): every figure measured in this run")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    return path


def _mechanisms(r: BenchResult, with_reference: bool = False) -> list[tuple[str, str]]:
    out = []
    for m in MECHANISMS:
        if m.name not in r.profile.mechanisms:
            continue
        label = textwrap.shorten(m.label, 48, placeholder="…")
        if with_reference and m.name in REFERENCE_RECOVERY_S:
            label += f" (reference ~{REFERENCE_RECOVERY_S[m.name]:g} s)"
        out.append((m.name, label))
    return out


def _rows(ax, names: list[tuple[str, str]]) -> None:
    """One row per mechanism, the first at the top."""
    ax.set_yticks(range(len(names)), [label for _, label in names], fontsize="small")
    ax.set_ylim(len(names) - 0.5, -0.5)


def _recovery(ax, r: BenchResult) -> None:
    names = _mechanisms(r, with_reference=True)
    for y, (name, _) in enumerate(names):
        res = r.recovery.get(name)
        if res is None:
            ax.text(1, y, "not available (see table)", va="center", color="tab:gray", fontsize="small")
            continue
        ax.barh(y, res.median_recovery_s, color="tab:blue", alpha=0.7, label="median recovery (measured)")
        per_fault = [f["recovery_s"] for f in res.per_fault if f["recovery_s"] is not None]
        ax.plot(per_fault, [y] * len(per_fault), "o", color="black", ms=4, label="each fault")
        ax.text(max(res.median_recovery_s, *per_fault) * 1.08, y, f"{res.median_recovery_s:.1f} s", va="center",
                weight="bold", fontsize="small")
    if r.floor is not None:
        ax.axvline(r.floor.median_s, color="tab:green", ls="--",
                   label=f"floor: fresh Python + torch + group, {r.floor.median_s:.1f} s")
    _rows(ax, names)
    ax.set_xscale("log")  # a slow fault beside the one-second ones
    ax.margins(x=0.15)
    ax.set_xlabel("fault -> next completed step (s, log scale)")
    ax.set_title(f"Recovery per fault ({r.profile.faults} faults each)")
    _legend(ax)


def _goodput(ax, r: BenchResult) -> None:
    names = _mechanisms(r)
    height = 0.38
    for y, (name, _) in enumerate(names):
        res = r.recovery.get(name)
        if res is None:
            continue
        for dy, value, colour, label in ((-height / 2, res.training_goodput, "tab:blue", "training goodput"),
                                         (height / 2, res.infra_goodput, "tab:orange", "infra goodput")):
            ax.barh(y + dy, value, height, color=colour, label=label)
            ax.text(value + 0.01, y + dy, f"{value:.0%}", va="center", fontsize="x-small")
    _rows(ax, names)
    ax.tick_params(axis="y", labelleft=False)  # the recovery panel beside it names the rows
    ax.set_xlim(0, 1)
    ax.xaxis.set_major_formatter(lambda v, _: f"{v:.0%}")
    ax.set_title(f"Goodput over a run with {r.profile.faults} faults")
    _legend(ax)


def _stall(ax, r: BenchResult) -> None:
    s = r.checkpoint
    if s is None:
        ax.text(0.5, 0.5, "checkpoint stall\nnot measured", ha="center", va="center", transform=ax.transAxes)
        ax.set_axis_off()
        return
    bars = [("sync", s.sync_blocking_s, s.efficiency_sync, "tab:red"),
            ("async", s.async_blocking_s, s.efficiency_async, "tab:green")]
    spare = r.checkpoint_spare_cpu
    if spare is not None:
        where = f"{spare.world_size} rank(s),\n{spare.state_bytes / 2**20:.0f} MiB,\na CPU spare"
        bars += [(f"sync,\n{where}", spare.sync_blocking_s, spare.efficiency_sync, "lightcoral"),
                 (f"async,\n{where}", spare.async_blocking_s, spare.efficiency_async, "lightgreen")]
    for x, (_, blocking, efficiency, color) in enumerate(bars):
        ax.bar(x, blocking, color=color)
        ax.text(x, blocking, f"{blocking:.2f} s\nefficiency {efficiency:.0%}", ha="center", va="bottom",
                fontsize="small")
    ax.set_xticks(range(len(bars)), [label for label, *_ in bars], fontsize="small")
    ax.set_ylabel("training blocked per save (s)")
    ax.set_title(f"Checkpoint stall: {s.state_bytes / 2**20:.0f} MiB over {s.world_size} ranks\n"
                 f"async/sync blocking = {s.blocking_ratio:.2f}")
    ax.margins(y=0.25)


def _legend(ax) -> None:
    handles, labels = ax.get_legend_handles_labels()
    by_label = dict(zip(labels, handles))
    if by_label:
        ax.legend(by_label.values(), by_label.keys(), fontsize="small", loc="upper center",
                  bbox_to_anchor=(0.5, -0.08), ncols=3)
