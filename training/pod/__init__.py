"""The pod's processes around ft_launcher: the pod's PID 1 (`launch`), pre-forked workers (`prefork`) and
the rendezvous store's PID 1 (`store`)."""
