"""The microvm runtime's host-side pieces without a boot: the run payload the guest's init sources (the
environment arrives exact, and a hostile value is data, never shell code), the status line, the QEMU
command line (no secret on it), the initramfs archive."""

from __future__ import annotations

import io
import os
import subprocess
import tarfile
from pathlib import Path

import pytest

from egressgate.runtimes.base import ExitInfo, Limit, RunSpec, SandboxAddress
from egressgate.runtimes.microvm import artifacts, qemu
from egressgate.runtimes.microvm.guest import GuestFailed, parse_status, run_payload, sizes

BUSYBOX = "/bin/busybox"
HOSTILE = {
    "TOKEN": "tok'en\"with $(touch {canary}) `touch {canary}` ; touch {canary}\nsecond line",
    "EMPTY": "",
    "PATH": "/usr/bin:/bin",
}


def spec(tmp_path: Path, env: dict[str, str]) -> RunSpec:
    bundle = tmp_path / "ca.pem"
    bundle.write_text("-----BEGIN CERTIFICATE-----\n")
    address = SandboxAddress("198.18.128.1", "198.18.128.2", 30, "egh0123456789", "egs0123456789")
    return RunSpec(
        run_id="0123456789",
        sandbox_id="sbx-x",
        runtime="microvm",
        command=("/bin/echo", "a b", "$(x)"),
        env=env,
        policy={"sandbox": {"name": "unit", "resources": {"memory_mb": 64}}},
        address=address,
        ca_bundle=bundle,
        uid=70001,
        gid=70001,
    )


def unpack(payload: bytes, into: Path) -> None:
    with tarfile.open(fileobj=io.BytesIO(payload)) as tar:
        tar.extractall(into, filter="data")


def guest_env(workdir: Path, env_file: str) -> dict[str, str]:
    """What init.sh's workload sees: busybox sh with an empty environment, its own exports unset, the
    file sourced, then `env -0` as the command."""
    script = f"unset PWD OLDPWD SHLVL PATH HOME TERM; . {env_file}; exec {BUSYBOX} env -0"
    out = subprocess.run(["env", "-i", BUSYBOX, "sh", "-c", script], capture_output=True, cwd=workdir, check=True)
    return dict(item.split("=", 1) for item in out.stdout.decode().split("\0") if item)


def test_environment_arrives_exact_and_inert(tmp_path: Path) -> None:
    canary = tmp_path / "pwned"
    env = {k: v.format(canary=canary) for k, v in HOSTILE.items()}
    unpack(run_payload(spec(tmp_path, env), "/workspace"), tmp_path / "p")
    assert guest_env(tmp_path, str(tmp_path / "p" / "env")) == env
    assert not canary.exists()
    # positive control: the same value written into the file unquoted is shell code that runs
    (tmp_path / "naive").write_text(f"export TOKEN=x$(touch {canary})\n")
    subprocess.run(["env", "-i", BUSYBOX, "sh", "-c", f". {tmp_path / 'naive'}"], capture_output=True, check=False)
    assert canary.exists()


def test_argv_and_config_are_quoted(tmp_path: Path) -> None:
    unpack(run_payload(spec(tmp_path, {"PATH": "/bin"}), None), tmp_path / "p")
    script = f'. {tmp_path / "p" / "argv"}; for a in "$@"; do printf "%s\\0" "$a"; done'
    out = subprocess.run([BUSYBOX, "sh", "-c", script], capture_output=True, check=True).stdout
    assert out.split(b"\0")[:-1] == [b"/bin/echo", b"a b", b"$(x)"]
    config = (tmp_path / "p" / "config").read_text()
    assert "EG_MEM_BYTES=67108864" in config and "EG_WS=''" in config and "EG_UID=70001" in config


def test_a_name_the_shell_cannot_export_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cannot be passed"):
        run_payload(spec(tmp_path, {"BAD-NAME": "x"}), None)


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ("exit 0 oom 0 pids 0 full 0", ExitInfo(status=0)),
        ("exit 3 oom 0 pids 0 full 0", ExitInfo(status=3)),
        ("exit 143 oom 0 pids 0 full 0", ExitInfo(status=None, signal=15)),
        ("exit 137 oom 1 pids 0 full 0", ExitInfo(status=None, signal=9, limit=Limit.MEMORY)),
        ("exit 1 oom 0 pids 2 full 0", ExitInfo(status=1, limit=Limit.PIDS)),
        ("exit 1 oom 0 pids 0 full 1", ExitInfo(status=1, limit=Limit.WORKSPACE_BYTES)),
    ],
)
def test_status_line(line: str, expected: ExitInfo) -> None:
    assert parse_status(line) == expected


@pytest.mark.parametrize("line", ["setup-failed cannot mount the root image", "exit x", "exit 1 oom 0", ""])
def test_bad_status_is_a_failure(line: str) -> None:
    with pytest.raises(GuestFailed):
        parse_status(line)


