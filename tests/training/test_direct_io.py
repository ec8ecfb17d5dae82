"""Shard files written around the page cache (training/train/checkpoint/direct_io.py)."""
from __future__ import annotations

import errno
import os

import pytest
import torch
import torch.distributed.checkpoint as dcp

from training.train.checkpoint import direct_io
from training.train.checkpoint.direct_io import BLOCK, CHUNK, DirectFileSystem, open_direct


@pytest.mark.parametrize("sizes", [
    [1],  # only a tail: written through the page cache
    [BLOCK],  # one whole block, no tail
    [CHUNK - 3, 5, BLOCK + 7],  # a write that fills the buffer, then a partial one and a tail
    [3 * CHUNK + 11],  # one write of several buffers
])
def test_direct_file_holds_exactly_the_bytes_written(tmp_path, sizes):
    path = tmp_path / "shard"
    pieces = [os.urandom(n) for n in sizes]
    with open_direct(path) as f:
        assert isinstance(f, direct_io.DirectFile)  # the test's file system takes O_DIRECT
        for i, piece in enumerate(pieces):
            assert f.tell() == sum(sizes[:i])
            assert f.write(memoryview(piece)) == len(piece)
            f.flush()  # DCP flushes after each item: no unaligned direct write may follow
        os.fsync(f.fileno())  # DCP asks for the descriptor only to fsync it: the tail is written first
        with pytest.raises(ValueError, match="after its tail"):
            f.write(b"late")
    assert path.read_bytes() == b"".join(pieces)


def test_a_file_system_without_o_direct_gets_a_buffered_file(tmp_path, monkeypatch):
    real_open = os.open

    def refuse_direct(path, flags, *args):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")  # what tmpfs answers
        return real_open(path, flags, *args)

    monkeypatch.setattr(direct_io.os, "open", refuse_direct)
    with open_direct(tmp_path / "shard") as f:
        assert not isinstance(f, direct_io.DirectFile)
        f.write(b"abc")
    assert (tmp_path / "shard").read_bytes() == b"abc"


def test_dcp_saves_through_direct_files_and_loads_back(tmp_path):
    state = {"big": torch.rand(CHUNK // 4 + 1000), "small": torch.arange(7), "step": 3}
    writer = dcp.FileSystemWriter(tmp_path)
    writer.fs = DirectFileSystem()
    dcp.save(state, storage_writer=writer)
    loaded = {"big": torch.zeros_like(state["big"]), "small": torch.zeros_like(state["small"]), "step": 0}
    dcp.load(loaded, checkpoint_id=tmp_path)
    assert torch.equal(loaded["big"], state["big"]) and torch.equal(loaded["small"], state["small"])
    assert loaded["step"] == 3
