"""Who used the CPU while one engine was measured: the engines kept idle, and everyone else.

A benchmark that keeps several engines up (an executor per draft shape, a llama-server)
measures one at a time; the others should use no CPU meanwhile. And the machine may be
shared: processes outside the benchmark (a build, a test run) take cores from the engine
measured, llama.cpp most of all, whose threads wait for each other after every op. So each
measurement records, from /proc:

- `other_cores`: CPU time of processes outside this benchmark's process tree, in cores
  over the measurement's wall time: the machine's busy time (/proc/stat) less the tree's;
- `idle_engine_cpu_s`: CPU seconds of the engines not measured (their pids given).

`cpu_share` is the pure part, on two snapshots.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class CpuSnapshot:
    time_s: float  # time.monotonic()
    machine_busy_s: float  # over all cores
    process_cpu_s: dict[int, float]  # this benchmark's processes, and the idle engines'


@dataclass(frozen=True)
class CpuShare:
    other_cores: float
    idle_engine_cpu_s: float

    def to_json(self) -> dict:
        return {"other_cores": self.other_cores, "idle_engine_cpu_s": self.idle_engine_cpu_s}


def parse_machine_busy_s(proc_stat: str) -> float:
    """Busy seconds over all cores from /proc/stat's `cpu` line: user, nice, system, irq and
    softirq (idle, iowait and steal are no process's work; guest time is inside user)."""
    fields = proc_stat.splitlines()[0].split()
    user, nice, system, _idle, _iowait, irq, softirq = (int(x) for x in fields[1:8])
    return (user + nice + system + irq + softirq) / CLOCK_TICKS


def _stat_fields(pid: int) -> list[str] | None:
    """/proc/PID/stat after the command name (which may hold spaces): field 3 (state) onwards."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return None


def process_cpu_s(pid: int) -> float:
    """utime + stime of a process, all its threads; 0 once it is gone."""
    fields = _stat_fields(pid)
    return 0.0 if fields is None else (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def process_tree(root: int) -> set[int]:
    """`root` and every process descended from it."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (fields := _stat_fields(int(entry.name))) is not None:
            children.setdefault(int(fields[1]), []).append(int(entry.name))
    tree, todo = set(), [root]
    while todo:
        pid = todo.pop()
        tree.add(pid)
        todo += children.get(pid, [])
    return tree


def snapshot(pids: Iterable[int]) -> CpuSnapshot:
    return CpuSnapshot(
        time_s=time.monotonic(),
        machine_busy_s=parse_machine_busy_s(Path("/proc/stat").read_text()),
        process_cpu_s={pid: process_cpu_s(pid) for pid in pids},
    )


def cpu_share(before: CpuSnapshot, after: CpuSnapshot, tree: set[int], idle_pids: set[int]) -> CpuShare:
    """What `tree` (this benchmark's processes) and `idle_pids` (engines inside it, not measured)
    used between the snapshots, and what the rest of the machine used."""

    def used(pids: set[int]) -> float:
        return sum(
            max(0.0, after.process_cpu_s.get(pid, 0.0) - before.process_cpu_s.get(pid, 0.0))
            for pid in pids & before.process_cpu_s.keys()
        )

    wall = after.time_s - before.time_s
    others = max(0.0, after.machine_busy_s - before.machine_busy_s - used(tree))
    return CpuShare(others / wall if wall > 0 else 0.0, used(idle_pids))


class CpuWatch:
    """`start()` before a measurement and `stop()` after it: the CpuShare of that span."""

    def __init__(self, idle_pids: Iterable[int]) -> None:
        self._idle_pids = set(idle_pids)
        self._tree: set[int] = set()
        self._before: CpuSnapshot | None = None

    def start(self) -> None:
        self._tree = process_tree(os.getpid())
        self._before = snapshot(self._tree | self._idle_pids)

    def stop(self) -> CpuShare:
        if self._before is None:
            raise RuntimeError("CpuWatch.stop() before start()")
        after = snapshot(self._tree | self._idle_pids)
        return cpu_share(self._before, after, self._tree, self._idle_pids)
