"""The pod's processes around ft_launcher: the pod's PID 1 (launch.py), pre-forked workers (prefork.py) and
the rendezvous store's PID 1 (store.py)."""
