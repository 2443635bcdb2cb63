"""TLS and mutual TLS against a real daemon, with certificates made here; and the refusal to listen
beyond loopback without TLS and tokens."""

from __future__ import annotations

import datetime
import ipaddress
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from cli.main import main
from kvstore.client import Client, ClientTls
from kvstore.errors import Unavailable
from tests.helpers.daemon import REPO, Daemon, clean_env, make_session, running_daemon, save_session, serve_command


@dataclass(frozen=True)
class Pki:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    other_ca: Path  # a CA that signed nothing here


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _write(path: Path, key: ec.EllipticCurvePrivateKey, cert: x509.Certificate) -> tuple[Path, Path]:
    path.with_suffix(".key").write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                                           serialization.PrivateFormat.PKCS8,
                                                           serialization.NoEncryption()))
    path.with_suffix(".pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return path.with_suffix(".pem"), path.with_suffix(".key")


def _issue(subject: str, key: ec.EllipticCurvePrivateKey, issuer: tuple[x509.Name, ec.EllipticCurvePrivateKey] | None,
           *extensions: tuple[x509.ExtensionType, bool]) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC)
    issuer_name, issuer_key = issuer or (_name(subject), key)
    b = (x509.CertificateBuilder().subject_name(_name(subject)).issuer_name(issuer_name)
         .public_key(key.public_key()).serial_number(x509.random_serial_number())
         .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1)))
    for ext, critical in extensions:
        b = b.add_extension(ext, critical=critical)
    return b.sign(issuer_key, hashes.SHA256())


def _ca(tmp: Path, name: str) -> tuple[Path, x509.Name, ec.EllipticCurvePrivateKey]:
    key = ec.generate_private_key(ec.SECP256R1())
    cert = _issue(name, key, None, (x509.BasicConstraints(ca=True, path_length=None), True))
    pem, _ = _write(tmp / name, key, cert)
    return pem, cert.subject, key


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    """A CA; a server certificate for 127.0.0.1 and localhost; a client certificate."""
    tmp = tmp_path_factory.mktemp("pki")
    ca_pem, ca_name, ca_key = _ca(tmp, "test-ca")
    other_ca, _, _ = _ca(tmp, "other-ca")
    server_key = ec.generate_private_key(ec.SECP256R1())
    san = x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))])
    server = _issue("kvstore-test-server", server_key, (ca_name, ca_key), (san, False),
                    (x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), False))
    client_key = ec.generate_private_key(ec.SECP256R1())
    client = _issue("kvstore-test-client", client_key, (ca_name, ca_key),
                    (x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), False))
    server_cert, server_key_path = _write(tmp / "server", server_key, server)
    client_cert, client_key_path = _write(tmp / "client", client_key, client)
    return Pki(ca_pem, server_cert, server_key_path, client_cert, client_key_path, other_ca)


def _tls_flags(pki: Pki) -> tuple[str, ...]:
    return ("--tls-cert-file", str(pki.server_cert), "--tls-key-file", str(pki.server_key))


