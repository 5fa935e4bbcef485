"""The README's OpenAI example, run as written against the default ``corpusd up`` (issue 37:
it showed ``http://`` and ``api_key="unused"`` while ``up`` serves the port with TLS and wants
the agent token, so it failed with "Server disconnected" and curl exited 52). The section's
bash block and then its Python block run in one shell, as a user pastes them into a terminal;
``corpusd`` is this interpreter's module and ``python`` this interpreter."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("openai", reason="the OpenAI client is a test dependency: .[test]")

SECTION = "## An OpenAI-compatible endpoint"
PORT = 8000  # the README's


def readme_blocks() -> tuple[str, str]:
    """The bash and the Python block of the README's OpenAI section, verbatim."""
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = readme.split(SECTION, 1)[1].split("\n## ", 1)[0]
    bash = re.search(r"```bash\n(.*?)```", section, re.S)
    py = re.search(r"```python\n(.*?)```", section, re.S)
    assert bash and py, "the README's OpenAI section lost a code block"
    return bash.group(1), py.group(1)


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def test_the_readme_openai_example_works_as_written(tmp_path: Path, tiny_dir: Path) -> None:
    if not _port_free(PORT):
        pytest.skip(f"port {PORT}, the README's, is taken on this machine")
    bash, py = readme_blocks()
    assert "corpusd up" in bash and "--insecure" not in bash  # the default, secure up
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CORPUSD_", "OPENAI_"))}
    env.pop("SSL_CERT_FILE", None)
    env.update(CORPUSD_HOME=str(tmp_path / "home"), CORPUSD_MODEL=str(tiny_dir))
    env["CORPUSD_CALIBRATE"] = "off"  # seconds each; test_up_ports.py checks that it runs
    shell = (
        f'corpusd() {{ "{sys.executable}" -m corpusd "$@"; }}\n'
        f'python() {{ "{sys.executable}" "$@"; }}\n'
        f"set -e\n{bash}\necho\necho ---python---\npython - <<'PY'\n{py}PY\n"
    )
    try:
        r = subprocess.run(
            ["bash", "-c", shell], env=env, capture_output=True, text=True, timeout=900
        )
    finally:
        subprocess.run(
            [sys.executable, "-m", "corpusd", "down"], env=env, capture_output=True, timeout=120
        )
    assert r.returncode == 0, f"{r.stdout}\n{r.stderr}"
    curled, streamed = r.stdout.split("---python---\n", 1)
    models, chat = _objects(curled[curled.index('{"object"') :])[:2]  # curl adds no newline
    assert "sample-repo" in [m["id"] for m in models["data"]], models
    assert chat["choices"][0]["message"]["role"] == "assistant", chat
    assert chat["usage"]["completion_tokens"] >= 1, chat
    assert streamed and "Traceback" not in r.stderr, r.stderr


def _objects(text: str) -> list[Any]:
    """The JSON values written one after another in ``text``."""
    out, at, decoder = [], 0, json.JSONDecoder()
    while at < len(text.rstrip()):
        value, at = decoder.raw_decode(text, at)
        out.append(value)
        while at < len(text) and text[at].isspace():
            at += 1
    return out
