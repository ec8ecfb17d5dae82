"""NVRx's rendezvous event names, read from the caller's frame instead of inspect.stack().

NVRx 0.7.0's rendezvous (ft_rendezvous_barrier) names each event it records after the method that records
it, found by calling inspect.stack() twice. That reads the source of every frame on the stack, and
inspect.getmodule scans sys.modules for each (cpython issue 92041): with torch imported, a good part of a
second of CPU per event, several events per rendezvous round on every node, on the path of each restart.
`install` swaps in a frame walk that returns the same name. Cost: none; an NVRx without the function is left
as it is.
"""
from __future__ import annotations

import sys


def caller_name(depth: int = 2) -> str:
    """The name of the function `depth` frames up from this one, as NVRx's get_method_name returns it:
    1 is the caller, 2 the caller's caller; "no_method_name" past the stack's bottom.

    Args:
        depth: how many frames up, 0 being this function's own.
    """
    try:
        return sys._getframe(depth).f_code.co_name
    except ValueError:
        return "no_method_name"


def install() -> None:
    """Make NVRx's rendezvous name its events with `caller_name` (in this process, for what it records
    from now on)."""
    from nvidia_resiliency_ext.fault_tolerance import ft_rendezvous_barrier

    if hasattr(ft_rendezvous_barrier, "get_method_name"):
        ft_rendezvous_barrier.get_method_name = caller_name
