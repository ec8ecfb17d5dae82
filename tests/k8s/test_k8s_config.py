"""Bad settings stop `make manifests` with one line that names the setting; nothing is written."""
from __future__ import annotations

import pytest



@pytest.mark.parametrize("args, context, expected", [
    (["--nodes", "0"], {}, "nodes=0 is not allowed: at least 1"),
    (["--nodes", "5"], {}, "nodes=5 exceeds gpuNodesMax=4"),
    (["--spares", "-1"], {}, "spares=-1 is not allowed: 0 or more"),
    (["--spares", "3"], {}, "nodes=2 + spares=3 = 5 exceeds gpuNodesMax=4: every pod needs a GPU node of its own; "
                            "allowed: at most 2 spares"),
    # The platform's spare is the default beside any --nodes: both must fit.
    (["--nodes", "4"], {}, "nodes=4 + spares=1 = 5 exceeds gpuNodesMax=4"),
    (["-c", "gpuNodesSpare=3"], {}, "gpuNodesSpare=3 does not fit: gpuNodesDesired + gpuNodesSpare = 5 exceeds "
                                    "gpuNodesMax=4"),
    (["-c", "gpuNodesSpare=-1"], {}, "gpuNodesSpare=-1 is not allowed: 0 or more"),
    ([], {"gpuNodesDesired": 0}, "gpuNodesDesired=0 is not allowed"),
    (["-c", "gpuNodesMax=1"], {}, "gpuNodesMin <= gpuNodesDesired <= gpuNodesMax"),
    (["-c", "gpuNodes=3"], {}, "-c 'gpuNodes=3': expected key=value with key one of"),
    (["-c", "gpuInstanceType=p3.2xlarge"], {}, "gpuInstanceType='p3.2xlarge' is not allowed"),
    (["--set", "fault_tolerance.restart=sometimes"], {},
     "fault_tolerance.restart='sometimes' is not allowed: one of ['injob', 'both']"),
    (["--set", "fault_tolerance.max_restarts=-1"], {}, "fault_tolerance.max_restarts=-1"),
    (["--set", "fault_tolerance.checkpoint_section_timeout=60"], {},
     "checkpoint_section_timeout (60.0) must be at least step_section_timeout (180.0)"),
    (["--set", "fault_tolerance.initial_rank_heartbeat_timeout=30"], {},
     "initial_rank_heartbeat_timeout (30.0) must be at least rank_heartbeat_timeout"),
    (["--set", "run_dir=/tmp/run"], {}, "run_dir='/tmp/run' is not allowed on the cluster"),
    (["--set", "checkpoint.also_resume_from=/tmp/old"], {},
     "checkpoint.also_resume_from='/tmp/old' is not allowed on the cluster: it must be a directory below /fsx"),
    (["--job-name", "Train_1"], {}, "job name 'Train_1' is not allowed"),
    # 64 sequences of batch_size 2: 32 micro-batches, which 24 GPUs cannot share evenly
    (["--nodes", "3", "--spares", "0", "--set", "training.global_batch_size=64"], {},
     "nodes=3 x 8 GPUs: training.global_batch_size=64 cannot be reached by world size 24: the global batch is world "
     "size x batch_size (2) x micro-batches per rank, so the world size must divide 32; allowed world sizes: "
     "[1, 2, 4, 8, 16, 32]; with 8 GPUs per node, allowed nodes: [1, 2, 4]"),
    (["--set", "training.global_batch_size=5"], {}, "training.global_batch_size=5 is not allowed: a positive multiple "
                                                    "of training.batch_size (2)"),
    # peer state of the 8b model on one 24 GiB-memory node cannot fit the pod's /dev/shm
    (["-c", "gpuInstanceType=g6.xlarge", "-c", "gpuNodesMin=1", "-c", "gpuNodesDesired=1"], {},
     "each node's /dev/shm must hold peer state 179 GiB (1 replica(s)) and async checkpoint staging 90 GiB for 8b "
     "on 1 nodes"),
    # without peer state, an async save's staging copy of the node's state still lives in /dev/shm
    (["-c", "gpuInstanceType=g6.xlarge", "-c", "gpuNodesMin=1", "-c", "gpuNodesDesired=1",
      "--set", "peer_state.enabled=false"], {},
     "each node's /dev/shm must hold async checkpoint staging 90 GiB for 8b on 1 nodes, more than 88% of its 3 GiB "
     "(shm_fraction=0.25 of 12 GiB): train on more nodes, raise shm_fraction, or use checkpoint.mode=sync"),
    (["--grace-period", "120"], {},
     "termination_grace_s=120 contradicts fault_tolerance.drain_timeout_s=360.0"),
    (["--node-failure-toleration", "-1"], {},
     "node_failure_toleration_s=-1 is not allowed: 0 to 300 seconds"),
    (["--node-failure-toleration", "301"], {},
     "node_failure_toleration_s=301 is not allowed: 0 to 300 seconds"),
    (["--fault-injection", "--fault-target-index", "3"], {},  # two training nodes and a spare: 0..2
     "fault_injection.target_index=3 is not allowed: an index of the job, 0..2"),
    (["--fault-injection", "--fault-grace-period", "0"], {}, "fault_injection.grace_period_s=0 is not allowed: 1 or more"),
    (["--fault-injection", "--fault-schedule", "every hour"], {}, "fault_injection.schedule='every hour'"),
    (["--fault-injection", "--fault-schedule", "*/0 * * * *"], {}, "fault_injection.schedule='*/0 * * * *' is not allowed"),
    (["--fault-injection", "--fault-schedule", "0,60 * * * *"], {}, "fault_injection.schedule='0,60 * * * *' is not allowed"),
    # Drills closer than a restart and a save (600 + 600 s by default) leave no checkpoint in between.
    (["--fault-injection", "--fault-schedule", "*/15 * * * *"], {},
     "fault_injection.schedule='*/15 * * * *' evicts a pod as often as every 15 min, faster than the Job can "
     "recover: at least 20 min between drills"),
    (["--fault-injection", "--fault-schedule", "0,59 * * * *"], {}, "as often as every 1 min"),
    (["--fault-injection", "--fault-schedule", "0 0,23 * * *", "--set", "fault_tolerance.checkpoint_section_timeout=3600"],
     {}, "as often as every 60 min, faster than the Job can recover: at least 70 min"),
])
def test_bad_config_fails_with_a_message_naming_it(render_error, args, context, expected):
    assert expected in render_error(*args, context=context)


