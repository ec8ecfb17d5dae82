"""The torch-free contract between the rooms: the training config, exit codes, the event log, file helpers,
launcher arguments and environment names, fault specs, model shapes and FLOPs, Kubernetes' delays. The
Kubernetes charts (k8s/), the local cluster, the tools and the bench import it; it imports nothing else of
training/ and never torch."""
