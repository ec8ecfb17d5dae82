"""`make bench`: checkpoint stall, recovery per mechanism and goodput under faults, measured in one run.

    python -m bench.run [--quick]          # CPU, local emulated cluster
    bench/gpu.sh                           # one GPU: 1b preset, NCCL, NVRx async checkpoints

Modules, one job each: profile (run sizes), floor (process start-up floor), stall (sync vs async
checkpoint blocking), cluster (local-cluster runs with bench-driven faults), mechanisms (recovery
mechanisms and their fault runs), rollback (the in-memory rollback's cost), checks (figures against
reference and targets), results (the JSON), table (Markdown), plot (PNG), run (the CLI).
"""
