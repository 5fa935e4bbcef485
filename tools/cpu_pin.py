"""Giving a benchmark's processes cores of their own (Linux): split the cores this process may
use into consecutive blocks and pin a running process, every one of its threads, to a block.

Pinning a pid alone (``os.sched_setaffinity(pid, …)``) moves only its main thread; threads that
already run (gRPC's, torch's OpenMP team) keep the old mask, so every task in ``/proc/PID/task``
is pinned, and threads started later inherit the mask of the thread that starts them.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path


def available() -> list[int]:
    """The cores this process may run on, ascending."""
    return sorted(os.sched_getaffinity(0))


def siblings(cpu: int) -> tuple[int, int]:
    """``cpu``'s physical core as (package, core id), from sysfs; ``(0, cpu)`` when the kernel
    does not say (each logical cpu then counts as its own core)."""
    top = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
    try:
        return int((top / "physical_package_id").read_text()), int((top / "core_id").read_text())
    except (OSError, ValueError):
        return 0, cpu


def by_core(cpus: list[int], core_of: Callable[[int], tuple[int, int]] = siblings) -> list[int]:
    """``cpus`` reordered so that hyperthread siblings are adjacent, cores in order of their
    lowest cpu: consecutive blocks then hold whole physical cores (a block of 4 on a 2-way SMT
    host is 2 cores, not 4 halves shared with another block's threads)."""
    cores: dict[tuple[int, int], list[int]] = {}
    for c in sorted(cpus):
        cores.setdefault(core_of(c), []).append(c)
    return [c for group in sorted(cores.values(), key=min) for c in group]


def blocks(sizes: list[int], cpus: list[int] | None = None) -> list[list[int]]:
    """Consecutive blocks of ``sizes[i]`` cores each, then one block of the rest (empty if none
    is left). Raises ValueError when the sizes need more cores than ``cpus`` (default: the
    available ones) has."""
    cpus = available() if cpus is None else cpus
    if any(n < 1 for n in sizes):
        raise ValueError(f"every block needs at least one core, got sizes {sizes}")
    if sum(sizes) > len(cpus):
        raise ValueError(
            f"{' + '.join(map(str, sizes))} = {sum(sizes)} cores asked for, {len(cpus)} available "
            f"({cpus[0]}-{cpus[-1]})"
        )
    out, at = [], 0
    for n in sizes:
        out.append(cpus[at : at + n])
        at += n
    return [*out, cpus[at:]]


def pin(pid: int, cpus: list[int]) -> int:
    """Pin every thread of process ``pid`` to ``cpus``; returns how many threads. A thread that
    ends meanwhile is skipped."""
    n = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            os.sched_setaffinity(int(task.name), cpus)
            n += 1
        except ProcessLookupError:
            continue
    return n


def span(cpus: list[int]) -> str:
    """``[0, 1, 2, 5]`` → ``"0-2,5"`` (for logs and JSON; any order in, ascending out)."""
    cpus = sorted(cpus)
    parts, i = [], 0
    while i < len(cpus):
        j = i
        while j + 1 < len(cpus) and cpus[j + 1] == cpus[j] + 1:
            j += 1
        parts.append(str(cpus[i]) if i == j else f"{cpus[i]}-{cpus[j]}")
        i = j + 1
    return ",".join(parts)