@pytest.fixture(scope="module")
def tls_daemon(pki: Pki, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    with running_daemon(tmp_path_factory.mktemp("tls") / "data", *_tls_flags(pki)) as d:
        yield d


@pytest.fixture(scope="module")
def mtls_daemon(pki: Pki, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    with running_daemon(tmp_path_factory.mktemp("mtls") / "data", *_tls_flags(pki),
                        "--tls-client-ca-file", str(pki.ca)) as d:
        yield d


# how a refused TLS handshake reads on the client: the daemon closed the connection (a plaintext
# client; a client without the certificate mTLS asks for), or the client refused the daemon's certificate
CLOSED_BY_THE_DAEMON = ("Socket closed", "Connection reset by peer")
UNKNOWN_ISSUER = ("CERTIFICATE_VERIFY_FAILED",)
WRONG_NAME = ("Hostname Verification Check failed",)


def _fails(daemon: Daemon, tls: ClientTls | None, why: tuple[str, ...], good: ClientTls) -> None:
    """The call fails at the TLS handshake, for the reason ``why`` names, and not because the daemon
    is gone: it is alive, and a client with the right credentials is served right after."""
    with Client(address=daemon.address, tls=tls, retries=0, timeout_s=10) as c, pytest.raises(Unavailable) as e:
        c.list_sessions()
    message = str(e.value)
    assert any(w in message for w in why), message
    assert "Connection refused" not in message, message  # what a dead daemon's port answers
    assert daemon.proc.poll() is None, "the daemon died"
    with Client(address=daemon.address, tls=good, retries=0, timeout_s=10, shared_memory=False) as ok:
        assert ok.list_sessions() is not None


def test_tls_with_the_ca(tls_daemon: Daemon, pki: Pki) -> None:
    # no shared memory: the chunks themselves cross the TLS channel
    with Client(address=tls_daemon.address, tls=ClientTls(ca_file=str(pki.ca)), shared_memory=False) as c:
        assert c.health() == "SERVING"
        s = make_session(namespace="tls", tokens=600)
        save_session(c, s)
        _, chunks = c.load_session("tls", "s1")
        assert [bytes(b) for _, b in chunks] == s.blobs
    localhost = f"localhost:{tls_daemon.port}"  # the DNS name in the certificate works too
    with Client(address=localhost, tls=ClientTls(ca_file=str(pki.ca))) as c:
        assert [x.session_id for x in c.list_sessions("tls")] == ["s1"]


def test_tls_refuses_plaintext_and_unknown_cas(tls_daemon: Daemon, pki: Pki) -> None:
    good = ClientTls(ca_file=str(pki.ca))
    _fails(tls_daemon, None, CLOSED_BY_THE_DAEMON, good)  # plaintext client
    _fails(tls_daemon, ClientTls(ca_file=str(pki.other_ca)), UNKNOWN_ISSUER, good)  # a CA that did not sign it
    # a name the certificate does not carry
    _fails(tls_daemon, ClientTls(ca_file=str(pki.ca), server_name="kvstore.example.com"), WRONG_NAME, good)


def test_mtls_needs_a_client_certificate(mtls_daemon: Daemon, pki: Pki) -> None:
    with_cert = ClientTls(ca_file=str(pki.ca), cert_file=str(pki.client_cert), key_file=str(pki.client_key))
    with Client(address=mtls_daemon.address, tls=with_cert) as c:
        assert c.health() == "SERVING"
        assert c.list_sessions() == []
    _fails(mtls_daemon, ClientTls(ca_file=str(pki.ca)), CLOSED_BY_THE_DAEMON, with_cert)  # no client certificate
    _fails(mtls_daemon, None, CLOSED_BY_THE_DAEMON, with_cert)


# -- binding beyond loopback ------------------------------------------------------------------------
def _serve(tmp: Path, *flags: str, timeout_s: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(serve_command(tmp / "data", *flags), cwd=REPO, env=clean_env(), capture_output=True,
                          text=True, timeout=timeout_s)


@pytest.mark.parametrize("tls", [False, True], ids=["plaintext", "tls-without-tokens"])
def test_refuses_a_public_bind_without_tls_and_tokens(tmp_path: Path, pki: Pki, tls: bool) -> None:
    r = _serve(tmp_path, "--host", "0.0.0.0", *(_tls_flags(pki) if tls else ()))
    assert r.returncode != 0 and r.stdout == ""
    assert r.returncode == 2 and r.stderr.strip() == (
        "kvstore: error: refusing to listen on 0.0.0.0 (not a loopback address) without TLS and bearer tokens: "
        "configure --tls-cert-file/--tls-key-file and --tokens-file, or pass --allow-insecure-remote")


def test_allow_insecure_remote_overrides_the_refusal(tmp_path: Path) -> None:
    with running_daemon(tmp_path / "data", "--host", "0.0.0.0", "--allow-insecure-remote") as d:
        assert d.address.startswith("0.0.0.0:")
        assert d.stop() == 0  # at once: no public listener stays up; SIGTERM right after ready is clean


def test_cli_tls_flags(tls_daemon: Daemon, mtls_daemon: Daemon, pki: Pki, capsys: pytest.CaptureFixture[str]) -> None:
    ca = ("--tls-ca-file", str(pki.ca))
    client_cert = ("--tls-cert-file", str(pki.client_cert), "--tls-key-file", str(pki.client_key))
    assert main(["health", "--address", tls_daemon.address, *ca]) == 0
    assert main(["health", "--address", mtls_daemon.address, *ca, *client_cert]) == 0
    assert capsys.readouterr().out.split() == ["SERVING", "SERVING"]
    for argv in (["health", "--address", tls_daemon.address], ["health", "--address", mtls_daemon.address, *ca]):
        assert main(argv) == 1  # the command failed (exit 2 is for usage and configuration errors)
        err = capsys.readouterr().err.strip()
        assert err.startswith("kvstore: error: cannot reach kvstore daemon at 127.0.0.1:") and "\n" not in err
