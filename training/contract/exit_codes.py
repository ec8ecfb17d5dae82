"""Process exit codes with a meaning outside the process (no imports: the k8s charts read it too).

The Kubernetes Job's podFailurePolicy fails the whole Job at once on these instead of retrying pods
that can only fail the same way again.
"""

CONFIG_ERROR = 3  # the training config is invalid, or its checkpoints cannot be loaded: no retry can succeed
# ft_launcher stopped restarting: fault_tolerance.max_restarts restarts in a row made no progress (NVRx
# 0.7.0's --ft-no-restart-exit-code; its default too)
NO_PROGRESS = 93
# SIGTERM: what a process killed by it reports to a shell, and what a rank exits with after a drain
# (training.train.drain), so that ft_launcher and the Job retry it
TERMINATED = 143
# The node's launcher ended cleanly but the run has not completed (no run_end event of a completed run):
# ft_launcher 0.7.0 exits 0 when a standby leaves, or when every rank left cleanly after SIGTERM, which
# an Indexed Job would take for a completed index and never run again. EX_TEMPFAIL: retry the pod.
INCOMPLETE = 75
