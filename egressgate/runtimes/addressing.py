"""One /30 of `runtime.subnet` per run: host end .1, sandbox end .2 of the slot.

Slots are taken under an exclusive flock on `state_dir/addresses.lock` and recorded in the run record
(`slot`) before the lock is released, so two parallel runs never get the same addresses. A slot stays
taken while its record exists: a run killed with SIGKILL holds its slot until `sandbox gc` removes the
record (its veth may still exist until then, and reusing its address would route to it). Admission
refuses an address a live sandbox holds (admin/server.py), a second guard against reuse.

The run's host uid/gid (runtimes/identity.py) is taken under the same lock and written in the same
record: one lock, one write, and a run never holds an address without its identity or the reverse.
"""

from __future__ import annotations

import fcntl
import ipaddress
import os
from pathlib import Path

from egressgate.runtimes import identity, records
from egressgate.runtimes.base import SandboxAddress


class AddressesExhausted(RuntimeError):
    """Every /30 of the subnet is held by a run record: run `sandbox gc` or widen runtime.subnet."""


def slot_address(subnet: str, slot: int, run_id: str) -> SandboxAddress:
    net = ipaddress.ip_network(subnet)
    base = int(net.network_address) + 4 * slot
    if base + 3 > int(net.broadcast_address):
        raise AddressesExhausted(f"slot {slot} is outside {subnet}")
    return SandboxAddress(host_ip=str(ipaddress.IPv4Address(base + 1)), sandbox_ip=str(ipaddress.IPv4Address(base + 2)),
                          prefix_len=30, host_if=f"egh{run_id}", sandbox_if=f"egs{run_id}")


def allocate(state_dir: Path, subnet: str, run_id: str, record: dict) -> SandboxAddress:
    """Take the lowest free slot and write the run's first record (with `record`'s fields) under the lock."""
    return allocate_run(state_dir, subnet, run_id, record)[0]


def allocate_run(state_dir: Path, subnet: str, run_id: str, record: dict,
                 uid_range: tuple[int, int] | None = None) -> tuple[SandboxAddress, int | None]:
    """`allocate`, plus (with `uid_range`) the lowest free uid of it (record fields `uid` and `gid`, the same
    number), both under the lock. Returns (address, uid or None)."""
    uid = None
    state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    slots = ipaddress.ip_network(subnet).num_addresses // 4
    fd = os.open(state_dir / "addresses.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        existing = list(records.all_records(state_dir))
        taken = {r.get("slot") for r in existing}
        slot = next((i for i in range(slots) if i not in taken), None)
        if slot is None:
            raise AddressesExhausted(f"all {slots} /30 slots of runtime.subnet {subnet} are held by run records "
                                     f"in {records.runs_dir(state_dir)}: run `egressgate sandbox gc`")
        address = slot_address(subnet, slot, run_id)
        if uid_range is not None:
            uid = identity.pick({r.get("uid") for r in existing if isinstance(r.get("uid"), int)}, *uid_range,
                                where=str(records.runs_dir(state_dir)))
            record = {**record, "uid": uid, "gid": uid}
        records.write(state_dir, run_id, {**record, "run_id": run_id, "slot": slot, "subnet": subnet,
                                          "host_ip": address.host_ip, "sandbox_ip": address.sandbox_ip,
                                          "host_if": address.host_if, "sandbox_if": address.sandbox_if})
        return address, uid
    finally:
        os.close(fd)  # releases the lock
