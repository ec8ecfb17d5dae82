"""A node cut off from the network, not dead: each emulated node on its own machine (a network namespace,
training/local/netns.py), a `partition` fault takes its link down. The survivors detect it through NVRx's
timeouts, the job recovers and resumes exactly; when the link comes back, the old node's ranks do not
carry on as if nothing happened."""
from __future__ import annotations

import socket
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import psutil
import pytest

from training.contract.events import read_events
from training.local.netns import VirtualNetwork, unavailable_reason
from training.report.goodput import build_report
from training_helpers import (COLLECTIVE_TIMEOUT_S, COMMON, TWO_NODES, assert_bitwise_equal, completed, events_named,
                              load_final_state, once_per_session, run_local)

NO_NETNS = unavailable_reason()
pytestmark = pytest.mark.skipif(NO_NETNS is not None, reason=f"network namespaces unavailable: {NO_NETNS}")

_SERVE = ("import socket; s = socket.create_server(('0.0.0.0', 7000)); print('listening', flush=True); "
          "c, _ = s.accept(); c.sendall(b'hello'); c.close()")
_RESOLVE = "import socket; print(socket.gethostname(), socket.gethostbyname(socket.gethostname()))"


def _resolve(name: str) -> str:
    return f"import socket; print(socket.gethostbyname({name!r}))"


