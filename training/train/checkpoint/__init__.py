"""Checkpoints in torch.distributed.checkpoint (DCP) format: sharded, loadable without NVRx, and either
complete or invisible. layout.py: the directory's names and every file operation of the commit protocol
(atomic rename, fencing by generation, the resume-step file, setting damaged checkpoints aside);
inspection.py: what evidence of damage sets a checkpoint aside; writers.py: the sync and async DCP writers
(torch's on CPU, NVRx's on CUDA) and the fault-injection hook; writer_process.py: the process that writes an
async save's shards on CPU, through direct_io.py (files written around the page cache); manager.py:
CheckpointManager, which runs them on every rank: when to save, commit, prune and load."""
