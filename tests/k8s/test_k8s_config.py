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
    (["--job-name", "Train_1"], {}, "job name 'Train_1' is not allowed"),
    # peer state of the 8b model on one 24 GiB-memory node cannot fit the pod's /dev/shm
    (["-c", "gpuInstanceType=g6.xlarge", "-c", "gpuNodesMin=1", "-c", "gpuNodesDesired=1"], {},
     "peer_state.enabled=true needs 179 GiB of each node's /dev/shm for 8b on 1 nodes"),
    (["--grace-period", "120"], {},
     "termination_grace_s=120 contradicts fault_tolerance.drain_timeout_s=300.0"),
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

