"""Each measured figure beside its reference figure or target, with PASS/MISS.

The reference is the AWS post on NVRx (2-8 p5 nodes: async checkpointing 99%+ training efficiency vs about
60% synchronous; recovery per fault about 10 s in-process, 17 s with ft_launcher and 270 s for a plain
Kubernetes restart); a reference figure that is a baseline to beat, not a target, is shown as BASELINE. The
targets come from the issues, each beside its check below; docs/benchmarks.md lists them all.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

from bench.floor import FloorResult
from bench.mechanisms import BOTH_BESIDE_INJOB, COLLECTIVE_TIMEOUT_S, MechanismResult
from bench.peer import PeerResult
from bench.projection import SURVIVORS_SCENARIO, Projection
from bench.rollback import RollbackResult
from bench.stall import StallResult, leaves_no_cpu_spare

REFERENCE = "AWS post (2-8 p5 nodes)"
ISSUE = "target"
REFERENCE_RECOVERY_S = {"inprocess": 10.0, "injob": 17.0, "injob_fresh": 17.0, "k8s_restart": 270.0}
REFERENCE_EFFICIENCY = {"async": 0.99, "sync": 0.60}
TARGET_ASYNC_EFFICIENCY = 0.85  # every CPU busy training
TARGET_ASYNC_EFFICIENCY_SPARE_CPU = 0.95  # one CPU spare for the writer
RANK_CPU_RATIO = 0.10  # CPU time an async save charges the training rank / a sync save's
# Steps lost per fault, at most: in-memory rollback loses the step in flight; a drain commits the step reached;
# peer state resumes at the newest completed step (the node is lost mid-step); a replica group heals from a
# live group's committed step.
MAX_STEPS_LOST = {"inprocess": 1, "drain": 0, "peer_state": 0, "replica_groups": 0}
# The other replica groups' longest stall across a lost node of another group: here, and projected on EKS.
SURVIVOR_STALL_S = 3.0
SURVIVOR_STALL_EKS_S = 10.0
ROLLBACK_COST = 0.05  # of the step time
SAME_COST = 1.5  # node 0 vs another node: at most this ratio either way
SPARE_VS_INJOB = 1.5
SPARE_CPU_FIGURE = ", one CPU spare for the writer"


@dataclass(frozen=True)
class Check:
    figure: str
    measured: float | None
    unit: str  # "s", "x" (ratio) or "%" (a fraction, printed as a percentage)
    target: str  # as printed
    source: str  # REFERENCE or ISSUE
    status: str  # PASS | MISS | BASELINE | N/A
    note: str = ""


def _check(figure: str, value: float | None, unit: str, target: str, source: str,
           passes: Callable[[float], bool] | None, missing: str = "") -> Check:
    if value is None:
        return Check(figure, None, unit, target, source, "N/A", missing)
    if passes is None:
        return Check(figure, value, unit, target, source, "BASELINE")
    return Check(figure, value, unit, target, source, "PASS" if passes(value) else "MISS")


def stall_checks(s: StallResult | None, missing: str, cpus: int) -> list[Check]:
    return [
        _check("async blocking / sync blocking per save", None if s is None else s.blocking_ratio, "x", "<= 0.10",
               ISSUE, lambda v: v <= 0.10, missing),
        _check("sync checkpoint cost at this interval (1 - efficiency)",
               None if s is None else 1 - s.efficiency_sync, "%", ">= 10% (measurement condition)", ISSUE,
               lambda v: v >= 0.10, missing),
        _async_efficiency(s, missing, cpus),
        _async_efficiency_target(s, missing, cpus, TARGET_ASYNC_EFFICIENCY),
        _efficiency("sync", s, missing),
        _rank_cpu(s, missing),
    ]


def spare_cpu_checks(s: StallResult | None, missing: str, cpus: int, run: bool) -> list[Check]:
    """The stall's second CPU pass, with one CPU left to the background writer; none where it did not run."""
    if not run:
        return []
    return [_async_efficiency(s, missing, cpus, SPARE_CPU_FIGURE),
            _async_efficiency_target(s, missing, cpus, TARGET_ASYNC_EFFICIENCY_SPARE_CPU, SPARE_CPU_FIGURE),
            _efficiency("sync", s, missing, SPARE_CPU_FIGURE), _rank_cpu(s, missing, SPARE_CPU_FIGURE)]


def _async_efficiency_target(s: StallResult | None, missing: str, cpus: int, target: float, where: str = "") -> Check:
    return _cpu_noted(_check(f"training efficiency, async checkpoints{where} (target)",
                             None if s is None else s.efficiency_async, "%", f">= {target:.0%}", ISSUE,
                             lambda v: v >= target, missing), s, cpus)


