"""Emulated machines with their own network, for the local cluster (`training.local --netns`).

Each machine is a Linux network namespace on a bridge in the host's namespace (`VirtualNetwork`), so the
rendezvous, gloo and NVRx traffic between emulated nodes crosses a real (virtual) network, and a partition
is a link taken down (`VirtualNetwork.set_link`): established connections stall, as behind a dead switch
port, rather than being reset. Needs root (CAP_NET_ADMIN) and iproute2's `ip` and util-linux's `unshare`;
`unavailable_reason()` says what is missing. Everything is removed by `VirtualNetwork.close()`.
"""
from __future__ import annotations

import ipaddress
import os
import random
import shutil
import subprocess
import uuid
from dataclasses import dataclass
from pathlib import Path

NETNS_ETC = Path("/etc/netns")  # ip netns exec bind-mounts /etc/netns/<ns>/<file> over /etc/<file>
SUBNETS = ipaddress.ip_network("10.200.0.0/13")  # /24s are drawn from here; the host's own are avoided


class NetworkUnavailable(RuntimeError):
    """The machine cannot build namespaces; the message says what is missing."""


@dataclass(frozen=True)
class Machine:
    namespace: str
    hostname: str
    address: str
    host_link: str  # the host's end of its veth pair: down is a partition


def unavailable_reason() -> str | None:
    """Why network namespaces cannot be built here, or None when they can."""
    if os.geteuid() != 0:
        return "network namespaces need root (CAP_NET_ADMIN); run as root or leave out --netns"
    missing = [tool for tool in ("ip", "unshare") if shutil.which(tool) is None]
    if missing:
        return f"{' and '.join(missing)} not found (iproute2, util-linux); install them or leave out --netns"
    probe = f"tl-probe-{uuid.uuid4().hex[:6]}"  # a namespace with a bridge and a veth pair, as a network needs
    try:
        _ip("netns", "add", probe)
    except NetworkUnavailable as err:
        return f"cannot create a network namespace: {err}"
    try:
        _ip("-n", probe, "link", "add", "probe-br", "type", "bridge")
        _ip("-n", probe, "link", "add", "probe-a", "type", "veth", "peer", "name", "probe-b")
    except NetworkUnavailable as err:
        return f"cannot create a bridge or veth pair: {err}"
    finally:
        subprocess.run(["ip", "netns", "delete", probe], capture_output=True)
    return None


def _ip(*args: str) -> None:
    result = subprocess.run(["ip", *args], capture_output=True, text=True)
    if result.returncode != 0:
        raise NetworkUnavailable(f"`ip {' '.join(args)}` failed: {result.stderr.strip()}")


def _free_subnet() -> ipaddress.IPv4Network:
    """A /24 of SUBNETS that no interface of the host is in (another run's bridge, a real network)."""
    shown = subprocess.run(["ip", "-o", "-4", "addr", "show"], capture_output=True, text=True).stdout
    used = {ipaddress.ip_interface(word).network for line in shown.splitlines()
            for word in line.split() if "/" in word and word[0].isdigit()}
    candidates = [net for net in SUBNETS.subnets(new_prefix=24) if not any(net.overlaps(u) for u in used)]
    return random.choice(candidates)


class VirtualNetwork:
    """A bridge in the host's namespace and the machines on it, in a private /24. Names carry a short tag so
    that runs side by side do not clash. The host keeps the bridge's address (.1): the rendezvous store
    listens there, as the store pod does on a system node."""

    def __init__(self) -> None:
        reason = unavailable_reason()
        if reason:
            raise NetworkUnavailable(reason)
        self.tag = uuid.uuid4().hex[:8]
        self.subnet = _free_subnet()
        hosts = self.subnet.hosts()
        self.host_address = str(next(hosts))  # the bridge's: the host side (the rendezvous store)
        self._addresses = hosts
        self.bridge = f"tlb{self.tag}"
        self.machines: list[Machine] = []
        _ip("link", "add", self.bridge, "type", "bridge")
        # A bridge takes the lowest MAC address of its ports unless given one: each machine added (a spare, a
        # replacement) could change it, and the other machines' ARP entries for the host would go stale,
        # cutting them off from the store for a minute or more. A fixed, locally administered address does not move.
        _ip("link", "set", self.bridge, "address", "02:00:" + ":".join(self.tag[i:i + 2] for i in range(0, 8, 2)))
        _ip("addr", "add", f"{self.host_address}/{self.subnet.prefixlen}", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")

    def add_machine(self, hostname: str) -> Machine:
        """A new machine on the bridge, its link up: a network namespace whose interface (eth0, one end of a
        veth pair) hangs off the bridge, with its own address in the private /24, its own hostname (`command`)
        and the host's file system."""
        n = len(self.machines)
        machine = Machine(f"tl-{self.tag}-m{n}", hostname, str(next(self._addresses)), f"tl{self.tag}h{n}")
        self.machines.append(machine)
        inner = f"tl{self.tag}p{n}"
        _ip("netns", "add", machine.namespace)
        _ip("link", "add", machine.host_link, "type", "veth", "peer", "name", inner)
        _ip("link", "set", inner, "netns", machine.namespace)
        _ip("-n", machine.namespace, "link", "set", inner, "name", "eth0")
        _ip("-n", machine.namespace, "addr", "add", f"{machine.address}/{self.subnet.prefixlen}", "dev", "eth0")
        _ip("-n", machine.namespace, "link", "set", "eth0", "up")
        _ip("-n", machine.namespace, "link", "set", "lo", "up")
        _ip("link", "set", machine.host_link, "master", self.bridge)
        _ip("link", "set", machine.host_link, "up")
        (NETNS_ETC / machine.namespace).mkdir(parents=True, exist_ok=True)
        self._write_hosts()
        return machine

    def _write_hosts(self) -> None:
        """Every machine's name on every machine, as the cluster's DNS resolves every pod's FQDN (torchft's
        Manager advertises its hostname to the other replica groups). Truncated and written in place, not
        replaced: `ip netns exec` bind-mounts the file, so processes already running see a machine added later."""
        names = "".join(f"{m.address} {m.hostname}\n" for m in self.machines)
        for machine in self.machines:
            (NETNS_ETC / machine.namespace / "hosts").write_text(f"127.0.0.1 localhost\n{names}")

    def command(self, machine: Machine, argv: list[str]) -> list[str]:
        """`argv` run on `machine`: in its network namespace, under its own hostname (exec all the way
        down, so the process started is `argv`'s, with its pid). The hostname is a UTS namespace per node:
        `hostname` resolves to the machine's address, as in a pod, through /etc/netns/<ns>/hosts that
        `ip netns exec` mounts over /etc/hosts."""
        return ["ip", "netns", "exec", machine.namespace, "unshare", "--uts", "--",
                "sh", "-c", 'hostname "$0" && exec "$@"', machine.hostname, *argv]

    def set_link(self, machine: Machine, up: bool) -> None:
        """Take `machine`'s link up or down. Down is a partition: established connections stall, as behind a
        dead switch port, rather than being reset."""
        _ip("link", "set", machine.host_link, "up" if up else "down")

    def close(self) -> None:
        """Remove every namespace, link and hosts file of this network (processes still inside a
        namespace keep it alive but unreachable: the caller stops them first)."""
        for machine in self.machines:
            subprocess.run(["ip", "netns", "delete", machine.namespace], capture_output=True)
            subprocess.run(["ip", "link", "delete", machine.host_link], capture_output=True)
            shutil.rmtree(NETNS_ETC / machine.namespace, ignore_errors=True)
        subprocess.run(["ip", "link", "delete", self.bridge], capture_output=True)
        self.machines = []