def test_outputs_missing_a_key(render_error):
    err = render_error(outputs={"ft-training-cluster": {"ClusterName": "c", "Namespace": "training"}})
    assert "missing output(s) ['PvcName', 'ImageUri']" in err


def test_outputs_disagreeing_between_stacks(render_error):
    outputs = {"a": {"Namespace": "training"}, "b": {"Namespace": "other"}}
    assert "output Namespace differs between stacks" in render_error(outputs=outputs)



# The chart checks the Job against the FSx it renders for (cdk.json, -c): training/contract/capacity.py.
@pytest.mark.parametrize("args, expected", [
    # the FSx this repository provisioned before: 1200 GiB x 250 MBps/TiB, 0.29 GB/s for 96 GB of 8b state
    (["-c", "fsxThroughputPerTib=250", "--set", "fault_tolerance.drain_timeout_s=300"],
     ["8b on 2 x p5.48xlarge: an async save of 96.4 GB to FSx (1200 GiB x 250 MBps/TiB = 0.29 GB/s) takes 329 s, "
      "and with 1.5x headroom for a slower save needs 493 s, longer than checkpoint.interval=200 steps (~213 s at a "
      "projected 1.07 s per step)",
      "Raise checkpoint.interval to at least 463, or FSx throughput (fsxThroughputPerTib, fsxStorageGib) to 0.68 GB/s",
      "a drain cannot commit within its grace", "fault_tolerance.drain_timeout_s=300. Raise drain_timeout_s to at "
      "least 329 (1316 to also save the step reached)"]),
    # ~107 s: longer than the 82 s save, not than its 1.5x headroom (the planner's shortest interval too)
    (["--set", "checkpoint.interval=100"], ["takes 82 s, and with 1.5x headroom for a slower save needs 123 s, longer "
                                            "than checkpoint.interval=100 steps", "Raise checkpoint.interval to at "
                                                                                  "least 116"]),
    (["--set", "fault_tolerance.drain_timeout_s=60"],
     ["the in-flight save of 96.4 GB takes up to 82 s to FSx (1200 GiB x 1000 MBps/TiB = 1.17 GB/s), more than "
      "fault_tolerance.drain_timeout_s=60. Raise drain_timeout_s to at least 83 (329 to also save the step reached), "
      "or FSx throughput (fsxThroughputPerTib, fsxStorageGib)"]),
    (["--set", "checkpoint.keep=20"], ["checkpoint.keep=20 checkpoints and one in flight take 1885 GiB, more than "
                                       "FSx's 1200 GiB: lower checkpoint.keep or raise fsxStorageGib to 2400"]),
])
def test_a_job_whose_saves_or_drains_cannot_keep_up_is_refused_with_its_numbers_and_knobs(render_error, args, expected):
    err = render_error(*args)
    for part in expected:
        assert part in err


def test_larger_fsx_or_a_longer_interval_fix_what_the_old_fsx_refused(render):
    render("-c", "fsxThroughputPerTib=250", "-c", "fsxStorageGib=2400", "--set", "checkpoint.interval=400",
           "--set", "fault_tolerance.drain_timeout_s=600")  # 0.59 GB/s: 165 s per save


def test_the_default_job_keeps_its_promises_at_its_size():
    """cdk.json's FSx and k8s/train.yaml's 8b Job on 2 p5 nodes: every save finishes within the interval, a drain
    commits the in-flight save and the step reached, keep checkpoints fit."""
    from infra.config import PlatformConfig
    from k8s.job_config import JobConfig
    from k8s.main import REPO_ROOT, load_platform
    from k8s.outputs import load_infra_outputs
    from training.contract.capacity import P5_48XLARGE
    from training.contract.config import load_train_config

    platform = load_platform(REPO_ROOT / "cdk.json", [])
    assert platform == PlatformConfig()  # cdk.json's defaults are the config's
    job = JobConfig(platform, load_train_config(REPO_ROOT / "k8s" / "train.yaml"),
                    load_infra_outputs(platform, REPO_ROOT / "absent-outputs.json"))
    c = job.capacity
    assert c.node == P5_48XLARGE  # the capacity model's p5 is the instance table's, with the chart's /dev/shm
    assert (c.model.name, c.nodes, c.fsx.storage_gib, c.fsx.throughput_per_tib) == ("8b", 2, 1200, 1000)
    assert c.problems() == []
    assert c.save_s < c.interval_s and c.drain_grace_for_step_s < c.schedule.drain_timeout_s and c.footprint_fits
