"""The cgroup2 path: against a fake cgroup2 tree with controllers (this host's cgroup2 has none: memory, pids
and cpu are bound to its v1 hierarchies, and a controller lives in one hierarchy at a time), and for real on
this host's controller-less cgroup2 (tracking, cgroup.kill, refusal of limits it cannot enforce), including
a cgroup2 hierarchy freshly mounted in a test mount namespace.

The fake plays the kernel's part on mkdir/rmdir only (interface files appear, the child's controllers are
what its parent enabled in cgroup.subtree_control); everything else is the production code reading and
writing files.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from egressgate.runtimes import cgroups
from egressgate.runtimes.base import Limit
from egressgate.runtimes.cgroups import Mounts, read_mounts
from egressgate.runtimes.limits import LimitsUnavailable, ResourceLimits
from tests.runtimes import limits_support
from tests.runtimes.limits_support import PARENT, require_cgroups, run_id, wait_for

runs = limits_support.runs  # the fixture

CONTROLLER_FILES = {
    "memory": {"memory.max": "max\n", "memory.swap.max": "max\n", "memory.oom.group": "0\n", "memory.peak": "0\n",
               "memory.events": "low 0\nhigh 0\nmax 0\noom 0\noom_kill 0\noom_group_kill 0\n"},
    "pids": {"pids.max": "max\n", "pids.events": "max 0\n"},
    "cpu": {"cpu.max": "max 100000\n", "cpu.stat": "usage_usec 0\n"},
}
CORE_FILES = {"cgroup.procs": "", "cgroup.events": "populated 0\nfrozen 0\n", "cgroup.kill": "",
              "cgroup.subtree_control": "", "cgroup.controllers": ""}


class FakeKernel:
    """A cgroup2 root in a temp dir; `missing` names interface files this 'kernel' does not have."""

    def __init__(self, root: Path, controllers: str = "cpu memory pids", missing: tuple[str, ...] = ()):
        self.root, self.missing = root, set(missing)
        root.mkdir()
        for name, text in CORE_FILES.items():
            (root / name).write_text(text)
        (root / "cgroup.controllers").write_text(controllers + "\n")

    def make_dir(self, path: Path) -> None:
        os.mkdir(path)
        enabled = (path.parent / "cgroup.subtree_control").read_text().replace("+", "").split()
        files = dict(CORE_FILES, **{"cgroup.controllers": " ".join(enabled) + "\n"})
        for c in enabled:
            files.update(CONTROLLER_FILES.get(c, {}))
        for name, text in files.items():
            if name not in self.missing:
                (path / name).write_text(text)

    def remove_dir(self, path: Path) -> None:
        if any(p.is_dir() for p in path.iterdir()):
            raise OSError(16, "Device or resource busy")
        shutil.rmtree(path)


@pytest.fixture
def fake(tmp_path, monkeypatch):
    def make(**kw) -> FakeKernel:
        k = FakeKernel(tmp_path / "cgroup2", **kw)
        monkeypatch.setattr(cgroups, "make_dir", k.make_dir)
        monkeypatch.setattr(cgroups, "remove_dir", k.remove_dir)
        return k
    monkeypatch.setattr(cgroups, "swap_active", lambda: False)
    return make


def create(k: FakeKernel, resources: dict, **kw) -> ResourceLimits:
    return ResourceLimits.create("egL-fake", resources, mounts=Mounts(v2=k.root, v1=kw.pop("v1", {})), **kw)


def test_v2_with_controllers_gets_one_group_with_every_limit(fake, tmp_path):
    k = fake()
    never = tmp_path / "v1-memory-not-to-be-used"
    limits = create(k, {"memory_mb": 64, "pids_max": 32, "cpu_millis": 200, "wall_time_seconds": 5},
                    v1={"memory": never})
    group = k.root / "egressgate" / "egL-fake"
    assert limits.paths() == [str(group)]
    assert not never.exists()
    assert (k.root / "cgroup.subtree_control").read_text() == "+cpu +memory +pids"
    assert (k.root / "egressgate" / "cgroup.subtree_control").read_text() == "+cpu +memory +pids"
    assert (group / "memory.max").read_text() == str(64 * 1024 * 1024)
    assert (group / "memory.swap.max").read_text() == "0"
    assert (group / "memory.oom.group").read_text() == "1"
    assert (group / "pids.max").read_text() == "32"
    assert (group / "cpu.max").read_text() == "20000 100000"


def test_v2_tiny_cpu_share_uses_a_longer_period(fake):
    k = fake()
    create(k, {"cpu_millis": 5})
    assert (k.root / "egressgate" / "egL-fake" / "cpu.max").read_text() == "5000 1000000"  # quota >= 1 ms


def test_v2_preexec_moves_the_child_and_hit_reads_the_events(fake):
    k = fake()
    limits = create(k, {"memory_mb": 64, "pids_max": 32})
    group = k.root / "egressgate" / "egL-fake"
    pid = os.fork()
    if pid == 0:  # the child runs the hook exactly as Popen would, then exits
        try:
            limits.preexec()()
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    assert (group / "cgroup.procs").read_text() == "0"  # "0" = the writing process
    assert limits.hit() is None
    (group / "pids.events").write_text("max 3\n")
    assert limits.hit() is Limit.PIDS
    (group / "memory.events").write_text("low 0\nhigh 0\nmax 9\noom 1\noom_kill 1\n")
    assert limits.hit() is Limit.MEMORY  # an OOM kill wins over failed forks
    (group / "memory.events").write_text("low 0\nhigh 0\nmax 9\noom 1\noom_kill 0\n")
    assert limits.hit() is Limit.PIDS  # `max` and `oom` events alone are not a kill


def test_v2_remove_is_idempotent_and_keeps_the_shared_parent(fake):
    k = fake()
    limits = create(k, {"pids_max": 5})
    limits.remove()
    limits.remove()
    assert not (k.root / "egressgate" / "egL-fake").exists()
    assert (k.root / "egressgate").is_dir()


@pytest.mark.parametrize(("controllers", "resources", "words"), [
    ("cpu pids", {"memory_mb": 64}, "memory"),
    ("memory cpu", {"pids_max": 10}, "pids"),
    ("memory pids", {"cpu_millis": 100}, "cpu"),
])
def test_v2_missing_controller_and_no_v1_is_refused(fake, controllers, resources, words):
    k = fake(controllers=controllers)
    with pytest.raises(LimitsUnavailable, match=words):
        create(k, resources)
    assert not (k.root / "egressgate" / "egL-fake").exists()


@pytest.mark.parametrize(("missing", "resources", "words"), [
    (("memory.events",), {"memory_mb": 64}, "memory.events"),
    (("pids.events",), {"pids_max": 8}, "pids.events"),
    (("memory.max",), {"memory_mb": 64}, "memory.max"),
    (("cpu.max",), {"cpu_millis": 100}, "cpu.max"),
])
def test_v2_missing_interface_file_is_refused_and_nothing_is_left(fake, missing, resources, words):
    k = fake(missing=missing)
    with pytest.raises(LimitsUnavailable, match=words.replace(".", r"\.")):
        create(k, resources)
    assert not (k.root / "egressgate" / "egL-fake").exists()


def test_v2_no_swap_accounting_is_refused_only_while_swap_is_on(fake, monkeypatch):
    k = fake(missing=("memory.swap.max",))
    monkeypatch.setattr(cgroups, "swap_active", lambda: True)
    with pytest.raises(LimitsUnavailable, match="swap"):
        create(k, {"memory_mb": 64})
    assert not (k.root / "egressgate" / "egL-fake").exists()
    monkeypatch.setattr(cgroups, "swap_active", lambda: False)
    create(k, {"memory_mb": 64}).remove()  # no swap anywhere: nothing to bypass through


def test_read_mounts_pure_v2_hybrid_and_escapes(tmp_path):
    pure = tmp_path / "pure"
    pure.write_text("30 23 0:26 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n")
    assert read_mounts(pure) == Mounts(v2=Path("/sys/fs/cgroup"), v1={})
    hybrid = tmp_path / "hybrid"
    hybrid.write_text(textwrap.dedent("""\
        31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
        32 31 0:29 / /sys/fs/cgroup/cpu,cpuacct rw,relatime - cgroup cgroup rw,cpu,cpuacct
        35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
        39 31 0:36 / /sys/fs/cgroup/my\\040pids rw,relatime shared:5 - cgroup cgroup rw,pids
        40 31 0:37 / /sys/fs/cgroup/systemd rw,relatime - cgroup cgroup rw,xattr,name=systemd
        41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
        """))
    m = read_mounts(hybrid)
    assert m.v2 == Path("/sys/fs/cgroup/unified")
    assert m.v1 == {"cpu": Path("/sys/fs/cgroup/cpu,cpuacct"), "cpuacct": Path("/sys/fs/cgroup/cpu,cpuacct"),
                    "memory": Path("/sys/fs/cgroup/memory"), "pids": Path("/sys/fs/cgroup/my pids")}


# --- for real: this host's cgroup2 (controller-less on a hybrid host) -------------------------------

REAL_V2 = read_mounts().v2


@pytest.fixture
def real_v2() -> Mounts:
    require_cgroups()
    if REAL_V2 is None:
        pytest.skip("no cgroup2 mount on this host")
    return Mounts(v2=REAL_V2, v1={})


def test_real_cgroup2_tracks_and_kills_a_tree_with_cgroup_kill(runs, real_v2):
    limits = runs.create("v2", {}, mounts=real_v2)
    assert [g.version for g in limits.groups] == [2]
    proc = runs.spawn(limits, ["/bin/sh", "-c", "sleep 1000 & sleep 1000 & wait"])
    assert wait_for(lambda: len(limits.pids()) == 3)
    assert limits.groups[0].populated()
    limits.kill_all()
    assert not limits.groups[0].populated() and limits.pids() == []
    proc.wait(5)
    limits.remove()
    assert not limits.groups[0].exists()


def test_real_cgroup2_without_the_controller_refuses_the_limit(real_v2):
    if "memory" in real_v2.v2_controllers():
        pytest.skip("this host's cgroup2 has the memory controller (pure v2): covered by the other tests")
    rid = run_id("v2-refused")
    with pytest.raises(LimitsUnavailable, match="memory"):
        ResourceLimits.create(rid, {"memory_mb": 64}, mounts=real_v2, parent=PARENT)
    assert not (REAL_V2 / PARENT / rid).exists()


def test_real_cgroup2_freshly_mounted_in_a_test_mount_namespace(tmp_path, real_v2):
    """A new cgroup2 mount (private mount namespace, so the host's mount table is untouched) is found by
    read_mounts and used for a real run. It is the same single cgroup2 hierarchy, hence the same controllers."""
    point = tmp_path / "cg2"
    point.mkdir()
    script = textwrap.dedent(f"""
        import subprocess, sys
        from pathlib import Path
        from egressgate.runtimes.limits import ResourceLimits
        from egressgate.runtimes.cgroups import Mounts
        assert " {point} " in Path("/proc/self/mountinfo").read_text()
        mounts = Mounts(v2=Path({str(point)!r}), v1={{}})
        lim = ResourceLimits.create({run_id("v2-mnt")!r}, {{}}, mounts=mounts, parent={PARENT!r})
        p = subprocess.Popen(["sleep", "1000"], preexec_fn=lim.preexec())
        assert lim.pids() == [p.pid], lim.pids()
        lim.kill_all(); p.wait(); lim.remove()
        print("ok", lim.paths()[0])
        """)
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    out = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c",
                          f'mount -t cgroup2 none "{point}" && exec "{sys.executable}" -c "$0"', script],
                         capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"ok {point}/{PARENT}/egL-v2-mnt-")
    assert not point.is_mount()  # the mount stayed in the test namespace
