"""The Job's ft_launcher command line and the store's nvrx-control command line, checked by the
installed NVRx 0.7.0 itself, and the container's command run for real with a stand-in ft_launcher."""
from __future__ import annotations

import importlib.metadata
import json
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import yaml
from nvidia_resiliency_ext.fault_tolerance import control_plane as nvrx_control
from nvidia_resiliency_ext.fault_tolerance import launcher as nvrx_launcher

from infra.config import RENDEZVOUS_PORT
from infra.instances import INSTANCE_TYPES
from k8s.launcher import FT_CONFIG_PATH, TRAIN_CONFIG_PATH
from k8s_render import fitting
from training.contract.config import RESTART_MODES, load_train_config
from training.contract.exit_codes import CONFIG_ERROR, INCOMPLETE, NO_PROGRESS
from training.contract.launcher import (NVRX_LAST_CALL_S, REJOIN_POLLS_S, RESUME_STEP_FILE, STORE_ENDPOINT_ENV,
                                       WORKERS_STOP_TIMEOUT_S, rendezvous_last_call_s)
from training.pod.prefork import SERVER_ENV

REPO = Path(__file__).resolve().parents[2]
# Every option string the Job may use, each checked in NVIDIA/nvidia-resiliency-ext v0.7.0
# (fault_tolerance/launcher.py get_args_parser and fault_tolerance/cli_args.py), the image's version.
# A new flag in k8s/launcher.py fails here until it has been checked there too.
NVRX_0_7_0_FLAGS = {
    "--nnodes", "--nproc-per-node", "--max-restarts", "--term-timeout", "--rdzv-backend", "--rdzv-endpoint",
    "--rdzv-id", "--rdzv-conf", "--ft-cfg-path", "--ft-restart-policy", "--ft-initial-rank-heartbeat-timeout",
    "--ft-rank-heartbeat-timeout", "--ft-rank-section-timeouts", "--ft-rank-out-of-section-timeout",
    "--ft-safety-factor", "--ft-max-no-progress-cycles", "--ft-checkpoint-iteration-file", "--ft-no-restart-exit-code",
    "--ft-workload-check-interval", "-m",
}
WORKER_ENTRY = ["training.pod.prefork", "worker", "training.train"]  # the module after -m, and its arguments
STORE_ENDPOINT = f"fsdp-train-rendezvous.training.svc.cluster.local:{RENDEZVOUS_PORT}"  # the store's Service


def _flags(argv: list[str]) -> list[str]:
    """ft_launcher's option strings: up to -m (what follows is the worker's command line)."""
    head = argv[:argv.index("-m") + 1]
    return [a.split("=", 1)[0] for a in head if a.startswith("-")]


@pytest.mark.parametrize("instance_type", sorted(INSTANCE_TYPES))
@pytest.mark.parametrize("mode", RESTART_MODES)
def test_installed_ft_launcher_parses_the_command(render, instance_type, mode):
    r = render("--set", f"fault_tolerance.restart={mode}", *fitting(instance_type),
               context={"gpuInstanceType": instance_type})
    parser = nvrx_launcher.get_args_parser()
    exact = set(parser._option_string_actions)  # no abbreviations
    train = load_train_config(REPO / "k8s" / "train.yaml")
    argv = r.container["args"]  # the same in every pod: no pod hosts the store
    args = parser.parse_args(argv)  # SystemExit on an unknown flag or a bad value
    flags = _flags(argv)
    assert set(flags) <= exact, f"not exact option strings: {set(flags) - exact}"
    assert set(flags) <= NVRX_0_7_0_FLAGS, f"not checked against NVRx 0.7.0: {set(flags) - NVRX_0_7_0_FLAGS}"
    assert args.nnodes == "2:3"  # gpuNodesDesired training nodes, up to one hot spare beside them
    assert args.nproc_per_node == str(INSTANCE_TYPES[instance_type].gpus)
    assert args.rdzv_backend == "c10d"
    assert args.rdzv_endpoint == STORE_ENDPOINT
    assert args.rdzv_id == "fsdp-train"
    conf = dict(kv.split("=") for kv in args.rdzv_conf.split(","))
    join_timeout = train.fault_tolerance.rendezvous_join_timeout_s
    assert conf == {"join_timeout": f"{join_timeout:g}", "is_host": "false",  # a client of the store
                    # one spare, replacements after NotReady: no survivor can lose its place (below)
                    "last_call_timeout": str(NVRX_LAST_CALL_S),
                    "store_connect_wait_seconds": f"{join_timeout:.0f}"}  # which may start later than this pod
    assert args.ft_restart_policy == "any-failed"
    assert args.max_restarts == train.fault_tolerance.max_restarts_total  # in every mode
    # the budget that matters: restarts in a row without a newer checkpoint, read from the file
    # that training keeps in the checkpoint directory on FSx
    assert int(args.ft_max_no_progress_cycles) == train.fault_tolerance.max_restarts
    assert args.ft_checkpoint_iteration_file == f"/fsx/runs/fsdp-train/checkpoints/{RESUME_STEP_FILE}"
    assert int(args.ft_no_restart_exit_code) == NO_PROGRESS
    assert float(args.term_timeout) == train.fault_tolerance.drain_timeout_s
    assert args.module and [args.training_script, *args.training_script_args] == [
        *WORKER_ENTRY, "--config", TRAIN_CONFIG_PATH]


