"""Mutual TLS: a private CA, certificates for every identity, and the gRPC credentials built from them.

Layout of a TLS folder (what `diloco certs --out DIR` writes and what `--tls-dir DIR` reads):

    ca.pem, ca.key          the CA (keep ca.key off the nodes; it only issues certificates)
    <name>.pem, <name>.key  one certificate and key per identity: `coordinator` and `healthd` (server and client
                            certificates, with SANs for every host name or IP they are reached by), `admin` (for
                            `diloco ctl`), and each worker (`worker`, or worker0..N-1, or the names given); with
                            `diloco certs --etcd`, `etcd` too (etcd's --cert-file/--key-file, same SANs; replicas
                            reach it with --etcd-ca-file ca.pem and coordinator.pem/.key as client certificate)
    join.token, admin.token the bearer tokens (see `diloco.rpc.auth`)

A process reads `ca.pem` and its own `<name>.pem`/`<name>.key`, `<name>` being its `--tls-name`. Keys and tokens are
written with mode 0600. Keys are EC P-256.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import grpc

from diloco.errors import ConfigError

# `cryptography` (about 40 ms to import) only issues certificates; a service that reads its TLS folder never
# needs it, so each issuing function imports it when called (healthd and `diloco ctl` start faster).
if TYPE_CHECKING:
    from cryptography import x509
    from cryptography.hazmat.primitives.asymmetric import ec

SERVICE_NAMES = ("coordinator", "healthd")
ETCD_NAME = "etcd"  # etcd's server certificate, for the coordinators' leadership over https (docs/ha.md)
RESERVED_NAMES = (*SERVICE_NAMES, ETCD_NAME, "admin")  # identities that are not learners
DEFAULT_HOSTS = ("coordinator", "healthd", "localhost", "127.0.0.1")
JOIN_TOKEN_FILE = "join.token"
ADMIN_TOKEN_FILE = "admin.token"
VALID_DAYS = 365


# --- reading ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TlsFiles:
    """The PEM files one process uses: the CA that signs its peers, and its own certificate and key."""

    ca: Path
    cert: Path
    key: Path

    @classmethod
    def from_dir(cls, tls_dir: str | Path, name: str) -> TlsFiles:
        d = Path(tls_dir)
        files = cls(d / "ca.pem", d / f"{name}.pem", d / f"{name}.key")
        missing = [str(p) for p in (files.ca, files.cert, files.key) if not p.is_file()]
        if missing:
            raise ConfigError(
                f"TLS folder {d}: missing {', '.join(missing)}; run `diloco certs --out {d}` (add --names {name} "
                "for another identity) or pass the right --tls-dir/--tls-name"
            )
        return files

    def read(self) -> tuple[bytes, bytes, bytes]:
        return self.ca.read_bytes(), self.cert.read_bytes(), self.key.read_bytes()


def server_credentials(files: TlsFiles) -> grpc.ServerCredentials:
    """Server credentials that require a client certificate signed by the CA (mutual TLS)."""
    ca, cert, key = files.read()
    return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=True)


def channel_credentials(files: TlsFiles) -> grpc.ChannelCredentials:
    """Channel credentials that verify the server against the CA and present this process's certificate."""
    ca, cert, key = files.read()
    return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)


# --- issuing ----------------------------------------------------------------------------------------------------


def _write_private(path: Path, data: bytes) -> None:
    """Write `data` to `path` readable by the owner only (0600), also when the file already exists."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, data)
    finally:
        os.close(fd)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _san(hosts: Sequence[str]) -> x509.SubjectAlternativeName:
    from cryptography import x509

    names: list[x509.GeneralName] = []
    for h in dict.fromkeys(hosts):
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            names.append(x509.DNSName(h))
    return x509.SubjectAlternativeName(names)


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


def make_ca(common_name: str = "diloco CA") -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    now = _now()
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=VALID_DAYS))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=False,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return cert, key


def issue(
    ca_cert: x509.Certificate,
    ca_key: ec.EllipticCurvePrivateKey,
    name: str,
    hosts: Sequence[str] = (),
    server: bool = False,
) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    """A certificate for `name` signed by the CA: always usable as a client certificate; with `server`, also as a
    server certificate for `hosts` (and `name` itself) as SANs."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    now = _now()
    usages = [ExtendedKeyUsageOID.CLIENT_AUTH] + ([ExtendedKeyUsageOID.SERVER_AUTH] if server else [])
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=VALID_DAYS))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        .add_extension(_san([name, *hosts] if server else [name]), critical=False)
    )
    return builder.sign(ca_key, hashes.SHA256()), key


def _write_pair(out: Path, name: str, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey) -> None:
    from cryptography.hazmat.primitives import serialization

    (out / f"{name}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    _write_private(out / f"{name}.key", _key_pem(key))


def load_ca(out: str | Path) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    d = Path(out)
    cert = x509.load_pem_x509_certificate((d / "ca.pem").read_bytes())
    key = serialization.load_pem_private_key((d / "ca.key").read_bytes(), password=None)
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise ConfigError(f"{d / 'ca.key'}: expected an EC private key")
    return cert, key


def add_identity(out: str | Path, name: str, hosts: Sequence[str] = (), server: bool = False) -> None:
    """Issue one more certificate with the CA already in `out` (ca.pem and ca.key)."""
    _check_name(name)
    ca_cert, ca_key = load_ca(out)
    _write_pair(Path(out), name, *issue(ca_cert, ca_key, name, hosts, server))


def _check_name(name: str) -> None:
    if not name or not all(c.isalnum() or c in "-_." for c in name) or name.startswith("."):
        raise ConfigError(f"certificate name {name!r}: use letters, digits, '-', '_' and '.' only")
    if name == "ca":
        raise ConfigError(f"certificate name {name!r} is reserved")


def new_token() -> str:
    return secrets.token_urlsafe(32)


def write_bundle(
    out: str | Path,
    clients: Sequence[str] = ("worker",),
    hosts: Sequence[str] = DEFAULT_HOSTS,
    tokens: bool = True,
    etcd: bool = False,
) -> list[Path]:
    """Write a CA, server+client certificates for the services (SANs: `hosts`; with `etcd`, for etcd too), client
    certificates for `admin` and each name in `clients`, and (with `tokens`) fresh join and admin tokens. Returns
    the files written."""
    from cryptography.hazmat.primitives import serialization

    d = Path(out)
    d.mkdir(parents=True, exist_ok=True)
    for name in clients:
        _check_name(name)
        if name in RESERVED_NAMES:
            raise ConfigError(f"worker name {name!r} clashes with a service or the admin identity; pick another")
    ca_cert, ca_key = make_ca()
    (d / "ca.pem").write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    _write_private(d / "ca.key", _key_pem(ca_key))
    written = [d / "ca.pem", d / "ca.key"]
    for name in (*SERVICE_NAMES, *((ETCD_NAME,) if etcd else ())):
        _write_pair(d, name, *issue(ca_cert, ca_key, name, hosts, server=True))
        written += [d / f"{name}.pem", d / f"{name}.key"]
    for name in ("admin", *clients):
        _write_pair(d, name, *issue(ca_cert, ca_key, name))
        written += [d / f"{name}.pem", d / f"{name}.key"]
    if tokens:
        for fname in (JOIN_TOKEN_FILE, ADMIN_TOKEN_FILE):
            _write_private(d / fname, (new_token() + "\n").encode())
            written.append(d / fname)
    return written
