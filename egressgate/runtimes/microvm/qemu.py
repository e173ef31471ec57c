"""The QEMU command line of one microVM (pure: `argv` builds it from file descriptor numbers) and the
accelerator probe.

Machine: QEMU's `microvm` (no PCI, no firmware tables beyond ACPI for virtio-mmio, no legacy devices), the
uncompressed kernel through its PVH entry, `-nodefaults -no-user-config`, `-no-reboot` (the guest's reboot
ends QEMU: that is how init.sh powers off) and no serial port. Devices, and nothing else: the root image
(virtio-blk, read-only), the workspace image (virtio-blk), one virtio-net on the tap the host created in
the sandbox's network namespace (passed as an fd), virtio-rng, and one virtio-serial device with the
run's ports. No vsock device, no 9p, no shared memory with the host. Every file QEMU uses is an fd
`sandbox run` opened (kernel and initramfs through /proc/self/fd, drives through -add-fd), so QEMU needs
no path access and runs as the run's own uid under `-sandbox on` (seccomp: no obsolete syscalls, no
privilege changes, no fork/exec, no scheduler/resource changes).

Accelerator: KVM when it actually runs this kernel (probed once per host kernel, QEMU and guest kernel, and
cached), else TCG. /dev/kvm existing is not enough: on these machines it is a software "PVM" on which a
stock kernel dies with an emulation failure. TCG is a separate guest kernel but not hardware isolation; the
run says which it got (stderr and the audit record's `egressgate.run.accel`).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import time
from pathlib import Path
from typing import NamedTuple

QEMU = "qemu-system-x86_64"
PORTS = ("eg.in", "eg.status", "eg.stdin", "eg.stdout", "eg.stderr", "eg.out")  # virtio-serial port names (init.sh)
SECCOMP = "on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny"
PROBE_TIMEOUT = 10.0  # KVM boots to init in well under a second; a PVM host pauses the guest on its error


class Fds(NamedTuple):
    """The fds (inherited by QEMU) of one VM."""

    kernel: int
    initrd: int
    root: int
    workspace: int | None  # read-write
    workspace_ro: int | None  # the same image read-only: QEMU's fdset hands out an fd whose access
    # mode matches each open it makes (it probes read-only first), so the set holds both
    tap: int
    ports: dict[str, int]  # port name → connected socket (QEMU's end)


def host_khz() -> int:
    """The host TSC frequency in kHz for `tsc_early_khz` (TCG's guest TSC runs on the host's): without
    it some TCG boots hang in the kernel's clock calibration."""
    with contextlib.suppress(OSError, ValueError):
        return int(Path("/sys/devices/system/cpu/cpu0/tsc_freq_khz").read_text())
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("cpu MHz"):
                return int(float(line.split(":")[1]) * 1000)
    return 2_000_000


def kernel_cmdline(accel: str, probe: bool = False) -> str:
    """Nothing of the run is here (the command line is world-readable on the host): the run comes over
    eg.in. `reboot=t` + QEMU's -no-reboot: a guest reboot (init's power-off, a panic) ends QEMU."""
    args = [
        "console=none",
        "quiet",
        "loglevel=1",
        "reboot=t",
        "panic=-1",
        "rdinit=/init",
        "random.trust_cpu=on",
        "8250.nr_uarts=0",
        "cryptomgr.notests",
        "nomodeset",
    ]
    if accel == "tcg":
        # TCG does not execute speculatively: the guest's Spectre/Meltdown mitigations only cost time there
        # (under KVM the real CPU speculates, so they stay on)
        args += [f"tsc_early_khz={host_khz()}", "mitigations=off"]
    if probe:
        args.append("egressgate.probe=1")
    return " ".join(a for a in args if a)


