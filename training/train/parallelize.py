"""FSDP2 wrapping: `fully_shard` per transformer block and at the root (as torchtitan).
On CUDA: bf16 compute with fp32 gradient reduction, and activation checkpointing per block."""
from __future__ import annotations

import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from training.models.llama import Transformer
from training.train.distributed import DistInfo


def parallelize(model: Transformer, info: DistInfo) -> Transformer:
    mesh = init_device_mesh(info.device.type, (info.world_size,))
    on_cuda = info.device.type == "cuda"
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if on_cuda else MixedPrecisionPolicy()
    for name, block in list(model.layers.items()):
        if on_cuda:
            # recompute activations in backward: trades ~30% compute for memory on big presets
            block = checkpoint_wrapper(block, preserve_rng_state=False)
            model.layers[name] = block
        # the last block's parameters are needed right away in backward: keep them unsharded
        fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=name != str(len(model.layers) - 1))
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model
