"""Checkpoints in torch.distributed.checkpoint (DCP) format: sharded, loadable without NVRx, and either
complete or invisible. `layout`: the directory's names and every file operation of the commit protocol
(atomic rename, fencing by generation, the resume-step file, setting damaged checkpoints aside);
`inspection`: what evidence of damage sets a checkpoint aside; `writers`: the sync and async DCP writers
(torch's on CPU, NVRx's on CUDA) and the fault-injection hook; `writer_process`: the process that writes an
async save's shards on CPU, through `direct_io` (files written around the page cache); `manager`:
CheckpointManager, which runs them on every rank: when to save, commit, prune and load."""
