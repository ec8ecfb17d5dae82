"""The rank's runtime: what `ft_launcher … -m training.train --config FILE` runs in every rank process. The
training loop (`trainer`), the recovery tiers (in-memory rollback, peer state, checkpoints), NVRx's rank
monitor and in-process Wrapper, drains, fault injection, live metrics."""
