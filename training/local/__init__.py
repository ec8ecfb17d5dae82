"""The local cluster: `python -m training.local` plays the Indexed Job, its nodes and their network on one
machine (`cluster`; `netns` for nodes with their own addresses)."""
