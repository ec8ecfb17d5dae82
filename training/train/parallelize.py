"""FSDP2 wrapping of any model spec: `fully_shard` per shard unit (a preset's transformer blocks, a Hugging
Face model's decoder layers) and at the root, as torchtitan. On CUDA: bf16 compute with fp32 gradient
reduction, and activation checkpointing per unit."""
from __future__ import annotations

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from training.train.distributed import DistInfo


def parallelize(model: nn.Module, units: list[tuple[nn.Module, str]], info: DistInfo) -> nn.Module:
    """`units`: (parent, name) of each module sharded on its own, in forward order (ModelSpec.shard_units)."""
    mesh = init_device_mesh(info.device.type, (info.world_size,))
    on_cuda = info.device.type == "cuda"
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if on_cuda else MixedPrecisionPolicy()
    for index, (parent, name) in enumerate(units):
        unit = parent.get_submodule(name)
        if on_cuda:
            # recompute activations in backward: trades ~30% compute for memory on big models
            unit = checkpoint_wrapper(unit, preserve_rng_state=False)
            parent.register_module(name, unit)
        # the last unit's parameters are needed right away in backward: keep them unsharded
        fully_shard(unit, mesh=mesh, mp_policy=mp, reshard_after_forward=index != len(units) - 1)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model
