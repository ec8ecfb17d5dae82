"""The bench result as Markdown: checkpoint stall, recovery and goodput per mechanism, checks."""
from __future__ import annotations

from bench.checks import REFERENCE_RECOVERY_S, Check
from bench.mechanisms import MECHANISMS, MechanismResult
from bench.profile import FULL, QUICK
from bench.projection import REFERENCE_PLAIN_RESTART_S
from bench.results import PEER, PEER_SIZES, ROLLBACK, SPARE_CPU, BenchResult
from bench.stall import CALIBRATED_SYNC_COST, StallResult


def _fmt(value: float | None, unit: str) -> str:
    if value is None:
        return "n/a"
    if unit == "%":
        return f"{value:.1%}"
    if unit == "x":
        return f"{value:.2f}x"
    if unit == "s":
        return f"{value:.2f} s"
    return f"{value:g} {unit}"


def _row(*cells: str) -> str:
    return "| " + " | ".join(cells) + " |"


def _header(*cells: str) -> list[str]:
    return [_row(*cells), _row(*("---" for _ in cells))]


def stall_table(r: BenchResult) -> list[str]:
    s = r.checkpoint
    if s is None:
        return [f"Checkpoint stall: not measured ({r.unavailable.get('checkpoint', 'unknown reason')})"]
    lines = _stall_section("Checkpoint stall", s, calibrated=r.profile.stall_interval is None)
    spare = r.checkpoint_spare_cpu
    spare_title = ("Checkpoint stall on one rank fewer, the same shard per rank, leaving a CPU spare for the "
                   "background writer as a GPU host's idle cores do")
    if spare is not None:
        alone = " (one rank: no all-reduce peer to wait for either)" if spare.world_size == 1 else ""
        lines += ["", *_stall_section(spare_title, spare, calibrated=True, ranks_note=alone)]
    elif SPARE_CPU in r.unavailable:
        lines += ["", f"{spare_title}: not measured ({r.unavailable[SPARE_CPU]})"]
    return lines


def _stall_section(title: str, s: StallResult, calibrated: bool, ranks_note: str = "") -> list[str]:
    return [
        f"{title}: {s.state_bytes / 2**20:.0f} MiB of state over {s.world_size} rank(s){ranks_note}, a save every "
        f"{s.interval_steps} steps"
        + (f" (calibrated: sync saves about {CALIBRATED_SYNC_COST:.0%} of the time, as in the reference)"
           if calibrated else "") + f", {s.steps} steps per pass"
        + (f"; the async writer's one-time start (its process, its staging buffers allocated; in training, in the "
           f"background from the first step on): {s.async_setup_s:.2f} s, before the first round and counted in no mode"
           if s.async_setup_s is not None else ""),
        "",
        *_header("mode", "blocking per save (median)", "per save", "CPU time per save: training rank",
                 "CPU time per save: writer process", "step wall time", "training efficiency"),
        _row("off", "-", "-", "-", "-", _fmt(s.step_wall_off_s, "s"), "100% (baseline)"),
        _row("sync", _fmt(s.sync_blocking_s, "s"), ", ".join(f"{v:.2f}" for v in s.sync_blocking_per_save_s),
             _fmt(s.cpu_per_save_sync_s, "s"), "- (the rank writes)", _fmt(s.step_wall_sync_s, "s"),
             _fmt(s.efficiency_sync, "%")),
        _row("async", _fmt(s.async_blocking_s, "s"), ", ".join(f"{v:.2f}" for v in s.async_blocking_per_save_s),
             _fmt(s.cpu_per_save_async_s, "s"), _fmt(s.writer_cpu_per_save_async_s, "s"), _fmt(s.step_wall_async_s, "s"),
             _fmt(s.efficiency_async, "%")),
    ]


def recovery_table(r: BenchResult) -> list[str]:
    floor = f"{r.floor.median_s:.2f} s (world {r.floor.world_size})" if r.floor else "not measured"
    lines = [f"Recovery and goodput per mechanism: one run each, {r.profile.faults} deterministic faults, medians "
             f"over the faults; floor of this machine (fresh Python + import torch + join group): {floor}", "",
             *_header("mechanism", "faults recovered", "detection", "recovery", "reference recovery",
                      "steps lost (median/max)", "time lost", "other groups' stall (median/max)", "training goodput",
                      "infra goodput", "wall")]
    for m in MECHANISMS:
        if m.name not in r.profile.mechanisms:
            continue
        ref = REFERENCE_RECOVERY_S.get(m.name)
        ref_text = f"~{ref:g} s" if ref is not None else "-"
        res = r.recovery.get(m.name)
        if res is None:
            lines.append(_row(m.label, f"not available: {r.unavailable.get(m.name, 'not run')}", "", "", ref_text,
                              "", "", "", "", "", ""))
            continue
        lines.append(_row(m.label, f"{res.recovered}/{res.faults}", _fmt(res.median_detection_s, "s"),
                          _fmt(res.median_recovery_s, "s"), ref_text,
                          f"{res.median_steps_lost:g}/{res.max_steps_lost}", _fmt(res.median_time_lost_s, "s"),
                          _survivor_stall(res), _fmt(res.training_goodput, "%"), _fmt(res.infra_goodput, "%"),
                          _fmt(res.wall_s, "s")))
    return lines


def _survivor_stall(res: MechanismResult) -> str:
    """With replica groups, the other groups' longest wait between two steps across a fault; else "-"."""
    if res.median_survivor_stall_s is None or res.max_survivor_stall_s is None:
        return "-"
    return f"{res.median_survivor_stall_s:.2f}/{res.max_survivor_stall_s:.2f} s"


