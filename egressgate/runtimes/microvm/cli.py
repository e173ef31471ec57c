"""`egressgate runtime image build`: the microvm runtime's artifacts (guest kernel, initramfs, root image),
registered on the `runtime` group by egressgate/commands.py."""

from __future__ import annotations

import click


@click.group("image")
def image_group() -> None:
    """The microvm runtime's guest kernel and root image (cached under ~/.cache/egressgate/microvm)."""


@image_group.command("build")
@click.option("--suite", default="bookworm", show_default=True, help="Debian suite of the root image")
@click.option(
    "--include",
    "packages",
    default="python3",
    show_default=True,
    help="comma-separated Debian packages added to the essential set (empty: busybox-sized Debian)",
)
@click.option("--mirror", help="Debian mirror (default: the machine's apt source)")
def build_cmd(suite: str, packages: str, mirror: str | None) -> None:
    """Fetch Debian's cloud kernel (apt-get download, extracted, never installed), build the initramfs and
    the default root image (mmdebstrap + mkfs.ext4, cached by recipe); print where they are."""
    from egressgate.runtimes.microvm import artifacts, image, qemu

    try:
        kernel = artifacts.fetch_kernel()
        initrd = artifacts.initramfs(kernel)
        root = image.build(suite, tuple(p for p in packages.split(",") if p), mirror)
    except artifacts.ArtifactError as exc:
        raise click.ClickException(str(exc)) from None
    # the KVM probe (a boot under KVM to init's marker) runs once here, not in the first `sandbox run`
    accel = qemu.accel(kernel / "vmlinux", initrd, artifacts.cache_dir() / "accel.json")
    note = "hardware virtualization" if accel == "kvm" else "software emulation: no hardware isolation"
    click.echo(f"kernel: {kernel / 'vmlinux'}\ninitramfs: {initrd}\nroot image: {root}\naccelerator: {accel} ({note})")


def register(group: click.Group) -> None:
    group.add_command(image_group)