def test_installed_nvrx_control_parses_the_store_command_of_the_same_rendezvous(render):
    r = render()
    store = r.store
    (container,) = store["spec"]["template"]["spec"]["containers"]
    # training.pod.store (which starts the store over when the run stalls) around nvrx-control
    assert container["command"][:5] == ["python", "-m", "training.pod.store", "--config", TRAIN_CONFIG_PATH]
    program, *argv = container["command"][container["command"].index("--") + 1:]
    assert program == "nvrx-control" and "args" not in container
    store_args = nvrx_control.get_args_parser().parse_args(argv)  # SystemExit on an unknown flag
    launcher_args = nvrx_launcher.get_args_parser().parse_args(r.container["args"])
    for key in ("nnodes", "rdzv_backend", "rdzv_id", "rdzv_conf"):
        assert getattr(store_args, key) == getattr(launcher_args, key), key
    # It listens on every interface of its pod; its own client connects over loopback.
    assert store_args.rdzv_endpoint == f"127.0.0.1:{RENDEZVOUS_PORT}"
    assert store_args.ft_enable_log_server is False


def _store_gate(store_deployment: dict, previous_active: dict):
    """The store's last-call gate, as NVRx 0.7.0 builds it from the store command of `store_deployment`."""
    from nvidia_resiliency_ext.fault_tolerance.ft_rendezvous_barrier import _PreviousActiveLastCallGate

    (container,) = store_deployment["spec"]["template"]["spec"]["containers"]
    argv = container["command"][container["command"].index("--") + 2:]
    conf = nvrx_control._parse_rendezvous_config(nvrx_control.get_args_parser().parse_args(argv).rdzv_conf)
    timeout = float(conf["last_call_timeout"])
    return _PreviousActiveLastCallGate(previous_active, timeout_seconds=timeout, enabled=True), timeout


def test_a_restart_round_keeps_a_survivors_place_while_it_stops_its_ranks(render):
    """Issue 23's lost peer state: after node 1's loss, the hot spare and node 1's quick replacement made the
    next round while node 0, the survivor holding every copy, was still stopping its rank; NVRx's store waited
    its default 1 s for the previous round's nodes ("Previous-active last_call expired; closing round without
    infra ranks"), node 0 stood by, and the resume fell back to the checkpoint. With two spares the round can
    fill without node 0, and the store's gate keeps it open for a survivor whose launcher SIGKILLs its ranks
    at the worker-stop timeout and then polls for the round."""
    gate, timeout = _store_gate(render("--nodes", "2", "--spares", "2").store, {0: None, 1: None})
    spares = [("spare", 2, 0, None), ("spare", 3, 0, None)]  # enough to train without node 0
    assert not gate.evaluate(spares, now=0.0).should_close
    survivor_back = WORKERS_STOP_TIMEOUT_S + 2.0  # its ranks killed, then two of NVRx's once-a-second polls
    assert not gate.evaluate(spares, now=survivor_back).should_close
    # it closes with node 0 back at the deadline: NVRx cannot tell lost node 1 from a late survivor
    closing = gate.evaluate([*spares, ("node 0", 0, 0, None)], now=timeout)
    assert closing.should_close and closing.missing_previous_active == (1,)


