"""Watching a server's processes from outside (Linux ``/proc``), for tests that start SGLang.

SGLang's launcher starts its scheduler and detokenizer with ``multiprocessing``; a scheduler that
dies of a signal takes no launcher down with it, so a test that only polls the launcher would wait
forever. ``Workers`` notices such a death at once. A worker is recognised by its command line when
first seen (``multiprocessing``'s spawn), and from then on followed by pid: SGLang retitles its
workers (``setproctitle``: ``sglang::scheduler``), which rewrites ``/proc/PID/cmdline``, so a
worker that is matched by command line on every poll seems to exit the moment it is renamed.
"""

from __future__ import annotations

from pathlib import Path


def live_parents() -> dict[int, int]:
    """pid -> parent pid of every live process (a zombie has exited)."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] != "Z":  # state
            parents[int(stat.parent.name)] = int(fields[1])
    return parents


def descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid``."""
    parents = live_parents()
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        kids = [c for c, pp in parents.items() if pp == p]
        out += kids
        todo += kids
    return out


class Workers:
    """The direct children of ``pid`` that ``multiprocessing`` started, followed by pid."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.seen: set[int] = set()

    def poll(self) -> list[int]:
        """Take in new workers; return the pids of seen workers that have exited since."""
        parents = live_parents()
        for c, pp in parents.items():
            if pp != self.pid or c in self.seen:
                continue
            try:
                cmd = Path(f"/proc/{c}/cmdline").read_bytes()
            except OSError:
                continue
            if b"multiprocessing" in cmd:
                self.seen.add(c)
        return sorted(p for p in self.seen if parents.get(p) != self.pid)
