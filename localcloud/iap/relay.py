"""IAP's TCP forwarding relay, as `gcloud compute start-iap-tunnel` speaks to it: a WebSocket at
`/v4/connect?project=&zone=&instance=&interface=&port=&newWebsocket=` with the subprotocol
`relay.tunnel.cloudproxy.app` and the caller's access token as a Bearer header, then frames of a
2-byte tag (CONNECT_SUCCESS_SID 1, DATA 4, ACK 7) and a length or count
(googlecloudsdk/api_lib/compute/iap_tunnel_websocket_utils.py and iap_tunnel_websocket.py).

Refusals, as gcloud reports them ("Error while connecting [CODE: 'REASON']"), each from public
reports of that output:
- 4033 'not authorized': the caller lacks iap.tunnelInstances.accessViaIAP (the IAP-secured
  Tunnel User role) on the project;
- 4047 'Failed to lookup instance': no such instance, or one not running yet (reports of VMs still
  booting);
- 4003 'failed to connect to backend': nothing accepts the connection on the instance's port
  (gcloud itself adds "Failed to connect to port N"; also a firewall without 35.235.240.0/20,
  which this relay does not model: its VMs have no firewall).
A request without a token the token endpoint issued is refused before the upgrade with 401 (IAP's
FAQ: requests without valid credentials get 401; gcloud's iap_tunnel_websocket.py reads a
"Handshake status 40x" as missing permissions). The exact status of that refusal is not in a
public capture: 401 is this relay's choice.

The relay speaks TLS only (wss://), as tunnel.cloudproxy.app does: gcloud's WebSocket client
needs a TLS socket (it fails on ws:// with "'socket' object has no attribute 'pending'"). Its
certificate is made at start for 127.0.0.1 and is its own CA: clients trust it as they would a
company's TLS-inspecting proxy's (gcloud's core/custom_ca_certs_file, OpenSSL's SSL_CERT_FILE).

Not modelled: /v4/reconnect (a dropped WebSocket's resume; the relay never drops one), the
flow-control windows behind ACK (each DATA frame received is acknowledged at once).
"""

from __future__ import annotations

import datetime
import ipaddress
import logging
import secrets
import socket
import ssl
import struct
import threading
from collections.abc import Callable
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

from websockets.exceptions import ConnectionClosed
from websockets.sync.server import ServerConnection, serve

log = logging.getLogger(__name__)

SUBPROTOCOL = "relay.tunnel.cloudproxy.app"
TAG_CONNECT_SUCCESS_SID = 0x0001
TAG_DATA = 0x0004
TAG_ACK = 0x0007
MAX_DATA_FRAME = 16384
NOT_AUTHORIZED = (4033, "not authorized")
LOOKUP_FAILED = (4047, "Failed to lookup instance")
BACKEND_FAILED = (4003, "failed to connect to backend")
TUNNEL_PERMISSION = "iap.tunnelInstances.accessViaIAP"
BACKEND_CONNECT_TIMEOUT = 5.0


