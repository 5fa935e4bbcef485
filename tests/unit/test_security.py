"""The local CA (chain, names, key usage, file modes, kept across restarts), tokens files
(every refusal names its line), the token interceptor's header parsing, and the flag rules
(tokens only over TLS, no plaintext off loopback without --insecure)."""

from __future__ import annotations

import ipaddress
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID

from corpusd import security
from corpusd.auth import METHODS, RIGHTS, TokenAuth, TokenError, load_tokens, parse_tokens
from corpusd.local_ca import ensure

GOOD = "A" * 20


def test_ca_signs_a_loopback_leaf_for_both_ends(tmp_path: Path) -> None:
    ca = ensure(tmp_path / "tls")
    root = x509.load_pem_x509_certificate(ca.ca.read_bytes())
    leaf = x509.load_pem_x509_certificate(ca.cert.read_bytes())
    leaf.verify_directly_issued_by(root)  # raises if the CA did not sign it
    assert root.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    assert not leaf.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    sans = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert sans.get_values_for_type(x509.DNSName) == ["localhost"]
    assert set(sans.get_values_for_type(x509.IPAddress)) == {
        ipaddress.ip_address("127.0.0.1"),
        ipaddress.ip_address("::1"),
    }
    eku = leaf.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert set(eku) == {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH}
    other = ensure(tmp_path / "other")  # a second CA does not vouch for this leaf
    with pytest.raises(Exception):  # noqa: B017  (cryptography raises InvalidSignature/ValueError)
        leaf.verify_directly_issued_by(x509.load_pem_x509_certificate(other.ca.read_bytes()))
    for p in (tmp_path / "tls").iterdir():
        assert p.stat().st_mode & 0o777 == 0o600, p
    assert (tmp_path / "tls").stat().st_mode & 0o777 == 0o700
    tokens = load_tokens(ca.tokens)
    assert sorted(tokens.values()) == sorted(RIGHTS) and len(set(tokens)) == 3


def test_ensure_keeps_what_it_made(tmp_path: Path) -> None:
    a = ensure(tmp_path)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    ensure(tmp_path)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before
    assert a.token("agent") != a.token("admin")


def test_parse_tokens() -> None:
    text = f"# who may do what\nadmin {GOOD}1\n\nagent {GOOD}2  # a worker\nholder {GOOD}3\n"
    assert parse_tokens(text) == {f"{GOOD}1": "admin", f"{GOOD}2": "agent", f"{GOOD}3": "holder"}


@pytest.mark.parametrize(
    ("text", "why"),
    [
        (f"root {GOOD}", "tokens:1: unknown right 'root'"),
        (f"admin {GOOD}\nagent", "tokens:2: expected 'RIGHT TOKEN', got 1 fields"),
        (f"admin {GOOD} extra", "tokens:1: expected 'RIGHT TOKEN', got 3 fields"),
        ("admin short", "tokens:1: a token must be at least 16 characters"),
        (f"admin {GOOD}\nagent {GOOD}", "tokens:2: this token is already given"),
        ("admin " + "é" * 20, "tokens:1: a token must be printable ASCII"),
        ("# nothing\n", "tokens: no tokens"),
    ],
)
def test_parse_tokens_refuses(text: str, why: str) -> None:
    with pytest.raises(TokenError, match=why):
        parse_tokens(text)


def test_tokens_file_readable_by_others_is_refused(tmp_path: Path) -> None:
    p = tmp_path / "tokens"
    p.write_text(f"admin {GOOD}\n")
    p.chmod(0o644)
    with pytest.raises(TokenError, match="lets others read it; chmod 600"):
        load_tokens(p)
    p.chmod(0o600)
    assert load_tokens(p) == {GOOD: "admin"}


def test_interceptor_reads_the_bearer_header() -> None:
    auth = TokenAuth({f"{GOOD}1": "admin", f"{GOOD}2": "agent"})
    assert auth.right((("authorization", f"Bearer {GOOD}2"),)) == "agent"
    assert auth.right((("authorization", f"Bearer {GOOD}9"),)) is None
    assert auth.right((("authorization", GOOD + "1"),)) is None  # no "Bearer "
    assert auth.right(()) is None and auth.right(None) is None
    assert auth.right((("authorization", "Bearer "),)) is None


def test_every_rpc_has_a_right() -> None:
    """A method missing from METHODS would need admin: list them all, so none is by accident."""
    from corpusd.v1 import agent_pb2, coordinator_pb2, holder_pb2, transport_pb2

    named = set()
    for mod in (agent_pb2, coordinator_pb2, holder_pb2, transport_pb2):
        for svc in mod.DESCRIPTOR.services_by_name.values():
            named |= {f"/{svc.full_name}/{m.name}" for m in svc.methods}
    assert named == set(METHODS)
    assert METHODS["/corpusd.v1.Coordinator/Unpin"] == {"admin"}
    assert "agent" in METHODS["/corpusd.v1.Holder/Attend"]
    assert "agent" not in METHODS["/corpusd.v1.Coordinator/RegisterHolder"]


def test_flag_rules(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--auth-tokens needs --tls-cert"):
        security.SecurityConfig(auth_tokens="t")
    with pytest.raises(ValueError, match="go together"):
        security.SecurityConfig(tls_cert="c")
    with pytest.raises(ValueError, match="contradicts"):
        security.SecurityConfig(tls_cert="c", tls_key="k", insecure=1)
    with pytest.raises(ValueError, match="only sent over TLS"):
        security.identity_from("", "", "", GOOD)
    with pytest.raises(ValueError, match=f"--tls-ca {tmp_path}/none"):
        security.identity_from(str(tmp_path / "none"), "", "", GOOD)


def test_plaintext_off_loopback_needs_insecure(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(security, "_server", security.SecurityConfig())
    with pytest.raises(ValueError, match=r"0\.0\.0\.0 is not loopback"):
        security.serving("0.0.0.0")
    assert security.serving("127.0.0.1").credentials is None
    assert security.serving("::1").credentials is None
    monkeypatch.setattr(security, "_server", security.SecurityConfig(insecure=1))
    assert security.serving("0.0.0.0").scheme == "http"
