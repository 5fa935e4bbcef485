"""The ``corpusd`` CLI run as a user runs it (a subprocess), for tests and tools: a run that
outlives its deadline is not just killed but asked, through faulthandler (SIGABRT), where every
thread of it stood, so a rare hang names its place in the failure instead of ``timed out``."""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Mapping


class CliHung(AssertionError):
    """A ``corpusd`` run past its deadline; the message holds every thread's stack."""


def run_cli(
    env: Mapping[str, str], *args: str, timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    """``python -m corpusd *args`` under ``env``, its output captured as text. Past ``timeout``
    seconds raises CliHung with the stacks faulthandler printed (and what it wrote so far)."""
    return run_python(env, ["-m", "corpusd", *args], timeout)


def run_python(
    env: Mapping[str, str], argv: list[str], timeout: float
) -> subprocess.CompletedProcess[str]:
    """``python *argv``, as ``run_cli`` runs the CLI."""
    cmd = [sys.executable, *argv]
    env = {**env, "PYTHONFAULTHANDLER": "1"}  # SIGABRT then prints each thread's stack
    with subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    ) as p:
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.send_signal(signal.SIGABRT)
            try:
                out, err = p.communicate(timeout=30)
            except subprocess.TimeoutExpired:  # not even faulthandler ran: the stacks are lost
                p.kill()
                out, err = p.communicate()
            raise CliHung(
                f"python {' '.join(argv)} ran past {timeout:g} s (pid {p.pid}); stdout:\n"
                f"{out[-4000:]}\nstderr, with faulthandler's stacks:\n{err[-12000:]}"
            ) from None
    return subprocess.CompletedProcess(cmd, p.returncode, out, err)