def _on(network: VirtualNetwork, machine, code: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(network.command(machine, [sys.executable, "-c", code]), capture_output=True, text=True,
                          timeout=30, **kwargs)


def _fetch(network: VirtualNetwork, client, server_address: str, timeout: float) -> str:
    """The server's greeting, or "" when none came within `timeout`. Failed attempts are retried until then:
    an address that did not answer ARP while cut off gives "No route to host" until the kernel probes again."""
    code = f"""
import socket, time
deadline = time.monotonic() + {timeout}
while time.monotonic() < deadline:
    try:
        s = socket.create_connection(('{server_address}', 7000), timeout=max(deadline - time.monotonic(), 0.01))
    except OSError:
        time.sleep(0.2)
        continue
    print(s.recv(5).decode())
    break
"""
    return _on(network, client, code).stdout.strip()


def test_emulated_machines_have_their_own_address_and_name_and_can_be_cut_off():
    network = VirtualNetwork()
    try:
        host_mac = Path(f"/sys/class/net/{network.bridge}/address").read_text()
        a, b = network.add_machine("node0-m0"), network.add_machine("node1-m1")
        assert _on(network, a, _RESOLVE).stdout.split() == ["node0-m0", a.address]  # as in a pod
        # and every other machine's name, as the cluster's DNS resolves pods' FQDNs (torchft advertises them)
        assert _on(network, a, _resolve("node1-m1")).stdout.split() == [b.address]
        assert socket.gethostname() not in ("node0-m0", "node1-m1")  # the host's name is untouched

        server = subprocess.Popen(network.command(a, [sys.executable, "-c", _SERVE]), stdout=subprocess.PIPE, text=True)
        assert server.stdout.readline().strip() == "listening"  # a fixed sleep lost this race on a loaded machine
        network.set_link(a, up=False)
        assert _fetch(network, b, a.address, timeout=2) == ""  # cut off: the connection times out
        network.set_link(a, up=True)
        assert _fetch(network, b, a.address, timeout=10) == "hello"
        server.wait(timeout=10)
        # Machines coming and going leave the host's address as it was, so the other machines' ARP entries
        # for it (the rendezvous store's) stay valid: a bridge would otherwise take its lowest port's MAC.
        c = network.add_machine("node2-m2")
        assert Path(f"/sys/class/net/{network.bridge}/address").read_text() == host_mac
        assert _on(network, a, _resolve("node2-m2")).stdout.split() == [c.address]  # a machine added later too
    finally:
        network.close()
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert a.namespace not in listed and b.namespace not in listed


def test_without_netns_a_partition_fault_is_refused(tmp_path):
    run = run_local(tmp_path / "run", *TWO_NODES.argv(), "--steps", "5", "--faults", "partition@3:node=1")
    assert run.returncode != 0 and "partition faults need --netns" in run.output


# Each case: (arguments, config overrides, fault). The node is cut off halfway into step 12; NVRx's step-section timeout (max
# observed step x safety factor) stops every rank; the restart resumes at the checkpoint of step 10, or with
# peer state (spare, heals) from node memory at step 11, or 10 if step 11's copy was still on its way. The first
# step of a run takes up to ~0.9 s here, which at COMMON's factor of 50 is a 45 s timeout: gloo's 30 s would
# come first, and a 25 s partition would heal unnoticed (as the timeouts table of docs/recovery.md says it should).
# A factor of 15 keeps the timeout near 13 s.
PARTITION_OVERRIDES = ("checkpoint.mode=sync", "fault_tolerance.timeout_safety_factor=15")
PEER_STATE = ("peer_state.enabled=true", "peer_state.interval=1")
PARTITIONED = replace(TWO_NODES, netns=True)  # each node on its own emulated machine
CASES = {
    # for good; the spare (node 2) takes node 1's place long before the pod would be replaced
    "spare": (replace(PARTITIONED, spares=1, replacement_delay_s=60), PEER_STATE, "partition@12:node=1"),
    # back after 25 s, before Kubernetes would replace the pod: node 1 rejoins with new ranks, and its copies
    # in node memory with them
    "heals": (replace(PARTITIONED, replacement_delay_s=60), PEER_STATE, "partition@12:node=1:duration=25"),
    # unreachable for 2 s: its pod is replaced on a new machine; the old one is back at 6 s, and its
    # processes, left running all along, are killed then (the survivors' collectives fail on it)
    "evicted": (replace(PARTITIONED, replacement_delay_s=2), (), "partition@12:node=1:duration=6"),
}
DETECTED_BY_NVRX = ("spare", "heals")  # evicted: the controller's eviction comes first


@pytest.fixture(scope="module")
def partition_run(tmp_path_factory):
    """partition_run(name): the run of CASES[name], run once per session."""
    def get(name):
        shape, overrides, spec = CASES[name]
        return once_per_session(tmp_path_factory, f"partition-{name}", lambda run_dir: completed(run_local(
            run_dir, *shape.argv(), *COMMON, *PARTITION_OVERRIDES, *overrides, "--faults", spec,
            timeout=300)))
    return get


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_a_partitioned_node_is_detected_and_the_run_resumes_exactly(name, partition_run, reference, scratch):
    run = partition_run(name)
    [injected] = events_named(run.run_dir, "fault_injected")
    first = min((e for e in events_named(run.run_dir, "fault_detected") if e["t"] > injected["t"]), key=lambda e: e["t"])
    if name in DETECTED_BY_NVRX:
        assert first["by"].startswith("nvrx rank monitor") and "Section 'step' has been open" in first["detail"]
    assert first["t"] - injected["t"] < COLLECTIVE_TIMEOUT_S  # not gloo's timeout
    first_start, resumed = [(e["step"], e["source_kind"]) for e in events_named(run.run_dir, "resume")]
    assert first_start == (0, "none") and resumed in ([(11, "peer"), (10, "peer")] if CASES[name][1] else [(10, "disk")])
    [fault] = build_report(read_events(run.run_dir)).faults[:1]
    assert fault.kind == "partition" and fault.resumed_from == resumed[0] and 0 < fault.detection_s < fault.recovery_s
    if CASES[name][1]:  # node memory: at most peer_state.interval (1) step lost, 1 if step 11's copy was in flight
        assert fault.steps_lost is not None and fault.steps_lost <= 1
    assert_bitwise_equal(load_final_state(run.run_dir, scratch), load_final_state(reference.run_dir, scratch))


def _generations(run) -> list[int]:
    return [e["generation"] for e in events_named(run.run_dir, "ckpt_committed")]


@pytest.mark.slow
def test_a_healed_node_rejoins_with_new_ranks_not_its_old_ones(partition_run):
    run = partition_run("heals")
    gens = _generations(run)
    assert gens == sorted(gens) and gens[0] < gens[-1]  # every save after the partition: a newer worker group
    log = (run.run_dir / "logs" / "node1.log").read_text()
    assert log.count("Assigned active rank") >= 2  # node 1's launcher joined a second round, with new workers
    assert not events_named(run.run_dir, "node_replaced")  # back before Kubernetes would have replaced it
    assert "node 1's old machine node1-m1 is back on the network" in run.output


@pytest.mark.slow
def test_an_evicted_nodes_old_processes_are_killed_when_its_link_comes_back(partition_run):
    run = partition_run("evicted")
    [replaced] = events_named(run.run_dir, "node_replaced")
    assert replaced["node"] == 1
    assert "kills the evicted pod's processes" in run.output
    assert not [p for p in psutil.process_iter(["cmdline"]) if str(run.run_dir) in " ".join(p.info["cmdline"] or [])]


@pytest.mark.slow
def test_a_spare_takes_a_cut_off_nodes_place(partition_run):
    run = partition_run("spare")
    assert "Assigned active rank" in (run.run_dir / "logs" / "node2.log").read_text()
    assert not events_named(run.run_dir, "node_replaced")  # no Kubernetes replacement was needed