def _rank_cpu(s: StallResult | None, missing: str, where: str = "") -> Check:
    """A miss names what the rank still pays: its staging copy (in a thread beside training; the blocking is the
    wait for it before the next optimizer step and the save's own start), the rest in its background thread."""
    ratio = None if s is None else s.rank_cpu_ratio
    check = _check(f"CPU time a save charges the training rank, async / sync{where}", ratio, "x",
                   f"<= {RANK_CPU_RATIO:.2f}", ISSUE, lambda v: v <= RANK_CPU_RATIO,
                   missing if s is None else "CPU time not measured (GPU pass)")
    if s is not None and check.status == "MISS":
        check = replace(check, note=(f"async: {s.cpu_per_save_async_s:.2f} CPU-s on the rank, the staging copy of its "
                                     f"{s.state_bytes / s.world_size / 2**20:.0f} MiB shard among them, blocking it "
                                     f"{s.async_blocking_s:.2f} s; sync: {s.cpu_per_save_sync_s:.2f} CPU-s"))
    return check


def _async_efficiency(s: StallResult | None, missing: str, cpus: int, where: str = "") -> Check:
    return _cpu_noted(_efficiency("async", s, missing, where), s, cpus)


def _cpu_noted(check: Check, s: StallResult | None, cpus: int) -> Check:
    """A miss names the CPU time a save still costs (a background write hides the wait, not that)."""
    if s is not None and check.status == "MISS" and s.cpu_per_save_async_s is not None:
        return replace(check, note=_cpu_bound_note(s, cpus))
    return check


def _efficiency(mode: str, s: StallResult | None, missing: str, where: str = "") -> Check:
    value = None if s is None else getattr(s, f"efficiency_{mode}")
    reference = REFERENCE_EFFICIENCY[mode]
    figure = f"training efficiency, {mode} checkpoints{where}"
    if mode == "async":
        return _check(figure, value, "%", f">= {reference:.0%}", REFERENCE, lambda v: v >= reference, missing)
    return _check(figure, value, "%", f"~{reference:.0%}", REFERENCE, None, missing)  # a baseline, not a target


def _cpu_bound_note(s: StallResult, cpus: int) -> str:
    """Why async missed, in figures of the same run: what a save costs the rank and its writer process."""
    note = (f"an async save still costs a rank {s.cpu_per_save_async_s:.2f} CPU-s (sync: {s.cpu_per_save_sync_s:.2f}), "
            f"blocking it {s.async_blocking_s:.2f} s")
    if s.writer_cpu_per_save_async_s is not None:
        note += f", and its writer process {s.writer_cpu_per_save_async_s:.2f} CPU-s"
    if leaves_no_cpu_spare(s.world_size, cpus):
        note += f", and {s.world_size} ranks keep all {cpus} CPUs busy: none is spare for the background write"
    return note


