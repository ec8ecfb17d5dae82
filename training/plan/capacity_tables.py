"""The tables of docs/capacity.md (`python -m training.plan --capacity-tables`): the Job's config (k8s/train.yaml)
with 8b and the 70b-class shape on 2, 32 and 256 p5.48xlarge nodes, and HSDP with replica groups beside today's
mechanisms. Each row's FSx is the smallest PERSISTENT_2 file system at 1000 MBps/TiB that holds `keep`
checkpoints and one in flight, and its interval is the planner's recommendation at the Llama 3 failure rate.
Every figure is projected (training.contract.capacity); none was measured on p5."""
from __future__ import annotations

from pathlib import Path

from training.contract.capacity import (GB, P5_48XLARGE, Capacity, FsxSpec, HsdpCase, ModelFootprint, Schedule,
                                        capacity_of, smallest_storage_gib)
from training.contract.config import TrainConfig, load_train_config
from training.plan.planner import LLAMA3_NODE_FAILURE_RATE, make_plan, recommended_steps

JOB_CONFIG = Path(__file__).resolve().parents[2] / "k8s" / "train.yaml"
MODELS = ("8b", "70b")
NODES = (2, 32, 256)
HSDP_NODES = (32, 256)
_NO_SHM = "no room: /dev/shm"
FSX_TIER = 1000  # MBps/TiB: the throughput per dollar is the same at every tier, the time per save is not


def _capacity(preset: str, nodes: int, train: TrainConfig) -> Capacity:
    model = ModelFootprint.from_preset(preset, train.training.seq_len)
    first = capacity_of(model, P5_48XLARGE, nodes, FsxSpec(1200, FSX_TIER), Schedule.from_config(train, nodes * P5_48XLARGE.gpus))
    fsx = FsxSpec(smallest_storage_gib(first.footprint_bytes), FSX_TIER)
    sized = capacity_of(model, P5_48XLARGE, nodes, fsx, first.schedule)
    plan = make_plan(nodes, P5_48XLARGE.gpus, 1 / LLAMA3_NODE_FAILURE_RATE, sized.blocking_s, sized.step_s, (),
                     sized.commit_lag_s)
    return capacity_of(model, P5_48XLARGE, nodes, fsx, Schedule.from_config(train, nodes * P5_48XLARGE.gpus, recommended_steps(plan)))


def _row(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def capacity_table(train: TrainConfig) -> str:
    lines = [_row(["model", "nodes", "FSx GiB, $/month", "step s", "save s", "interval steps", "drain s: commit, "
                   "+ step reached", "peer copy, send s", "restore s: FSx, peers", "keep GiB", "steps lost: FSx, "
                   "peers, drain", "figures"]),
             _row(["---"] * 12)]
    for preset in MODELS:
        for nodes in NODES:
            c = _capacity(preset, nodes, train)
            lines.append(_row([
                preset, str(nodes), f"{c.fsx.storage_gib}, ${c.fsx.usd_per_month:,.0f}", f"{c.step_s:.2f}",
                f"{c.save_s:.0f}", str(c.schedule.interval),
                f"{c.drain_commit_s:.0f}, {c.drain_grace_for_step_s:.0f}",
                f"{c.peer_copy_s:.2f}, {c.peer_send_s:.1f}" if c.peer_fits_shm else _NO_SHM,
                f"{c.restore_fsx_s:.0f}, {c.restore_peer_s:.1f}" if c.peer_fits_shm else f"{c.restore_fsx_s:.0f}, -",
                f"{c.footprint_bytes / 2**30:.0f}",
                f"{c.fsx_steps_lost}, {c.peer_steps_lost if c.peer_fits_shm else '-'}, {c.drain_steps_lost}",
                "projected"]))
    return "\n".join(lines)


def hsdp_table(train: TrainConfig) -> str:
    lines = [_row(["model", "nodes", "GPU state GB: FSDP, HSDP", "HSDP step cost ms (of step)",
                   "recovery s: FSx, peers, HSDP", "steps lost: FSx, peers, HSDP",
                   "GPU-h lost per node failure: FSx, peers, HSDP", "figures"]),
             _row(["---"] * 8)]
    for preset in MODELS:
        for nodes in HSDP_NODES:
            c = _capacity(preset, nodes, train)
            h = HsdpCase(c)
            fsx_gpu_h = h.today_lost_gpu_s(c.recovery_fsx_s, c.fsx_steps_lost) / 3600
            peer_gpu_h = h.today_lost_gpu_s(c.recovery_peer_s, c.peer_steps_lost) / 3600
            lines.append(_row([
                preset, str(nodes), f"{h.fsdp_gpu_bytes / GB:.2f}, {h.hsdp_gpu_bytes / GB:.2f}",
                f"{h.step_cost_s * 1e3:.0f} ({h.step_cost_s / c.step_s:.1%})",
                f"{c.recovery_fsx_s:.0f}, {c.recovery_peer_s:.0f}, {h.recovery_s:.0f}",
                f"{c.fsx_steps_lost}, {c.peer_steps_lost}, 0",
                f"{fsx_gpu_h:.1f}, {peer_gpu_h:.1f}, {h.lost_gpu_s / 3600:.1f}", "projected"]))
    return "\n".join(lines)


def capacity_tables(config: Path = JOB_CONFIG) -> str:
    train = load_train_config(config)
    return f"{capacity_table(train)}\n\n{hsdp_table(train)}"
