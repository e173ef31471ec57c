"""How busy the machine is besides the bench: so a noisy run can be recognised and discarded.

The machine is shared (other test suites, other sessions) and virtual (a hypervisor may steal CPU). Three
figures, all from /proc (nothing to install):
- `loadavg` (1/5/15 min) at start and end;
- an idle sample (1 s, the bench doing nothing): the share of all CPUs busy with *other* work, and stolen;
- during the run: host CPU busy time minus the CPU time of the bench's own process tree (the driver, load
  generators, upstream and proxies, all waited-for descendants), as an average number of cores used by
  others, plus the stolen share.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

HZ = os.sysconf("SC_CLK_TCK")
CPUS = os.cpu_count() or 1


@dataclass(frozen=True)
class CpuTimes:
    busy: int  # jiffies, all CPUs: user+nice+system+irq+softirq (guest is inside user)
    steal: int
    total: int  # busy + idle + iowait + steal


def cpu_times() -> CpuTimes:
    f = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    user, nice, system, idle, iowait, irq, softirq, steal = f
    busy = user + nice + system + irq + softirq
    return CpuTimes(busy, steal, busy + idle + iowait + steal)


def own_cpu_seconds() -> float:
    """CPU seconds of this process and every descendant it (or they) waited for."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def loadavg() -> list[float]:
    return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]


def idle_sample(seconds: float = 1.0) -> dict:
    """Load while the bench is idle: every busy jiffy belongs to someone else."""
    a = cpu_times()
    time.sleep(seconds)
    b = cpu_times()
    total = max(1, b.total - a.total)
    return {"loadavg": loadavg(), "others_pct": round(100 * (b.busy - a.busy) / total, 1),
            "steal_pct": round(100 * (b.steal - a.steal) / total, 1), "cpus": CPUS}


@dataclass
class RunMeter:
    """Started before the world is built, read after every bench process has been waited for."""

    t0: float = 0.0
    cpu0: CpuTimes | None = None
    own0: float = 0.0

    def start(self) -> None:
        self.t0, self.cpu0, self.own0 = time.monotonic(), cpu_times(), own_cpu_seconds()

    def read(self) -> dict:
        assert self.cpu0 is not None
        wall = time.monotonic() - self.t0
        cpu1 = cpu_times()
        busy_s = (cpu1.busy - self.cpu0.busy) / HZ
        own = own_cpu_seconds() - self.own0
        total = max(1, cpu1.total - self.cpu0.total)
        return {"wall_s": round(wall, 1), "bench_cores": round(own / wall, 2),
                "others_cores": round(max(0.0, busy_s - own) / wall, 2),
                "steal_pct": round(100 * (cpu1.steal - self.cpu0.steal) / total, 1), "cpus": CPUS}


def describe(when: str, s: dict) -> str:
    la = " ".join(f"{x:.2f}" for x in s["loadavg"])
    return (f"{when}: loadavg {la}; idle 1 s sample: others {s['others_pct']}% of {s['cpus']} CPUs, "
            f"steal {s['steal_pct']}%")


def describe_run(r: dict) -> str:
    return (f"during the run ({r['wall_s']} s): bench {r['bench_cores']} cores, others {r['others_cores']} "
            f"cores of {r['cpus']}, steal {r['steal_pct']}%")


def noisy(start: dict, end: dict, run: dict) -> list[str]:
    """Reasons to distrust the figures (empty: the machine was quiet enough to compare candidates)."""
    why = []
    for name, s in (("start", start), ("end", end)):
        if s["others_pct"] > 15:
            why.append(f"others used {s['others_pct']}% of the CPUs at {name}")
        if s["steal_pct"] > 5:
            why.append(f"{s['steal_pct']}% CPU stolen at {name}")
    if run["others_cores"] > 0.3:
        why.append(f"others used {run['others_cores']} cores on average during the run")
    if run["steal_pct"] > 5:
        why.append(f"{run['steal_pct']}% CPU stolen during the run")
    return why
