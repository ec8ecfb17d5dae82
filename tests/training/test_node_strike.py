"""The node fault's strike (training/train/node_strike.py): a process of its own, so that a node lost in
the same step as another is lost even if its firing rank died first (a broken collective), and node faults
of one step land together."""
from __future__ import annotations

import subprocess
import sys
import time

import psutil

from training.train import node_strike

FAKE_NODE = ("import subprocess, time; kids = [subprocess.Popen(['sleep', '60']) for _ in range(2)]; "
             "print(*(k.pid for k in kids), flush=True); time.sleep(60)")


def fake_node() -> tuple[subprocess.Popen, int, int]:
    """A node's top process with two processes under it: the firing rank and another."""
    top = subprocess.Popen([sys.executable, "-c", FAKE_NODE], stdout=subprocess.PIPE, text=True)
    rank, other = map(int, top.stdout.readline().split())
    return top, rank, other


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def gone_within(seconds: float, *pids: int) -> bool:
    deadline = time.monotonic() + seconds
    while any(map(alive, pids)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not any(map(alive, pids))


def strike(top: int, rank: int, *wait_for: str, marker: str = "") -> subprocess.Popen:
    """A striker started ahead, as a rank that may fire a node fault starts it, then told to strike now."""
    striker = subprocess.Popen([sys.executable, "-m", "training.train.node_strike"], stdin=subprocess.PIPE,
                               start_new_session=True)
    striker.stdin.write(node_strike.Strike(time.monotonic(), 9, top, rank, wait_for, marker).line())
    striker.stdin.flush()
    return striker


def test_the_strike_waits_for_the_other_node_faults_of_its_step_then_kills_the_whole_node(tmp_path):
    top, rank, other = fake_node()
    fired, lost = tmp_path / "node-loss@12:node=1", tmp_path / "lost" / "node1"
    striker = strike(top.pid, rank, str(fired), marker=str(lost))
    time.sleep(1.0)
    assert striker.poll() is None and all(map(alive, (top.pid, rank, other))), "struck before the other fault fired"
    assert not lost.exists()
    fired.write_text("node-loss@12:node=1")
    assert striker.wait(timeout=10) == 0
    assert top.wait(timeout=10) == -9
    assert gone_within(10, rank, other)
    assert lost.exists()  # what tells the local controller that the node was lost, not its PID 1 killed alone


def test_a_rank_gone_before_the_strike_leaves_no_survivor_on_its_node():
    """The late node's rank died of the early node's loss (its collective broke) before its strike: the
    strike still takes the rest of that node, whose memory holds the peer-state copies."""
    top, rank, other = fake_node()
    psutil.Process(rank).kill()
    assert strike(top.pid, rank).wait(timeout=10) == 0
    assert top.wait(timeout=10) == -9
    assert gone_within(10, other)


def test_a_striker_whose_rank_ends_without_firing_leaves():
    striker = subprocess.Popen([sys.executable, "-m", "training.train.node_strike"], stdin=subprocess.PIPE)
    striker.stdin.close()
    assert striker.wait(timeout=30) == 0


def test_it_strikes_without_the_other_fault_after_its_longest_wait(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(node_strike, "WAIT_S", 0.2)
    victim = subprocess.Popen(["sleep", "60"])
    node_strike.strike(time.monotonic(), node_strike.signal.SIGKILL, psutil.Process(victim.pid), None,
                       [str(tmp_path / "never")])
    assert victim.wait(timeout=10) == -9
    assert "striking without waiting further" in capsys.readouterr().err
