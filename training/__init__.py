"""FSDP2 training with NVIDIA Resiliency Extension fault tolerance."""
