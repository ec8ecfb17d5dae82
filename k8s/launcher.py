"""The training container's command: `ft_launcher <flags> -m training.train --config <file>`, by
default through training.prefork (the pod's workers are forked from a template that imported
torch, DCP and NVRx once).

Flags of NVRx 0.7.0, the image's version and the one the tests run.
"""
from __future__ import annotations

import shlex
from typing import Any

from k8s.job_config import JobConfig
from training.config import FaultToleranceConfig
from training.exit_codes import CONFIG_ERROR
from training.fault_tolerance import (launcher_ft_args, launcher_wrapper, resume_step_file, section_timeouts,
                                      worker_entrypoint)

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
        "rank_termination_signal": "SIGKILL",  # a hung rank may ignore SIGTERM
        "log_level": "INFO",
    }}


def launcher_args(job: JobConfig) -> list[str]:
    """ft_launcher's arguments, the same on every pod (index 0 adds --rdzv-conf is_host=1)."""
    # The fault-tolerance flags, restart budget included, are the local runner's too
    # (training.fault_tolerance): with restart=inprocess the launcher restarts nothing.
    return [
        "--nnodes", str(job.nodes),  # fixed size: every rank holds a shard, none is spare
        "--nproc-per-node", str(job.instance.gpus),
        "--rdzv-backend", "c10d",
        "--rdzv-endpoint", job.rendezvous_endpoint,
        "--rdzv-id", job.name,
        "--ft-cfg-path", FT_CONFIG_PATH,
        *launcher_ft_args(job.train.fault_tolerance, str(resume_step_file(job.train.checkpoint_dir))),
        *worker_entrypoint(job.train.fault_tolerance), "--config", TRAIN_CONFIG_PATH,
    ]


def container_command(ft: FaultToleranceConfig) -> list[str]:
    """`sh -c` wrapper; `launcher_args` go in the container's args and arrive as "$@".

    1. Pre-flight: ft_launcher exits 1 whatever its ranks exit with, so a config the training code
       rejects is caught here and exits CONFIG_ERROR, which the Job's podFailurePolicy turns into
       an immediate Job failure instead of retries that cannot succeed.
    2. Index 0 hosts the c10d store (is_host=1), the others connect to it: no reliance on
       hostname matching of the endpoint.
    3. With prefork_workers, ft_launcher runs under `python -m training.prefork launch`, which first
       starts the pod's worker template (training/prefork.py).
    """
    launcher = shlex.join([*launcher_wrapper(ft, "python"), "ft_launcher"])
    check = ("import sys\n"
             "from training.config import load_train_config\n"
             "try:\n"
             "    load_train_config(sys.argv[1])\n"
             "except ValueError as err:\n"
             "    sys.exit(f\"invalid training config: {err}\")\n")
    script = (
        "set -eu\n"
        f"python -c {shlex.quote(check)} {TRAIN_CONFIG_PATH} || exit {CONFIG_ERROR}\n"
        'if [ "$JOB_COMPLETION_INDEX" = 0 ]; then set -- --rdzv-conf is_host=1 "$@"; fi\n'
        f'exec {launcher} "$@"\n'
    )
    return ["/bin/sh", "-c", script, "ft_launcher"]