def recovery_checks(recovery: dict[str, MechanismResult], unavailable: dict[str, str],
                    floor: FloorResult | None, mechanisms: tuple[str, ...]) -> list[Check]:
    """Checks of the `mechanisms` this bench profile measures (the GPU profile has two)."""
    def median(name: str) -> float | None:
        return recovery[name].median_recovery_s if name in recovery else None

    def why(*names: str) -> str:
        return "; ".join(f"{n}: {unavailable[n]}" for n in names if n in unavailable) or "not measured"

    inprocess, injob = median("inprocess"), median("injob")
    checks = [
        _check("in-process recovery / in-job recovery",
               inprocess / injob if inprocess is not None and injob is not None else None, "x", "<= 0.5", ISSUE,
               lambda v: v <= 0.5, why("inprocess", "injob")),
        _check("in-job recovery / floor (fresh Python + import torch + join group)",
               injob / floor.median_s if injob is not None and floor is not None else None, "x", "<= 2", ISSUE,
               lambda v: v <= 2, why("injob") if injob is None else "floor not measured"),
    ]
    if "node_zero" in mechanisms:
        zero, other = median("node_zero"), median("node_replacement")
        checks.append(_check("node 0 loss recovery / other node loss recovery",
                             zero / other if zero is not None and other is not None else None, "x",
                             f"{1 / SAME_COST:.2f}-{SAME_COST:g}", ISSUE, lambda v: 1 / SAME_COST <= v <= SAME_COST,
                             why("node_zero", "node_replacement")))
    if "hot_spare" in mechanisms:
        spare = median("hot_spare")
        checks.append(_check("hot spare recovery / in-job recovery",
                             spare / injob if spare is not None and injob is not None else None, "x",
                             f"<= {SPARE_VS_INJOB:g}", ISSUE, lambda v: v <= SPARE_VS_INJOB, why("hot_spare", "injob")))
    if "partition" in mechanisms:
        detected = recovery["partition"].median_detection_s if "partition" in recovery else None
        checks.append(_check("partition detection (NVRx timeouts), median", detected, "s",
                             f"< {COLLECTIVE_TIMEOUT_S} s (gloo's timeout)", ISSUE, lambda v: v < COLLECTIVE_TIMEOUT_S,
                             why("partition")))
    for both, injob_row in ((b, i) for b, i in BOTH_BESIDE_INJOB.items() if b in mechanisms and i in mechanisms):
        checks.append(_both_check(both, injob_row, recovery, why(both, injob_row)))
    if "replica_groups" in mechanisms:
        stall = recovery["replica_groups"].median_survivor_stall_s if "replica_groups" in recovery else None
        checks.append(_check("replica_groups other groups' longest stall across a fault (median)", stall, "s",
                             f"<= {SURVIVOR_STALL_S:g} s", ISSUE, lambda v: v <= SURVIVOR_STALL_S,
                             why("replica_groups")))
        groups, plain = (recovery[n].median_step_s if n in recovery else None for n in ("replica_groups", "injob"))
        checks.append(_check("step time, 2 replica groups / 1 (same ranks and global batch; HSDP's overhead)",
                             groups / plain if groups is not None and plain is not None else None, "x",
                             "measured", ISSUE, None, why("replica_groups", "injob")))
    for name, most in ((n, m) for n, m in MAX_STEPS_LOST.items() if n in mechanisms):
        checks.append(_check(f"{name} steps lost per fault (max)",
                             float(recovery[name].max_steps_lost) if name in recovery else None, "steps",
                             f"<= {most}", ISSUE, lambda v, m=most: v <= m, why(name)))
    for name, reference in ((n, r) for n, r in REFERENCE_RECOVERY_S.items() if n in mechanisms):
        baseline = name == "k8s_restart"
        checks.append(_check(f"{name} median recovery", median(name), "s",
                             f"{'~' if baseline else '<= '}{reference:g} s", REFERENCE,
                             None if baseline else (lambda v, r=reference: v <= r), why(name)))
    return checks


def projection_checks(projections: tuple[Projection, ...], mechanisms: tuple[str, ...]) -> list[Check]:
    """The projected figures that have a target: the other groups' stall on EKS (replica groups)."""
    if "replica_groups" not in mechanisms:
        return []
    stall = next((p.total_s for p in projections if p.scenario == SURVIVORS_SCENARIO), None)
    return [_check("replica_groups other groups' stall, projected on EKS", stall, "s", f"<= {SURVIVOR_STALL_EKS_S:g} s",
                   ISSUE, lambda v: v <= SURVIVOR_STALL_EKS_S, "needs the replica_groups run")]


def _both_check(both: str, injob_row: str, recovery: dict[str, MechanismResult], missing: str) -> Check:
    """restart=both beside injob: a node the Wrapper cannot restart is handed to the launcher within seconds
    (recovery within SAME_COST of injob's), and a hang is detected no later (within SAME_COST: one run each)."""
    figure, unit = ("detection", "median_detection_s") if "hang" in both else ("recovery", "median_recovery_s")
    values = [getattr(recovery[n], unit) if n in recovery else None for n in (both, injob_row)]
    ratio = values[0] / values[1] if None not in values and values[1] else None
    return _check(f"{both} {figure} / {injob_row} {figure}", ratio, "x", f"<= {SAME_COST:g}", ISSUE,
                  lambda v: v <= SAME_COST, missing)


def _step_cost(figure: str, r: PeerResult | RollbackResult | None, missing: str) -> list[Check]:
    """A copy kept after every step, as a share of the step time: at most ROLLBACK_COST."""
    return [_check(figure, None if r is None else r.cost_ratio, "%", f"<= {ROLLBACK_COST:.0%}", ISSUE,
                   lambda v: v <= ROLLBACK_COST, missing)]


def peer_checks(r: PeerResult | None, missing: str) -> list[Check]:
    return _step_cost("peer state copy per step / step time (peer-state run)", r, missing)


def rollback_checks(r: RollbackResult | None, missing: str) -> list[Check]:
    return _step_cost("in-memory rollback per step / step time (in-process run)", r, missing)
