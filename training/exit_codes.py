"""Process exit codes with a meaning outside the process (no imports: the k8s charts read it too).

The Kubernetes Job's podFailurePolicy fails the whole Job at once on CONFIG_ERROR instead of
retrying pods that can only fail the same way again.
"""

CONFIG_ERROR = 3  # the training config is invalid: no retry can succeed
