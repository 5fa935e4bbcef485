"""The local certificate authority ``corpusd up`` makes: a CA and one leaf certificate for the
loopback daemons and their local clients (SANs localhost, 127.0.0.1, ::1; server and client
auth, so the same pair serves mutual TLS both ways), and the tokens file, all mode 0600.

Everything is made by the ``cryptography`` package (ECDSA P-256, SHA-256); nothing is
hand-rolled. Files (in ``<dir>``): ``ca.pem``, ``ca.key``, ``node.pem``, ``node.key``,
``tokens`` (``RIGHT TOKEN`` lines, one token per right).
"""

from __future__ import annotations

import datetime as dt
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from corpusd.auth import RIGHTS, load_tokens, new_token, write_private

LOOPBACK_NAMES = ("localhost",)
LOOPBACK_IPS = ("127.0.0.1", "::1")
VALID_DAYS = 825  # the longest lifetime TLS clients commonly accept for a leaf


@dataclass(frozen=True, slots=True)
class LocalCA:
    """Paths of what :func:`ensure` made (or found) in ``dir``."""

    dir: Path

    @property
    def ca(self) -> Path:
        return self.dir / "ca.pem"

    @property
    def cert(self) -> Path:
        return self.dir / "node.pem"

    @property
    def key(self) -> Path:
        return self.dir / "node.key"

    @property
    def tokens(self) -> Path:
        return self.dir / "tokens"

    def token(self, right: str) -> str:
        """The token of ``right`` from the tokens file."""
        for token, r in load_tokens(self.tokens).items():
            if r == right:
                return token
        raise ValueError(f"{self.tokens}: no {right} token")


def ensure(directory: Path) -> LocalCA:
    """Make the CA, the leaf and the tokens in ``directory`` unless they are there already
    (a restarted ``up`` keeps them, so clients configured with their paths keep working).
    Every file is written mode 0600; the directory 0700."""
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    directory.chmod(0o700)
    out = LocalCA(directory)
    if not all(p.exists() for p in (out.ca, out.cert, out.key, directory / "ca.key")):
        ca_key, ca_pem, leaf_key, leaf_pem = make_pair()
        write_private(directory / "ca.key", ca_key)
        write_private(out.key, leaf_key)
        write_private(out.cert, leaf_pem)
        write_private(out.ca, ca_pem)
    if not out.tokens.exists():
        lines = "".join(f"{right} {new_token()}\n" for right in RIGHTS)
        write_private(out.tokens, lines.encode())
    return out


def make_pair(common_name: str = "corpusd local CA") -> tuple[bytes, bytes, bytes, bytes]:
    """A fresh CA and a leaf it signed: ``(ca_key, ca_cert, leaf_key, leaf_cert)``, PEM bytes
    (keys unencrypted PKCS#8)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = dt.datetime.now(dt.timezone.utc)
    start, end = now - dt.timedelta(minutes=5), now + dt.timedelta(days=VALID_DAYS)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), False)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    sans: list[x509.GeneralName] = [x509.DNSName(n) for n in LOOPBACK_NAMES]
    sans += [x509.IPAddress(ipaddress.ip_address(a)) for a in LOOPBACK_IPS]
    leaf = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "corpusd node")]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .add_extension(
            x509.ExtendedKeyUsage(
                [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
            ),
            critical=False,
        )
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), False
        )
        .sign(ca_key, hashes.SHA256())
    )

    def pem_key(k: ec.EllipticCurvePrivateKey) -> bytes:
        return k.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )

    pem = serialization.Encoding.PEM
    return pem_key(ca_key), ca.public_bytes(pem), pem_key(key), leaf.public_bytes(pem)
