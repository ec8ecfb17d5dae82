"""The ranks' agreements (training.train.agreement) on two gloo ranks forked from the test process, and alone:
every rank ends with the same answer, the one a user of each decision relies on."""
from __future__ import annotations

import json
from datetime import timedelta

import torch.distributed as dist

from training.train.agreement import every, first_found, from_rank0, least, most
from training_helpers import completed_ranks, fork_ranks


def _decide(rank: int) -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=20))
    group = dist.new_group(backend="gloo")
    answers = {
        "least": least(10.0 - rank, 2.5 + rank),  # rank 0 has 10, 2.5; rank 1 has 9, 3.5
        "most": most(10.0 - rank, 2.5 + rank, group=group),
        "every": [every(True), every(rank == 0)],
        "step": least(2**40 + rank)[0],  # a step count stays exact
        "from_rank0": from_rank0(lambda: f"computed on rank {dist.get_rank()}"),
        "first_found": [first_found(lambda: None if rank == 0 else rank), first_found(lambda: None)],
    }
    print(json.dumps(answers))
    dist.destroy_process_group()


def test_every_rank_takes_the_same_decision(tmp_path):
    outputs = completed_ranks(fork_ranks(_decide, tmp_path / "logs"))
    answers = [json.loads(out.strip().splitlines()[-1]) for out in outputs]
    assert answers[0] == answers[1]
    assert answers[0] == {"least": [9.0, 2.5], "most": [10.0, 3.5], "every": [True, False], "step": 2**40,
                          "from_rank0": "computed on rank 0", "first_found": [1, None]}


def test_without_a_process_group_each_computes_alone():
    assert (least(3.0, 1.0), most(2.0), every(False)) == ([3.0, 1.0], [2.0], False)
    assert (from_rank0(lambda: "here"), first_found(lambda: 7)) == ("here", 7)