def argv(
    fds: Fds, accel: str, memory_mb: int, vcpus: int, mac: str, probe: bool = False, qemu: str = QEMU
) -> list[str]:
    """The whole QEMU command line (fd numbers only; see the module docstring)."""
    # TCG: the baseline x86-64 model (`max` adds AVX and friends, which TCG emulates slowly: ~15% more CPU
    # to boot); KVM: the host's CPU
    accel_args = ["-accel", "kvm", "-cpu", "host"] if accel == "kvm" else ["-accel", "tcg,tb-size=32", "-cpu", "qemu64"]
    out = [
        qemu,
        "-M",
        "microvm,isa-serial=off,pic=off,pit=off,rtc=on",
        *accel_args,
        "-m",
        f"{memory_mb}M",
        "-smp",
        str(vcpus),
        "-nodefaults",
        "-no-user-config",
        "-display",
        "none",
        "-no-reboot",
        "-sandbox",
        SECCOMP,
        "-kernel",
        f"/proc/self/fd/{fds.kernel}",
        "-initrd",
        f"/proc/self/fd/{fds.initrd}",
        "-append",
        kernel_cmdline(accel, probe),
        "-add-fd",
        f"fd={fds.root},set=1",
        "-drive",
        "id=root,if=none,format=raw,readonly=on,file=/dev/fdset/1",
        "-device",
        "virtio-blk-device,drive=root",
    ]
    if fds.workspace is not None:
        out += ["-add-fd", f"fd={fds.workspace},set=2"]
        if fds.workspace_ro is not None:
            out += ["-add-fd", f"fd={fds.workspace_ro},set=2"]
        out += [
            "-drive",
            "id=ws,if=none,format=raw,cache=unsafe,discard=unmap,file=/dev/fdset/2",
            "-device",
            "virtio-blk-device,drive=ws",
        ]
    out += [
        "-netdev",
        f"tap,id=net0,fd={fds.tap}",
        "-device",
        f"virtio-net-device,netdev=net0,mac={mac}",
        "-object",
        "rng-random,id=rng0,filename=/dev/urandom",
        "-device",
        "virtio-rng-device,rng=rng0",
        "-device",
        "virtio-serial-device,max_ports=8",
    ]
    for nr, name in enumerate(PORTS, start=1):
        out += [
            "-chardev",
            f"socket,id=p{nr},fd={fds.ports[name]}",
            "-device",
            f"virtserialport,chardev=p{nr},name={name},nr={nr}",
        ]
    return out


def mac_of(run_id: str) -> str:
    """A locally administered unicast MAC derived from the run id."""
    raw = bytes.fromhex(run_id[:10].rjust(10, "0"))
    return "02:" + ":".join(f"{b:02x}" for b in raw)


# ------------------------------------------------------------------------------------------- accel
def kvm_usable() -> bool:
    return os.path.exists("/dev/kvm") and os.access("/dev/kvm", os.R_OK | os.W_OK)


def probe_key(kernel: Path) -> str:
    qemu_version = ""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        qemu_version = subprocess.run(
            [QEMU, "--version"], capture_output=True, text=True, check=False, timeout=30
        ).stdout.split("\n")[0]
    return f"{os.uname().release}|{qemu_version}|{kernel.name}"


def accel(kernel: Path, initrd: Path, cache: Path) -> str:
    """ "kvm" when a probe boot under KVM reached init (cached per probe_key in `cache`), else "tcg".
    `EGRESSGATE_MICROVM_ACCEL=tcg|kvm` forces one (tests; an operator who knows)."""
    forced = os.environ.get("EGRESSGATE_MICROVM_ACCEL")
    if forced in ("tcg", "kvm"):
        return forced
    if not kvm_usable():
        return "tcg"
    key = probe_key(kernel)
    with contextlib.suppress(OSError, ValueError):
        data = json.loads(cache.read_text())
        if data.get("key") == key and data.get("accel") in ("kvm", "tcg"):
            return str(data["accel"])
    result = "kvm" if probe_boot(kernel, initrd) else "tcg"
    tmp = cache.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps({"key": key, "accel": result, "probed": time.time()}))
    tmp.replace(cache)
    return result


def probe_boot(kernel: Path, initrd: Path, timeout: float = PROBE_TIMEOUT) -> bool:
    """Boot the guest under KVM with no disk or network to init's probe marker on eg.status."""
    opened: list[int] = []
    pairs = {name: socket.socketpair() for name in PORTS}
    try:
        k = os.open(kernel, os.O_RDONLY)
        i = os.open(initrd, os.O_RDONLY)
        opened += [k, i]
        null_root = os.open("/dev/null", os.O_RDONLY)
        opened.append(null_root)
        args = [
            QEMU,
            "-M",
            "microvm,isa-serial=off",
            "-accel",
            "kvm",
            "-cpu",
            "host",
            "-m",
            "128M",
            "-nodefaults",
            "-no-user-config",
            "-display",
            "none",
            "-no-reboot",
            "-kernel",
            f"/proc/self/fd/{k}",
            "-initrd",
            f"/proc/self/fd/{i}",
            "-append",
            kernel_cmdline("kvm", probe=True),
            "-device",
            "virtio-serial-device",
        ]
        for nr, name in enumerate(PORTS, start=1):
            args += [
                "-chardev",
                f"socket,id=p{nr},fd={pairs[name][1].fileno()}",
                "-device",
                f"virtserialport,chardev=p{nr},name={name},nr={nr}",
            ]
        passed = [*opened, *(p[1].fileno() for p in pairs.values())]
        proc = subprocess.Popen(
            args, pass_fds=passed, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        for _, theirs in pairs.values():
            theirs.close()
        status = pairs["eg.status"][0]
        status.settimeout(timeout)
        got = b""
        with contextlib.suppress(OSError):
            while b"\n" not in got:
                chunk = status.recv(64)
                if not chunk:
                    break
                got += chunk
        proc.kill()
        proc.wait()
        return got.startswith(b"probe-ok")
    except OSError:
        return False
    finally:
        for fd in opened:
            os.close(fd)
        for ours, theirs in pairs.values():
            ours.close()
            theirs.close()