def test_with_one_spare_a_node_loss_waits_no_longer_than_nvrxs_last_call(render):
    """With one spare the round is full only with every survivor in it (node 1's pod is replaced after
    NotReady and the toleration, 85 s): a long last call would keep no survivor's place, and every node loss
    would wait it out for the lost node."""
    job = render()
    gate, timeout = _store_gate(job.store, {0: None, 1: None})
    round_without_node_1 = [("node 0", 0, 0, None), ("spare", 2, 0, None)]
    assert timeout == NVRX_LAST_CALL_S
    assert gate.evaluate(round_without_node_1, now=0.0).should_close is False
    assert gate.evaluate(round_without_node_1, now=NVRX_LAST_CALL_S).should_close


def test_the_local_clusters_quick_replacement_keeps_a_survivors_place():
    """training.local replaces a lost node's launcher at once by default (--replacement-delay 0): with one
    spare, the spare and that replacement fill the round without a slow survivor, so the wait is the
    survivor's worker stop and polls; a replacement later than that needs none, two spares always do."""
    ft = load_train_config(REPO / "k8s" / "train.yaml").fault_tolerance
    assert rendezvous_last_call_s(ft, spares=1, replacement_s=0.0, workers_stop_timeout_s=5) == 5 + REJOIN_POLLS_S
    assert rendezvous_last_call_s(ft, spares=1, replacement_s=30.0, workers_stop_timeout_s=5) == NVRX_LAST_CALL_S
    assert rendezvous_last_call_s(ft, spares=2, replacement_s=30.0, workers_stop_timeout_s=5) == 5 + REJOIN_POLLS_S


def test_the_image_has_nvrx_control_on_its_path():
    """training/Dockerfile pip-installs this NVRx version (test_infra_image_and_outputs), whose
    console scripts land on PATH."""
    scripts = {e.name: e.value for e in importlib.metadata.distribution("nvidia-resiliency-ext").entry_points
               if e.group == "console_scripts"}
    assert scripts["nvrx-control"] == "nvidia_resiliency_ext.fault_tolerance.control_plane:main"
    assert scripts["ft_launcher"] == "nvidia_resiliency_ext.fault_tolerance.launcher:main"


def test_without_prefork_ft_launcher_starts_training_train_itself(render, tmp_path):
    r = render("--set", "fault_tolerance.prefork_workers=false")
    args = nvrx_launcher.get_args_parser().parse_args(r.container["args"])
    assert [args.training_script, *args.training_script_args] == ["training.train", "--config", TRAIN_CONFIG_PATH]
    proc, record = _run_container(r, tmp_path, r.config_map("fsdp-train-config")["config.yaml"])
    assert proc.returncode == INCOMPLETE, proc.stderr
    assert json.loads(record.read_text()) == {"argv": r.container["args"], "prefork_server": None,
                                              "store_endpoint": STORE_ENDPOINT}


