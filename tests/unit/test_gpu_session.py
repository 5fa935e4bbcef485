"""tools/gpu_session.sh, the device steps the open issues wait for: every step its header lists
is one case of the script, each case once, and an unknown step exits 2 before installing anything
(CPU; nothing of the steps runs here)."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "tools" / "gpu_session.sh"


def test_every_listed_step_is_one_case_of_the_script() -> None:
    text = SCRIPT.read_text()
    listed = re.findall(r"^#   bash tools/gpu_session\.sh (\S+)", text, re.M)
    # a case may serve several steps (span|span-all)
    cases = [c for m in re.findall(r"^([a-z][a-z0-9|-]*)\)", text, re.M) for c in m.split("|")]
    accepted = re.search(r'^case "\$step" in ([a-z0-9|-]+)\) ;;', text, re.M)
    assert accepted is not None
    assert len(cases) == len(set(cases)), f"a step's case appears twice: {cases}"
    assert listed == cases == accepted.group(1).split("|")
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)


def test_an_unknown_step_exits_2_before_any_install(tmp_path: Path) -> None:
    env = {**os.environ, "OUT": str(tmp_path / "out")}
    run = subprocess.run(["bash", str(SCRIPT), "no-such-step"], cwd=tmp_path, env=env,
                         capture_output=True, text=True)  # fmt: skip
    assert run.returncode == 2 and "unknown step no-such-step" in run.stderr
    assert not (tmp_path / "out").exists()


def test_a_bad_span_setting_exits_2_before_any_install(tmp_path: Path) -> None:
    for var, value in (("SPAN_PHASE", "train"), ("SPAN_GEOMETRY", "g256x1")):
        env = {**os.environ, "OUT": str(tmp_path / "out"), var: value}
        run = subprocess.run(["bash", str(SCRIPT), "span"], cwd=tmp_path, env=env,
                             capture_output=True, text=True)  # fmt: skip
        assert run.returncode == 2 and f"{var}={value}:" in run.stderr, run.stderr
        assert not (tmp_path / "out").exists()
