"""A run's own CA and certificates for Dynamo's etcd and NATS, made in memory when it starts them.

When a deployment's workers run on other nodes than the client host, its etcd and NATS listen
on the client node's address and admit only clients that present a certificate of the run's
CA (mutual TLS). The material lives in this process and in the lanes' private 0600 files
(`frontends.ServicePems`), never in the record, a log, argv or an environment; a new run
makes new keys. Elliptic-curve keys (P-256): quick to make, and both etcd (Go) and Dynamo's
Rust clients accept them.
"""

from __future__ import annotations

import datetime
import ipaddress

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from slurmgate.runtime.engines import layout as layout_mod
from slurmgate.runtime.engines import service_lanes
from slurmgate.runtime.engines.frontends import LOOPBACK, ServicePems
from slurmgate.runtime.run.state import RunContext

VALIDITY = datetime.timedelta(days=8)  # past any run's time limit; a run's keys die with it
CLOCK_SKEW = datetime.timedelta(minutes=10)  # nodes' clocks may trail the client host's


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _key_pem(key: ec.EllipticCurvePrivateKey) -> str:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    ).decode()


def _cert_pem(cert: x509.Certificate) -> str:
    return cert.public_bytes(serialization.Encoding.PEM).decode()


def _names(names: list[str]) -> list[x509.GeneralName]:
    out: list[x509.GeneralName] = []
    for name in dict.fromkeys(names):
        try:
            out.append(x509.IPAddress(ipaddress.ip_address(name)))
        except ValueError:
            out.append(x509.DNSName(name))
    return out


def _issue(
    subject: str,
    key: ec.EllipticCurvePrivateKey,
    issuer: x509.Name,
    signer: ec.EllipticCurvePrivateKey,
    usage: list[x509.ObjectIdentifier] | None,
    names: list[str] | None = None,
) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
        .issuer_name(issuer)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - CLOCK_SKEW)
        .not_valid_after(now + VALIDITY)
        .add_extension(x509.BasicConstraints(ca=usage is None, path_length=None), critical=True)
    )
    if usage is None:
        builder = builder.add_extension(
            x509.KeyUsage(False, False, False, False, False, True, True, False, False),
            critical=True,
        )
    else:
        builder = builder.add_extension(x509.ExtendedKeyUsage(usage), critical=False)
    if names:
        builder = builder.add_extension(x509.SubjectAlternativeName(_names(names)), critical=False)
    return builder.sign(signer, hashes.SHA256())


def make_service_pems(run_id: str, server_names: list[str]) -> ServicePems:
    """A fresh CA for one run, a server certificate for `server_names` (the client node's
    address and host name; loopback too) and one client certificate the lanes share."""
    ca_key = _key()
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"slurmgate {run_id} CA")])
    ca = _issue(f"slurmgate {run_id} CA", ca_key, ca_name, ca_key, None)
    server_key, client_key = _key(), _key()
    server = _issue(
        "slurmgate services",
        server_key,
        ca_name,
        ca_key,
        # etcd's HTTP gateway dials its own gRPC listener with the server's certificate
        [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH],
        [*server_names, LOOPBACK, "localhost"],
    )
    client = _issue(
        "slurmgate lanes", client_key, ca_name, ca_key, [ExtendedKeyUsageOID.CLIENT_AUTH]
    )
    return ServicePems(
        ca_cert=_cert_pem(ca),
        server_cert=_cert_pem(server),
        server_key=_key_pem(server_key),
        client_cert=_cert_pem(client),
        client_key=_key_pem(client_key),
    )


def deployment_pems(ctx: RunContext, d: layout_mod.DeploymentPlan) -> ServicePems | None:
    """The certificates of `d`'s etcd and NATS, made once per run and deployment; None when
    they need none (no such services, or every lane on the client host: loopback)."""
    assert ctx.layout
    if not service_lanes.services_tls(ctx.spec.deployments[d.index], ctx.layout, d):
        return None
    if d.name not in ctx.service_pems:
        client = ctx.plan.client_node
        names = [ctx.layout.address(client), ctx.layout.host(client)]
        ctx.service_pems[d.name] = make_service_pems(ctx.run_id, names)
    return ctx.service_pems[d.name]