def test_installed_ft_launcher_builds_its_launch_config(render, tmp_path, monkeypatch):
    """Past parsing: ft_launcher's own config_from_args accepts the flags and the --ft-cfg-path file,
    and ends up with the training config's timeouts."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # else config_from_args sets it in os.environ
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # its default log dir
    r = render()
    ft_file = tmp_path / "ft.yaml"
    ft_file.write_text(r.config_map("fsdp-train-ft-config")["ft.yaml"])
    argv = [a.replace(FT_CONFIG_PATH, str(ft_file)) for a in r.container["args"]]
    config, _, cmd_args = nvrx_launcher.config_from_args(nvrx_launcher.get_args_parser().parse_args(argv))
    train = load_train_config(REPO / "k8s" / "train.yaml").fault_tolerance
    assert (config.min_nodes, config.max_nodes, config.nproc_per_node) == (2, 3, 8)
    # A client of the store in every pod, whatever its host name.
    host = STORE_ENDPOINT.split(":")[0]
    assert nvrx_launcher._is_store_host_from_config(host, config.rdzv_configs) is False
    assert float(config.rdzv_configs["join_timeout"]) == train.rendezvous_join_timeout_s
    assert config.term_timeout == train.drain_timeout_s
    ft = config.fault_tol_cfg
    assert ft.initial_rank_heartbeat_timeout == train.initial_rank_heartbeat_timeout
    assert ft.rank_heartbeat_timeout == train.rank_heartbeat_timeout
    assert ft.rank_out_of_section_timeout == train.out_of_section_timeout
    assert ft.rank_section_timeouts == {"setup": train.setup_section_timeout, "step": train.step_section_timeout,
                                        "checkpoint": train.checkpoint_section_timeout}
    assert ft.safety_factor == train.timeout_safety_factor
    assert ft.workload_check_interval == train.rank_check_interval_s
    assert cmd_args == ["-u", "-m", *WORKER_ENTRY, "--config", TRAIN_CONFIG_PATH]


def test_nvrx_ft_file_has_only_keys_nvrx_knows(render, tmp_path):
    from nvidia_resiliency_ext.fault_tolerance.config import FaultToleranceConfig

    ft_file = tmp_path / "ft.yaml"
    ft_file.write_text(render().config_map("fsdp-train-ft-config")["ft.yaml"])
    cfg = FaultToleranceConfig.from_yaml_file(str(ft_file), ignore_not_recognized=False)
    assert cfg.rank_termination_signal.name == "SIGKILL"



def _run_container(rendered, tmp_path: Path, config_text: str) -> tuple[subprocess.CompletedProcess, Path]:
    """Run the container's command + args with a stand-in ft_launcher that records its argv and
    the worker template's address and exits 0, the real python (training.pod.launch loads the config,
    the prefork launcher starts the template) and the config at a temporary path."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    record = tmp_path / "argv.json"
    fake = bin_dir / "ft_launcher"
    fake.write_text(f"#!{sys.executable}\nimport json, os, sys\n"
                    f"json.dump({{'argv': sys.argv[1:], 'prefork_server': os.environ.get({SERVER_ENV!r}), "
                    f"'store_endpoint': os.environ.get({STORE_ENDPOINT_ENV!r})}}, "
                    f"open({str(record)!r}, 'w'))\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    config = tmp_path / "config.yaml"
    config.write_text(config_text)
    command = [part.replace(TRAIN_CONFIG_PATH, str(config)) for part in rendered.container["command"]]
    env = {"PATH": f"{bin_dir}:{Path(sys.executable).parent}:/usr/bin:/bin"}
    proc = subprocess.run([*command, *rendered.container["args"]], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=60)
    return proc, record


def test_pod_runs_ft_launcher_under_training_launch_and_prefork(render, tmp_path):
    r = render()
    assert r.container["command"][:6] == ["python", "-m", "training.pod.launch", "--config", TRAIN_CONFIG_PATH, "--"]
    proc, record = _run_container(r, tmp_path, r.config_map("fsdp-train-config")["config.yaml"])
    recorded = json.loads(record.read_text())
    assert recorded["argv"] == r.container["args"]
    assert recorded["prefork_server"], "ft_launcher must run under training.pod.prefork's launcher"
    # its ranks (which inherit its environment) find the store the in-process Wrapper coordinates in
    assert recorded["store_endpoint"] == STORE_ENDPOINT
    # ft_launcher exited 0 and the run has not completed (a standby left): the Job runs the index again.
    assert proc.returncode == INCOMPLETE, proc.stderr


def test_pod_exits_with_config_error_before_launching(render, tmp_path):
    r = render()
    bad = yaml.safe_load(r.config_map("fsdp-train-config")["config.yaml"])
    bad["fault_tolerance"]["restart"] = "sometimes"
    proc, record = _run_container(r, tmp_path, yaml.safe_dump(bad))
    assert proc.returncode == CONFIG_ERROR
    assert "invalid training config" in proc.stderr and "fault_tolerance.restart" in proc.stderr
    assert not record.exists(), "ft_launcher must not start on an invalid config"


def test_command_has_nothing_kubernetes_would_expand(render):
    # The kubelet replaces $(VAR) in command and args with container env values.
    r = render()
    assert not [part for part in r.container["command"] + r.container["args"] if "$(" in part]
