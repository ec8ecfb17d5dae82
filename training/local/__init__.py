"""The local cluster: `python -m training.local` (`cli`) plays the Indexed Job (`cluster`), the kubelet
(`kubelet`), its nodes' logs (`pod_log`) and their network (`netns`, for nodes with their own addresses) on one
machine."""
