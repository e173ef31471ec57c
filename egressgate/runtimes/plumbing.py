"""One network plumbing for every runtime: a veth pair from the gateway's namespace into the sandbox's
network namespace (given by path: `/run/netns/NAME` for netns, `/proc/PID/ns/net` for a container),
addresses, the default route, sysctls and the nftables of runtimes/nftables.py.

Order matters (fail closed): the host table goes in before the veth exists, the sandbox side is fully
configured (IPv6 off, defence-in-depth rules) before the workload starts (the adapter starts it after
`attach` returns). Host-side commands run in the caller's namespace (the gateway's); sandbox-side ones
run in a thread that joined the sandbox namespace with setns(2), so any netns path works without
naming it and the children that thread forks (`ip`, `nft`) inherit that namespace.

Used by run.py for every adapter: `Plumbing(run_id, spec.address, endpoints).attach(adapter.netns_path())`
after `adapter.prepare()` and before `adapter.start()`; at teardown `release()` (after the kills, before
the adapter's teardown: counters read, veth deletion started) and `detach()` (after it: the veth gone,
then the table). An adapter only has to provide a network namespace with nothing but `lo` in it
(docker/gvisor: `--network none`).
"""

from __future__ import annotations

import os
import subprocess
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from egressgate.runtimes import nftables
from egressgate.runtimes.base import GatewayEndpoints, SandboxAddress

T = TypeVar("T")


