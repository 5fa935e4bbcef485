"""Name a TLS mistake behind a failed connection. gRPC reports a plaintext client of a TLS
port, a client without the certificate a mutual-TLS port asks for, or one that does not trust
the server's certificate, all as "UNAVAILABLE: failed to connect to all addresses … Socket
closed": an outage, to the reader. :func:`explain` probes the address once with Python's own
TLS client and says in one line which mistake it is and what to pass.
"""

from __future__ import annotations

import socket
import ssl

from corpusd.security import ENV_CA, ENV_CERT, ENV_KEY, Identity, up_ca

PROBE_S = 2.0  # seconds a probe waits for each answer
#: words of a gRPC connection failure (the only failures worth a probe)
_CONNECT = ("failed to connect", "Socket closed", "handshake", "SSL", "ssl", "Connection reset")


def probe(address: str, ca: bytes = b"") -> str:
    """What the server at ``address`` (host:port) speaks: ``"down"`` (no connection),
    ``"plaintext"``, ``"untrusted"`` (TLS whose certificate does not chain to ``ca``; only when
    ``ca`` is given), ``"tls+client-cert"`` (TLS that refuses a client without a certificate),
    ``"tls"``, ``"closed"`` (it closed or reset the connection on our ClientHello and does not
    speak plaintext HTTP/2 either: a daemon going down or restarting) or ``"silent"`` (it
    accepted the connection and answered nothing: a stopped or wedged process). Blocks up to
    about 3 × PROBE_S."""
    host, port = address.rsplit(":", 1)
    host = host.strip("[]")
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    if ca:
        ctx.load_verify_locations(cadata=ca.decode())
    else:
        ctx.verify_mode = ssl.CERT_NONE
    ctx.set_alpn_protocols(["h2"])
    try:
        raw = socket.create_connection((host, int(port)), timeout=PROBE_S)
    except OSError:
        return "down"
    with raw:
        try:
            with ctx.wrap_socket(raw, server_hostname=host) as tls:
                # TLS 1.3: a server that wants a client certificate refuses after the handshake
                # (an alert, or it just closes); one that does not sends its HTTP/2 settings.
                tls.settimeout(PROBE_S)
                try:
                    got = tls.recv(1)
                except ssl.SSLError as e:
                    return "tls+client-cert" if "CERTIFICATE" in str(e).upper() else "tls"
                except OSError:
                    return "tls"
                return "tls" if got else "tls+client-cert"
        except ssl.SSLCertVerificationError:
            return "untrusted"
        except (ssl.SSLEOFError, ssl.SSLZeroReturnError, ConnectionError):
            # closed or reset with no answer: a plaintext server may do that to a ClientHello,
            # and so does one that is going down; its answer to HTTP/2's preface tells which
            return "plaintext" if _speaks_h2(host, int(port)) else "closed"
        except ssl.SSLError as e:
            text = str(e).upper()
            if "CERTIFICATE_REQUIRED" in text or "HANDSHAKE_FAILURE" in text:
                return "tls+client-cert"
            if "EOF" in text:
                return "plaintext" if _speaks_h2(host, int(port)) else "closed"
            return "plaintext"  # it answered our ClientHello with bytes that are not TLS
        except TimeoutError:
            return "silent"
        except OSError:
            return "closed"


def _speaks_h2(host: str, port: int) -> bool:
    """Whether ``host:port`` answers HTTP/2's client preface with a SETTINGS frame (a plaintext
    gRPC server does); False for no connection, a close, a reset or silence."""
    preface = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes(3) + b"\x04" + bytes(5)
    try:
        with socket.create_connection((host, port), timeout=PROBE_S) as s:
            s.sendall(preface)
            got = b""
            while len(got) < 4 and (more := s.recv(4 - len(got))):
                got += more
    except OSError:
        return False
    return len(got) == 4 and got[3] == 0x04  # a frame header: length (3 bytes), type 4


def explain(address: str, detail: str, me: Identity) -> str:
    """``detail`` (a gRPC UNAVAILABLE message from a call to ``address``), or one line naming
    the TLS mistake it hides (starting "TLS handshake failed: ") when a probe finds one, or
    saying that the server closed the handshake or does not answer it (no TLS mistake: a
    daemon restarting or stopped)."""
    if not any(w in detail for w in _CONNECT) or "," in address:
        return detail
    what = probe(address, me.ca)
    ca = up_ca(address) if address else None
    ca_file = str(ca.ca) if ca is not None else "its CA file"
    cert = (
        f"{ENV_CERT}={ca.cert} {ENV_KEY}={ca.key}"
        if ca is not None
        else f"{ENV_CERT}=… {ENV_KEY}=… (a certificate the server's CA signed)"
    )
    head = f"TLS handshake failed: {address}"
    if what in ("tls", "tls+client-cert") and not me.tls:
        extra = f" and a client certificate; pass {ENV_CA}={ca_file} {cert}"
        wants = extra if what == "tls+client-cert" else f"; pass {ENV_CA}={ca_file}"
        return f"{head} wants TLS{wants} (`corpusd client-env` prints them)"
    if what == "tls+client-cert" and me.tls and not me.cert:
        return f"{head} asks for a client certificate (mutual TLS); pass {cert}"
    if what == "untrusted" and me.tls:
        return (
            f"{head}: its certificate does not chain to the CA given ({ENV_CA}); pass the CA "
            f"that signed it ({ENV_CA}={ca_file})"
        )
    if what == "closed":
        return (
            f"connection to {address} closed during the TLS handshake (restarting?); it does "
            "not speak plaintext HTTP/2 either, so no TLS setting is wrong"
        )
    if what == "silent":
        return (
            f"{address} accepted the connection but did not answer the TLS handshake in "
            f"{PROBE_S:g} s (stopped or overloaded?)"
        )
    if what == "plaintext" and me.tls:
        return (
            f"{head} serves plaintext (started --insecure?); drop {ENV_CA}, {ENV_CERT} and "
            "CORPUSD_TOKEN for it, or pass --insecure"
        )
    return detail
