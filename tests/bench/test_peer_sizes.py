"""bench/peer_sizes.py: peer state measured end to end at a preset's state (the bench's row per size)."""
from __future__ import annotations

from bench.peer_sizes import measure_peer_sizes
from training.contract.shapes import STATE_BYTES_PER_PARAMETER, parameter_count


def test_copy_send_and_restore_are_measured_at_the_presets_state():
    [tiny] = measure_peer_sizes(("tiny",))  # raises unless the spare restored the last saved step
    assert tiny.bytes_per_rank == STATE_BYTES_PER_PARAMETER * parameter_count("tiny") // 2
    assert tiny.copy_s > 0 and tiny.send_s > 0 and tiny.restore_s > 0 and tiny.checksum_s > 0
