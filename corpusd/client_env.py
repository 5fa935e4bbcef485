"""What a client of a running ``corpusd up``'s OpenAI-compatible HTTP API needs, in the form the
``openai`` client and ``curl`` take it: ``OPENAI_BASE_URL``, ``OPENAI_API_KEY`` (the agent
token: the port asks for it as ``Authorization: Bearer``) and the CA its certificate chains to
(``SSL_CERT_FILE`` for Python's clients, ``CURL_CA_BUNDLE`` for curl). ``corpusd client-env``
prints them as ``export`` lines, for ``eval "$(corpusd client-env)"``; ``corpusd up`` names them
in its summary.

``SSL_CERT_FILE`` replaces the system's CAs for the Python clients of that shell: a shell that
also talks to public HTTPS services should pass the CA file to the client instead.
"""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

from corpusd.local_ca import LocalCA

#: the key the openai client needs for a plaintext (``up --insecure``) port, which takes any
PLAINTEXT_KEY = "unused"


def variables(info: dict[str, Any]) -> list[tuple[str, str]]:
    """``(name, value)`` of what a client of the agent's HTTP API needs, from ``up.json``'s
    ``info``. Raises ValueError when that ``up`` serves no HTTP API."""
    port = int((info.get("agent") or {}).get("http", -1))
    if port < 0:
        raise ValueError(
            "this `corpusd up` serves no HTTP API: start it with --http-port PORT (0: any free)"
        )
    sec = info.get("security")
    if not sec:
        return [
            ("OPENAI_BASE_URL", f"http://127.0.0.1:{port}/v1"),
            ("OPENAI_API_KEY", PLAINTEXT_KEY),
        ]
    ca = LocalCA(Path(sec["dir"]))
    return [
        ("OPENAI_BASE_URL", f"https://127.0.0.1:{port}/v1"),
        ("OPENAI_API_KEY", ca.token("agent")),
        ("SSL_CERT_FILE", str(ca.ca)),
        ("CURL_CA_BUNDLE", str(ca.ca)),
    ]


def exports(info: dict[str, Any]) -> str:
    """``variables`` as shell ``export`` lines, with a comment saying what each is."""
    notes = {
        "OPENAI_BASE_URL": "the agent's OpenAI-compatible API",
        "OPENAI_API_KEY": "the agent token (sent as Authorization: Bearer)",
        "SSL_CERT_FILE": "up's CA, for Python clients (openai, httpx, requests)",
        "CURL_CA_BUNDLE": "up's CA, for curl",
    }
    return "\n".join(f"export {k}={shlex.quote(v)}  # {notes[k]}" for k, v in variables(info))
