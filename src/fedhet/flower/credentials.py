"""Credentials of a Flower deployment: a TLS certificate authority and server certificate, and
the key pairs of SuperNode authentication, made with the ``cryptography`` package flwr depends on.
For loopback runs and tests; a real deployment uses certificates from its own CA
(docs/deployment.md)."""

from __future__ import annotations

import datetime
import os
from pathlib import Path


def make_certificates(out_dir: str | Path, hosts: tuple[str, ...] = ("127.0.0.1", "localhost"),
                      days: int = 30) -> dict[str, Path]:
    """A self-signed CA and a server certificate for ``hosts`` (IPs or DNS names). Returns paths
    ``ca``, ``cert``, ``key``."""
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    from fedhet.core.errors import ConfigError

    if (isinstance(hosts, str) or not hosts or not all(isinstance(h, str) and h for h in hosts)
            or len(hosts[0]) > 64):      # the first is the certificate's common name: X.509 holds 64 characters
        raise ConfigError(f"make_certificates: hosts must be one or more IPs or DNS names, the first of at most 64 "
                          f"characters, e.g. ('127.0.0.1', 'localhost'); got {hosts!r:.80}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC)
    start, end = now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=days)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "fedhet test CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(start).not_valid_after(end)
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    sans = []
    for h in hosts:
        try:
            sans.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            sans.append(x509.DNSName(h))
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0])]))
            .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(start).not_valid_after(end)
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .sign(ca_key, hashes.SHA256()))
    paths = {"ca": out / "ca.crt", "cert": out / "server.pem", "key": out / "server.key"}
    paths["ca"].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths["cert"].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    paths["key"].write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                               serialization.NoEncryption()))
    os.chmod(paths["key"], 0o600)
    return paths


def public_key_path(private_key: Path) -> Path:
    """Where :func:`make_node_key` writes the public key of ``private_key``: beside it, ``.pub`` added."""
    return private_key.parent / f"{private_key.name}.pub"


def make_node_key(path: str | Path) -> Path:
    """An EC (P-384) key pair for SuperNode authentication, in the OpenSSH format flwr reads
    (what ``ssh-keygen -t ecdsa -b 384 -N ""`` writes): ``path`` (private, mode 600) and
    ``path.pub``. Returns the private key's path."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    key = ec.generate_private_key(ec.SECP384R1())
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                                       serialization.NoEncryption()))
    os.chmod(path, 0o600)
    public_key_path(path).write_bytes(key.public_key().public_bytes(serialization.Encoding.OpenSSH,
                                                                       serialization.PublicFormat.OpenSSH))
    return path
