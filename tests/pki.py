"""A throwaway PKI for TLS and mutual-TLS tests: a CA, a server certificate for
localhost/127.0.0.1, client certificates. Light on purpose (cryptography only, imported when
called), so that unit tests use it without the e2e support module's imports."""

from __future__ import annotations

from pathlib import Path


def _certificate(name: str, issuer_key, issuer_name, key, is_ca: bool, sans=None):
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    builder = (x509.CertificateBuilder().subject_name(subject)
               .issuer_name(issuer_name or subject)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5))
               .not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=is_ca, path_length=None), critical=True))
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def make_pki(folder: Path, clients: dict[str, list[str]] | None = None,
             ca_name: str = "guard-test-ca") -> dict[str, Path]:
    """A CA (``ca``), a server certificate for localhost/127.0.0.1 (``server_cert``,
    ``server_key``) and one client certificate per entry of ``clients`` (name -> URI SANs;
    none: the default ``client`` with DNS/IP SANs). Files are PEM."""
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    folder.mkdir(parents=True, exist_ok=True)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = _certificate(ca_name, ca_key, None, ca_key, True)
    files = {"ca": folder / "ca.pem"}
    files["ca"].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    host = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    wanted = {"server": host}
    for who, uris in (clients or {"client": None}).items():
        wanted[who] = [x509.UniformResourceIdentifier(u) for u in uris] if uris else host
    for who, sans in wanted.items():
        key = ec.generate_private_key(ec.SECP256R1())
        cert = _certificate(who, ca_key, ca.subject, key, False, sans)
        files[f"{who}_cert"] = folder / f"{who}.pem"
        files[f"{who}_key"] = folder / f"{who}.key"
        files[f"{who}_cert"].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        files[f"{who}_key"].write_bytes(key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption()))
    return files