class TunnelPolicy:
    """Who holds the IAP-secured Tunnel User role on which project (members as IAM writes them:
    `serviceAccount:EMAIL`, `user:EMAIL`)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._members: dict[str, set[str]] = {}

    def grant(self, project: str, member: str) -> dict:
        with self._lock:
            self._members.setdefault(project, set()).add(member)
            return {"project": project, "members": sorted(self._members[project])}

    def revoke(self, project: str, member: str) -> dict:
        with self._lock:
            self._members.get(project, set()).discard(member)
            return {"project": project, "members": sorted(self._members.get(project, ()))}

    def allows(self, project: str, email: str) -> bool:
        with self._lock:
            members = self._members.get(project, set())
        return f"serviceAccount:{email}" in members or f"user:{email}" in members


def self_signed_certificate(folder: Path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 that is its own CA, and its key, written into `folder`."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localcloud IAP relay")])
    now = datetime.datetime.now(datetime.timezone.utc)
    certificate = (
        x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=7))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_file, key_file = folder / "iap-relay-cert.pem", folder / "iap-relay-key.pem"
    cert_file.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    key_file.chmod(0o600)
    return cert_file, key_file


def data_frame(data: bytes) -> bytes:
    return struct.pack(">HI", TAG_DATA, len(data)) + data


def ack_frame(count: int) -> bytes:
    return struct.pack(">HQ", TAG_ACK, count)


class Relay:
    """The relay's server: `identity(token)` names a token's owner (tokens.TokenIssuer.identity);
    `lookup(project, zone, instance)` is the running instance's internal address or None;
    `record(entry)` logs each tunnel asked for, with its outcome."""

    def __init__(
        self,
        identity: Callable[[str], str | None],
        policy: TunnelPolicy,
        lookup: Callable[[str, str, str], str | None],
        record: Callable[[dict], None],
        certificate: tuple[Path, Path],
        host: str = "127.0.0.1",
        port: int = 0,
    ) -> None:
        self.identity, self.policy, self.lookup, self.record = identity, policy, lookup, record
        self.ca_file = certificate[0]
        self._callers: dict[int, str] = {}
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(*certificate)
        self.server = serve(
            self._tunnel, host, port, ssl=context, subprotocols=[SUBPROTOCOL], process_request=self._authenticate,
            compression=None, max_size=None, ping_interval=None,
        )
        self.port = self.server.socket.getsockname()[1]
        self._thread = threading.Thread(target=self.server.serve_forever, name="iap-relay", daemon=True)

    @property
    def endpoint(self) -> str:
        """The relay's URL root, as gcloud's --iap-tunnel-url-override and the connection extra take it."""
        return f"wss://127.0.0.1:{self.port}/v4/"

    def start(self) -> Relay:
        self._thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()

    def _authenticate(self, connection: ServerConnection, request):
        scheme, _, token = (request.headers.get("Authorization") or "").partition(" ")
        email = self.identity(token.strip()) if scheme.lower() == "bearer" else None
        if email is None:
            self.record({"path": request.path, "caller": None, "outcome": 401})
            return connection.respond(401, "Unauthorized\n")
        self._callers[id(connection)] = email
        return None

    def _tunnel(self, connection: ServerConnection) -> None:
        email = self._callers.pop(id(connection), "")
        url = urlsplit(connection.request.path)
        query = {k: v[0] for k, v in parse_qs(url.query).items()}
        project, zone, instance = query.get("project", ""), query.get("zone", ""), query.get("instance", "")
        entry = {"path": url.path, "caller": email, "project": project, "zone": zone, "instance": instance,
                 "port": query.get("port"), "interface": query.get("interface"),
                 "user_agent": connection.request.headers.get("User-Agent", "")}
        if url.path.rstrip("/") != "/v4/connect":
            return self._refuse(connection, entry, LOOKUP_FAILED)
        if not self.policy.allows(project, email):
            return self._refuse(connection, entry, NOT_AUTHORIZED)
        address = self.lookup(project, zone, instance) if query.get("interface") == "nic0" else None
        if address is None:
            return self._refuse(connection, entry, LOOKUP_FAILED)
        try:
            backend = socket.create_connection((address, int(query.get("port") or 0)), timeout=BACKEND_CONNECT_TIMEOUT)
        except (OSError, ValueError):
            return self._refuse(connection, entry, BACKEND_FAILED)
        self.record({**entry, "outcome": "connected"})
        backend.settimeout(None)
        sid = secrets.token_hex(16).encode()
        connection.send(struct.pack(">HI", TAG_CONNECT_SUCCESS_SID, len(sid)) + sid)
        threading.Thread(target=self._to_client, args=(backend, connection), daemon=True).start()
        self._to_backend(connection, backend)

    def _refuse(self, connection: ServerConnection, entry: dict, refusal: tuple[int, str]) -> None:
        self.record({**entry, "outcome": refusal[0]})
        connection.close(*refusal)

    @staticmethod
    def _to_client(backend: socket.socket, connection: ServerConnection) -> None:
        """The instance's bytes, in DATA frames, until it closes the connection."""
        try:
            while data := backend.recv(MAX_DATA_FRAME):
                connection.send(data_frame(data))
        except (OSError, ConnectionClosed):
            pass
        connection.close()

    @staticmethod
    def _to_backend(connection: ServerConnection, backend: socket.socket) -> None:
        """The client's DATA frames to the instance, each acknowledged, until either side closes."""
        received = 0
        try:
            for message in connection:
                if not isinstance(message, bytes) or len(message) < 2:
                    continue
                (tag,) = struct.unpack(">H", message[:2])
                if tag != TAG_DATA:
                    continue  # the client's ACKs: nothing is kept to resend
                (length,) = struct.unpack(">I", message[2:6])
                backend.sendall(message[6 : 6 + length])
                received += length
                connection.send(ack_frame(received))
        except (OSError, ConnectionClosed):
            pass
        finally:
            try:
                backend.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            backend.close()