def test_sizes_and_cmdline_hold_no_secret() -> None:
    assert sizes({"memory_mb": 64, "cpu_millis": 1500}) == (64 + 96, 64, min(2, os.cpu_count() or 1))
    fds = qemu.Fds(
        kernel=3,
        initrd=4,
        root=5,
        workspace=6,
        workspace_ro=8,
        tap=7,
        ports={n: 10 + i for i, n in enumerate(qemu.PORTS)},
    )
    argv = qemu.argv(fds, "tcg", 160, 1, qemu.mac_of("0123456789"))
    joined = " ".join(argv)
    assert "tsc_early_khz=" in joined and "-sandbox" in argv and "vsock" not in joined
    assert "EGRESSGATE" not in joined and "sbx-" not in joined  # the run travels over eg.in only
    assert qemu.mac_of("0123456789") == "02:01:23:45:67:89"


def test_initramfs_is_a_newc_archive(tmp_path: Path) -> None:
    kernel = tmp_path / "kernel-x"
    (kernel / "modules").mkdir(parents=True)
    (kernel / "modules" / "order").write_text("virtio\n")
    (kernel / "modules" / "virtio.ko").write_bytes(b"\x7fELF-module")
    out = tmp_path / "initrd.cpio"
    artifacts.build_initramfs(kernel, out)
    listing = subprocess.run([BUSYBOX, "cpio", "-t"], stdin=out.open("rb"), capture_output=True, check=True)
    names = set(listing.stdout.decode().split())
    assert {"init", "bin/busybox", "bin/sh", "lib/modules/virtio.ko", "etc/modules"} <= names
    extract = tmp_path / "x"
    extract.mkdir()
    subprocess.run([BUSYBOX, "cpio", "-id"], stdin=out.open("rb"), cwd=extract, capture_output=True, check=True)
    assert (extract / "init").read_bytes() == artifacts.INIT.read_bytes()
    assert (extract / "bin" / "sh").is_symlink()


def hostile_tar(path: Path, escape: Path) -> None:
    """What an exploited guest kernel could send back as a workspace: a path out of the tree, a link out of
    it, a set-id file, a device, next to ordinary content."""
    with tarfile.open(path, "w") as tar:

        def add(name: str, data: bytes = b"", **fields: object) -> None:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            for key, value in fields.items():
                setattr(info, key, value)
            tar.addfile(info, io.BytesIO(data) if data else None)

        add("./ok.txt", b"fine\n", uid=70001, gid=70001)
        add(f"./../{escape.name}", b"escaped\n")
        add("./out", type=tarfile.SYMTYPE, linkname="../")
        add("./suid", b"#!/bin/sh\n", mode=0o4755)
        add("./dev", type=tarfile.CHRTYPE, devmajor=1, devminor=3)
        add("./lost+found", type=tarfile.DIRTYPE)


def test_copy_back_keeps_the_guest_inside_the_workspace(tmp_path: Path) -> None:
    from egressgate.runtimes.microvm import export

    workspace = tmp_path / "ws"
    workspace.mkdir()
    (workspace / "old.txt").write_text("before the run\n")
    escape = tmp_path / "escaped.txt"
    spool = tmp_path / "export.tar"
    hostile_tar(spool, escape)
    count, skipped = export.sync_back(spool, workspace, "0123456789", had_lost_found=False)
    assert sorted(p.name for p in workspace.iterdir()) == ["ok.txt", "suid"]  # old content replaced
    assert set(skipped) == {f"./../{escape.name}", "./out", "./dev"} and count == 2
    assert not escape.exists()
    assert (workspace / "suid").stat().st_mode & 0o7000 == 0 and (workspace / "ok.txt").stat().st_uid == 0
    # positive control: the same archive extracted without the filter writes outside the workspace
    control = tmp_path / "control" / "ws"
    control.mkdir(parents=True)
    with tarfile.open(spool) as tar:
        tar.extractall(control, members=[m for m in tar if m.name.endswith("escaped.txt")], filter="fully_trusted")  # noqa: S202
    assert (tmp_path / "control" / "escaped.txt").read_text() == "escaped\n"


def test_image_given_as_directory_or_ext4_file(tmp_path: Path) -> None:
    """--image: a directory is packed into a cached ext4 image (the same tree → the same image, a changed tree
    → a new one); an ext4 file is used as is; anything else is refused with the command that makes one."""
    from egressgate.runtimes.microvm import image
    from egressgate.runtimes.microvm.artifacts import ArtifactError

    tree = tmp_path / "root"
    (tree / "bin").mkdir(parents=True)
    (tree / "bin" / "hello").write_text("#!/bin/sh\necho hi\n")
    cache = tmp_path / "cache"
    packed = image.resolve(str(tree), base=cache)
    assert packed.read_bytes()[1024 + 56 : 1024 + 58] == b"\x53\xef"  # the ext4 superblock magic
    assert image.resolve(str(tree), base=cache) == packed
    (tree / "bin" / "other").write_text("x")
    assert image.resolve(str(tree), base=cache) != packed
    assert image.resolve(str(packed), base=cache) == packed
    junk = tmp_path / "junk.img"
    junk.write_bytes(b"\0" * 4096)
    with pytest.raises(ArtifactError, match="not an ext4 image"):
        image.resolve(str(junk), base=cache)
    with pytest.raises(ArtifactError, match="runtime image build"):
        image.resolve(None, base=tmp_path / "empty")