class NetnsTask[T]:
    """`fn` running in a thread joined to the network namespace at `netns_path`: files under /proc/sys/net
    it opens and processes it forks belong to that namespace; the calling thread is untouched. `result`
    joins it (re-raising its error), so the caller can do host-side work meanwhile (start-up budget)."""

    def __init__(self, netns_path: str, fn: Callable[[], T]) -> None:
        self.netns_path = netns_path
        self._fn = fn
        self._box: dict[str, object] = {}
        self._thread = threading.Thread(target=self._run, name="egressgate-netns", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            fd = os.open(self.netns_path, os.O_RDONLY | os.O_CLOEXEC)
            try:
                os.setns(fd, os.CLONE_NEWNET)
            finally:
                os.close(fd)
            self._box["value"] = self._fn()
        except BaseException as exc:  # re-raised in the caller
            self._box["error"] = exc

    def result(self, timeout: float = 30) -> T:
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise RuntimeError(f"configuring the sandbox namespace {self.netns_path} took longer than {timeout}s")
        if "error" in self._box:
            raise self._box["error"]  # type: ignore[misc]
        return self._box["value"]  # type: ignore[return-value]


def in_netns[T](netns_path: str, fn: Callable[[], T], timeout: float = 30) -> T:
    """Run `fn` in the network namespace at `netns_path` and wait for it (see NetnsTask)."""
    return NetnsTask(netns_path, fn).result(timeout)


def write_sysctl(key: str, value: str) -> None:
    Path("/proc/sys", *key.split(".")).write_text(value)


def ip_batch(commands: list[str]) -> None:
    """All link/address/route changes of one side in one `ip -batch -` (one process, stops at the first error)."""
    res = subprocess.run(["ip", "-batch", "-"], input="\n".join(commands) + "\n", capture_output=True,
                         text=True, check=False, timeout=30)
    if res.returncode != 0:
        raise RuntimeError(f"ip -batch failed ({res.returncode}): {res.stderr.strip()}")


class Plumbing:
    """The network side of one run; `detach` is idempotent and safe after a partial `attach`."""

    def __init__(self, run_id: str, address: SandboxAddress, gateway: GatewayEndpoints) -> None:
        self.run_id = run_id
        self.address = address
        self.gateway = gateway
        self.table = nftables.table_name(run_id)
        self.netns_path: str | None = None
        self._unlink: threading.Thread | None = None  # release(): the veth being deleted

    def host_objects(self) -> dict[str, str]:
        """What `attach` creates on the host, for the run record (written before attach)."""
        return {"nft_table": self.table, "host_if": self.address.host_if}

    def attach(self, netns_path: str) -> None:
        a = self.address
        self.netns_path = netns_path
        # The sandbox side's first half (sysctls, its nftables) needs nothing from the host side, so it
        # runs concurrently with it (start-up budget); its second half needs the veth the host side
        # creates. Nothing here lets the workload run: the adapter starts it after attach returns.
        inside = NetnsTask(netns_path, self._prepare_inside)
        try:
            nftables.apply(nftables.host_ruleset(self.run_id, a, self.gateway))
            # one `ip -batch`; addrgenmode none: the host end never gets an IPv6 (link-local) address
            ip_batch([
                f"link add {a.host_if} type veth peer name {a.sandbox_if} netns {netns_path}",
                f"link set dev {a.host_if} addrgenmode none",
                f"addr add {a.host_ip}/{a.prefix_len} dev {a.host_if}",
                f"link set {a.host_if} up",
            ])
            # route_localnet on this interface only: DNAT to listeners on 127.0.0.1 (the input chain admits
            # only those three listeners). Set before the workload starts (after attach returns).
            write_sysctl(f"net.ipv4.conf.{a.host_if}.route_localnet", "1")
            write_sysctl(f"net.ipv6.conf.{a.host_if}.disable_ipv6", "1")
            # strict reverse-path filtering as a second layer under the table's anti-spoofing rule (which is
            # the control, counted and audited): a source not routed back through this veth is dropped
            write_sysctl(f"net.ipv4.conf.{a.host_if}.rp_filter", "1")
        finally:
            inside.result()  # joined whatever happened: no configuration still running during teardown
        in_netns(netns_path, self._configure_inside)

    def _prepare_inside(self) -> None:
        """Before (or while) the veth appears: IPv6 off for every interface the namespace has or will get,
        and the defence-in-depth table (it matches the sandbox link by name, so it may precede it)."""
        for scope in ("all", "default", "lo"):
            write_sysctl(f"net.ipv6.conf.{scope}.disable_ipv6", "1")
        nftables.apply(nftables.sandbox_ruleset(self.address))

    def _configure_inside(self) -> None:
        a = self.address
        # the sandbox end may have been created before `default` was set above: set it before it is up
        write_sysctl(f"net.ipv6.conf.{a.sandbox_if}.disable_ipv6", "1")
        ip_batch([
            "link set lo up",
            f"addr add {a.sandbox_ip}/{a.prefix_len} dev {a.sandbox_if}",
            f"link set {a.sandbox_if} up",
            f"route add default via {a.host_ip} dev {a.sandbox_if}",
        ])

    def drop_counts(self) -> dict[str, int]:
        """What the host table and the sandbox's own table refused (for the revocation's audit record:
        a packet the kernel drops never reaches the gateway). Read before teardown; both tables are read
        concurrently (start-up budget)."""
        inside_task = None
        if self.netns_path is not None:
            inside_task = NetnsTask(self.netns_path, lambda: nftables.drop_counts(nftables.SANDBOX_TABLE))
        counts = nftables.drop_counts(self.table)
        inside: dict[str, int] = {}
        if inside_task is not None:
            try:
                inside = inside_task.result()
            except OSError:  # the namespace is already gone
                inside = {}
        for key, value in inside.items():
            counts[key] = counts.get(key, 0) + value
        return counts

    def release(self) -> dict[str, int]:
        """Teardown, first half: called once the workload is dead and before the adapter removes the
        sandbox namespace. Starts deleting the veth (the kernel takes ~20 ms: RCU grace periods) and
        meanwhile reads both tables' drop counters (final: nothing runs in the sandbox any more). The
        host table stays until `detach` has seen the veth deletion finish."""
        if self._unlink is None:
            self._unlink = threading.Thread(target=delete_link, args=(self.address.host_if,),
                                            name="egressgate-unlink", daemon=True)
            self._unlink.start()
        return self.drop_counts()

    def detach(self) -> None:
        """The veth first, then the host table: never an instant in which the link exists without its
        rules (a veth deletion still running after 30 s fails this step; `sandbox gc` retries)."""
        if self._unlink is not None:
            self._unlink.join(30)
            if self._unlink.is_alive():
                raise RuntimeError(f"deleting {self.address.host_if} took longer than 30s; its table stays")
            self._unlink = None
        delete_link(self.address.host_if)  # no-op (False) after release; the deletion when release never ran
        nftables.delete_table(self.table)


def delete_link(ifname: str) -> bool:
    """Delete a veth by name (its peer goes with it); False when it did not exist."""
    res = subprocess.run(["ip", "link", "del", ifname], capture_output=True, text=True, check=False, timeout=30)
    return res.returncode == 0
