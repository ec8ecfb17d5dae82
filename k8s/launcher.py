"""The training container's command: `python -m training.pod.launch --config <file> -- ft_launcher <flags>
-m training.train --config <file>`, by default with ft_launcher under training.pod.prefork (the pod's
workers are forked from a template that imported torch, DCP and NVRx once).

Flags of NVRx 0.7.0, the image's version and the one the tests run.
"""
from __future__ import annotations

from typing import Any

from k8s.job_config import JobConfig
from training.contract.config import FaultToleranceConfig
from training.contract.launcher import (launch_command, launcher_ft_args, launcher_wrapper, rendezvous_args,
                                        resume_step_file, section_timeouts, worker_entrypoint)

TRAIN_CONFIG_PATH = "/etc/training/config.yaml"
FT_CONFIG_PATH = "/etc/nvrx/ft.yaml"


def nvrx_ft_config(ft: FaultToleranceConfig) -> dict[str, Any]:
    """The file behind --ft-cfg-path: NVRx's `fault_tolerance` section, from the training config.

    It holds the pod's whole NVRx config in one readable place; the timeouts are repeated as flags
    (the list the local runner uses too), which win over the file, from the same values.
    """
    return {"fault_tolerance": {
        "initial_rank_heartbeat_timeout": ft.initial_rank_heartbeat_timeout,
        "rank_heartbeat_timeout": ft.rank_heartbeat_timeout,
        "rank_section_timeouts": section_timeouts(ft),
        "rank_out_of_section_timeout": ft.out_of_section_timeout,
        "safety_factor": ft.timeout_safety_factor,
        "workload_check_interval": ft.rank_check_interval_s,
        "rank_termination_signal": "SIGKILL",  # a hung rank may ignore SIGTERM
        "log_level": "INFO",
    }}


def launcher_args(job: JobConfig) -> list[str]:
    """ft_launcher's arguments, the same on every pod: each joins the store (k8s.charts.training)
    as a client, `job.nodes` of them train and the other `job.spares` stand by."""
    # The fault-tolerance flags, restart budget included, are the local runner's too
    # (training.contract.launcher).
    ft = job.train.fault_tolerance
    return [
        *rendezvous_args(ft, job.rendezvous_endpoint, job.name, job.nodes, job.spares, job.lost_pod_replaced_s),
        "--nproc-per-node", str(job.instance.gpus),
        "--ft-cfg-path", FT_CONFIG_PATH,
        *launcher_ft_args(ft, str(resume_step_file(job.train.checkpoint_dir))),
        *worker_entrypoint(ft), "--config", TRAIN_CONFIG_PATH,
    ]


def container_command(ft: FaultToleranceConfig) -> list[str]:
    """What comes before `launcher_args` (the container's args): training.pod.launch, the pod's PID 1
    (config pre-flight, signals, exit code the Job can act on), running ft_launcher, under
    training.pod.prefork's launcher with prefork_workers."""
    return [*launch_command(TRAIN_CONFIG_PATH, python="python"), *launcher_wrapper(ft, "python"), "ft_launcher"]