def rollback_table(r: BenchResult) -> list[str]:
    title = "In-memory rollback (training.train.rollback)"
    x = r.rollback
    if x is None:
        return [f"{title}: not measured ({r.unavailable.get(ROLLBACK, 'unknown reason')})"]
    shard = f"{x.copy_bytes >> 20} MiB"
    return [f"{title}: the in-process run's save after each step (rank 0, medians over {x.steps} steps), and a "
            f"synthetic {shard} shard saved the same way on {r.profile.device} for the copy bandwidth", "",
            *_header("save per step", "step time", "save / step time",
                     f"save of the {shard} shard", "host copy bandwidth"),
            _row(f"{x.save_s * 1e3:.2f} ms", f"{x.step_s * 1e3:.1f} ms", _fmt(x.cost_ratio, "%"),
                 f"{x.copy_s * 1e3:.1f} ms", f"{x.copy_gbps:.1f} GB/s")]


def peer_table(r: BenchResult) -> list[str]:
    title = "Peer state (training.train.peer_state)"
    x = r.peer
    if x is None:
        return [f"{title}: not measured ({r.unavailable.get(PEER, 'not in this profile')})"]
    return [f"{title}: the peer-state run's copy into node memory after each saved step (rank 0, medians over "
            f"{x.steps} steps; sending it to the partner node runs beside training)", "",
            *_header("copy per step", "step time", "copy / step time", "steps lost at most", "replicas",
                     "node memory per rank"),
            _row(f"{x.save_s * 1e3:.2f} ms", f"{x.step_s * 1e3:.1f} ms", _fmt(x.cost_ratio, "%"),
                 f"{x.interval} step(s)", str(x.replicas), f"{x.bytes_per_rank / 2**20:.1f} MiB")]


def peer_sizes_table(r: BenchResult) -> list[str]:
    title = "Peer state as the state grows (bench.peer_sizes)"
    if not r.peer_sizes:
        return [f"{title}: not measured ({r.unavailable.get(PEER_SIZES, 'not in this profile')})"]
    base = r.peer_sizes[0]
    lines = [f"{title}: one rank's state (its shard of the preset's fp32 parameters and AdamW moments, 2 nodes of "
             "1 rank) copied into node memory on the training thread, sent to the partner node beside training "
             "(CRC-32, commit, acknowledgement), and restored on a spare from the partner; the CRC-32 of one copy "
             f"alone (the capacity model's CRC32_GBS); growth against {base.preset}", "",
             *_header("preset", "state per rank", "copy", "send", "restore", "CRC-32", "state x", "copy x", "send x",
                      "restore x")]
    for x in r.peer_sizes:
        lines.append(_row(x.preset, f"{x.bytes_per_rank / 2**20:.1f} MiB", _fmt(x.copy_s, "s"), _fmt(x.send_s, "s"),
                          _fmt(x.restore_s, "s"), f"{_fmt(x.checksum_s, 's')} ({x.checksum_gbs:.2f} GB/s)",
                          f"{x.bytes_per_rank / base.bytes_per_rank:.0f}x",
                          f"{x.copy_s / base.copy_s:.0f}x", f"{x.send_s / base.send_s:.0f}x",
                          f"{x.restore_s / base.restore_s:.0f}x"))
    return lines


def projection_table(r: BenchResult) -> list[str]:
    title = "Projection, not a measurement: a lost p5 node on EKS (bench.projection)"
    if not r.projections:
        return [f"{title}: needs the in-job run and the node-loss runs, not measured here"]
    delays = ", ".join(f"{name} {value:g} s" for name, value in vars(r.delays).items())
    lines = [f"{title}. Each recovery is the sum of its parts: Kubernetes' and EKS's delays "
             f"(training.contract.k8s_delays: {delays}) and what this run measured. Reference: the AWS post's plain "
             f"Kubernetes restart, ~{REFERENCE_PLAIN_RESTART_S:g} s.", "",
             *_header("scenario", "projected recovery", "parts (s)")]
    for p in r.projections:
        parts = "; ".join(f"{what} {seconds:.1f}" for what, seconds in p.parts)
        lines.append(_row(p.scenario, f"{p.total_s:.0f} s", parts))
    return lines


def checks_table(checks: tuple[Check, ...]) -> list[str]:
    lines = ["Measured vs reference and targets", "", *_header("figure", "measured", "reference / target",
                                                               "source", "status")]
    for c in checks:
        status = c.status if not c.note else f"{c.status} ({c.note})"
        lines.append(_row(c.figure, _fmt(c.measured, c.unit), c.target, c.source, status))
    return lines


def format_markdown(r: BenchResult) -> str:
    title = (f"# Bench {r.date} ({r.profile.name}; {r.machine.device}, {r.machine.cpus} CPUs, load "
             f"{r.machine.load_avg_1m:.1f}; torch {r.machine.torch}, NVRx {r.machine.nvrx}; {r.elapsed_s:.0f} s)")
    p = r.profile
    notes = [f"Quick mode: {p.faults} faults per mechanism (make bench: {FULL.faults}), {p.state_bytes >> 20} MiB of "
             f"state (make bench: {FULL.state_bytes >> 20} MiB), {p.world} ranks (make bench: {FULL.world}); "
             "figures are noisier."] if p.name == QUICK.name else []
    sections = [[title, *notes], stall_table(r), recovery_table(r), rollback_table(r), peer_table(r),
                peer_sizes_table(r), projection_table(r),
                checks_table(r.checks)]
    return "\n\n".join("\n".join(s) for s in sections) + "\n"
