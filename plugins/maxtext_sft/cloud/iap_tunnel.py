"""SSH through Identity-Aware Proxy's TCP forwarding under the Google connection's own identity.

With the Param `ssh_via_iap`, every SSH connection to the VM (a worker's paramiko, a trigger's
asyncssh) runs over a tunnel this module opens: a WebSocket to IAP's relay, authorised with an
access token of the run's Google connection (its key file, its impersonation chain, or the
environment's credentials: whatever GoogleBaseHook makes of it), the VM's port 22 at the other
end. Nothing else is needed on the worker or the triggerer: no gcloud, no account of its own.

The relay's protocol is the one gcloud speaks (googlecloudsdk/api_lib/compute/
iap_tunnel_websocket_utils.py, iap_tunnel_websocket.py): `wss://tunnel.cloudproxy.app/v4/connect`
with project, zone, instance, interface, port and newWebsocket in the query; the subprotocol
`relay.tunnel.cloudproxy.app`; the origin `bot:iap-tunneler`; the token as a Bearer header. Then
frames of a 2-byte tag: CONNECT_SUCCESS_SID (1; 4-byte length, the session id), DATA (4; 4-byte
length, at most 16384 bytes), ACK (7; 8-byte count of bytes received). The relay refuses by closing
with a code (what gcloud prints as "Error while connecting [4033: 'not authorized']").

The tunnel hands SSH one end of a socket pair; two threads carry the bytes between its other end
and the WebSocket. A dropped WebSocket ends the SSH connection (gcloud resumes one with
/v4/reconnect; a step's SSH connection is retried instead).

The relay's address comes from the Google connection extra `iap_tunnel_endpoint` (default
`wss://tunnel.cloudproxy.app/v4/`), as gcloud's `--iap-tunnel-url-override` sets it. Whether the
identity may tunnel is asked before any VM exists (preflight) from the Resource Manager API's
projects.testIamPermissions (extra `resourcemanager_api_endpoint`, gcloud's
api_endpoint_overrides/cloudresourcemanager format: the host root).
"""

from __future__ import annotations

import socket
import struct
import threading
from functools import cached_property
from urllib.parse import urlencode, urlsplit

from airflow.providers.google.common.hooks.base_google import GoogleBaseHook
from airflow.sdk.exceptions import AirflowException
from maxtext_sft.cloud.endpoints import endpoint_override

IAP_TUNNEL_ENDPOINT = "wss://tunnel.cloudproxy.app/v4/"
RESOURCE_MANAGER_ENDPOINT = "https://cloudresourcemanager.googleapis.com/"
TUNNEL_PERMISSION = "iap.tunnelInstances.accessViaIAP"
SUBPROTOCOL = "relay.tunnel.cloudproxy.app"
ORIGIN = "bot:iap-tunneler"
TAG_CONNECT_SUCCESS_SID = 0x0001
TAG_DATA = 0x0004
TAG_ACK = 0x0007
MAX_DATA_FRAME = 16384
# gcloud acknowledges once more than twice the frame size arrived unacknowledged (_ShouldSendAck).
ACK_AFTER_BYTES = 2 * MAX_DATA_FRAME
TUNNEL_ROLE = "IAP-secured Tunnel User (roles/iap.tunnelResourceAccessor: iap.tunnelInstances.accessViaIAP)"

# The relay's close codes that mean "not now": the instance is not found or not running yet
# (4047, reported while VMs boot), or nothing accepts on its port yet (4003; also a firewall
# without IAP's range 35.235.240.0/20). localcloud/iap/relay.py names the public reports.
NOT_YET = {4047, 4003}
NOT_AUTHORIZED = 4033


class IapTunnelError(ConnectionError):
    """The tunnel did not open, or not now: an OSError, as any connection that fails to open (the
    waits for SSH read it as "not reachable yet")."""


class IapTunnelRefused(AirflowException):
    """IAP refused the connection's identity: waiting does not help."""


def tunnel_url(endpoint: str, project: str, zone: str, instance: str, port: int) -> str:
    """The relay's connect URL, with the query gcloud's CreateWebSocketConnectUrl sends."""
    query = {"project": project, "port": port, "newWebsocket": True, "zone": zone, "instance": instance,
             "interface": "nic0"}
    return f"{endpoint.rstrip('/')}/connect?{urlencode(query)}"


class IapTunnelHook(GoogleBaseHook):
    """Opens tunnels to a VM's port through IAP with the Google connection's credentials. `caller`
    names who asks ("worker" or "triggerer") in the User-Agent, for the relay's logs."""

    def __init__(self, gcp_conn_id: str = "google_cloud_default", *, caller: str = "worker", **kwargs):
        super().__init__(gcp_conn_id=gcp_conn_id, **kwargs)
        self.caller = caller

    @cached_property
    def endpoint(self) -> str:
        endpoint = (self._get_field("iap_tunnel_endpoint", None) or IAP_TUNNEL_ENDPOINT).rstrip("/") + "/"
        parts = urlsplit(endpoint)
        if parts.scheme not in ("wss", "ws") or not parts.netloc:
            raise ValueError(
                f"Connection {self.gcp_conn_id!r}: iap_tunnel_endpoint must be a ws:// or wss:// URL "
                f"such as {IAP_TUNNEL_ENDPOINT}, got {endpoint!r}"
            )
        return endpoint

    def access_token(self) -> str:
        """A current access token of the connection's credentials; IapTunnelRefused when they have
        none to give (anonymous credentials) or the token endpoint refuses them."""
        from google.auth.credentials import AnonymousCredentials
        from google.auth.exceptions import RefreshError
        from google.auth.transport.requests import Request

        credentials = self.get_credentials()
        if isinstance(credentials, AnonymousCredentials):
            raise IapTunnelRefused(
                f"Google connection {self.gcp_conn_id!r} is anonymous: SSH through IAP needs an identity "
                f"with the {TUNNEL_ROLE} role (a key file, an impersonation chain or the environment's credentials)"
            )
        try:
            if not credentials.valid:
                credentials.refresh(Request())
        except RefreshError as error:
            raise IapTunnelRefused(
                f"Google connection {self.gcp_conn_id!r} could not get an access token for the IAP tunnel: {error}"
            ) from None
        return credentials.token

    def may_tunnel(self, project: str) -> bool:
        """Whether the connection's identity holds iap.tunnelInstances.accessViaIAP on `project`
        (projects.testIamPermissions, Resource Manager v1: it answers the subset of the asked
        permissions the caller holds, and needs no permission itself). A grant on one instance
        only, or one with an IAM condition, does not show here."""
        from google.auth.transport.requests import AuthorizedSession

        self.access_token()  # the same refusals as a tunnel's, before any request
        root = endpoint_override(self, "resourcemanager_api_endpoint", "") or RESOURCE_MANAGER_ENDPOINT
        response = AuthorizedSession(self.get_credentials()).post(
            f"{root}v1/projects/{project}:testIamPermissions", json={"permissions": [TUNNEL_PERMISSION]}, timeout=30
        )
        response.raise_for_status()
        return TUNNEL_PERMISSION in (response.json().get("permissions") or [])

    def identity(self) -> str:
        """Who the connection's credentials are, as far as they tell (for messages)."""
        credentials = self.get_credentials()
        return (getattr(credentials, "service_account_email", None) or getattr(credentials, "signer_email", None)
                or "the connection's credentials")

    def open(self, *, project: str, zone: str, instance: str, port: int = 22, timeout: float = 30) -> socket.socket:
        """A connected socket whose bytes reach `instance`'s `port` through IAP (blocking: a trigger
        calls it in a thread). Raises IapTunnelRefused when IAP refuses the identity,
        IapTunnelError (an OSError) when the instance cannot be reached now."""
        from websockets.exceptions import ConnectionClosed, InvalidStatus
        from websockets.sync.client import connect

        url = tunnel_url(self.endpoint, project, zone, instance, port)
        token = self.access_token()
        where = f"instance {instance} ({project}, {zone}) port {port}"
        try:
            # Entered as a `with` block would enter it (websockets 17 asks that of connect()'s result),
            # but left open: the threads that carry the bytes own it until either end closes.
            websocket = connect(
                url, additional_headers={"Authorization": f"Bearer {token}"}, subprotocols=[SUBPROTOCOL],
                origin=ORIGIN, open_timeout=timeout, compression=None, max_size=None, ping_interval=None,
                user_agent_header=f"maxtext-sft-{self.caller}",
            ).__enter__()
        except InvalidStatus as error:
            status = error.response.status_code
            if status in (401, 403):
                raise IapTunnelRefused(
                    f"IAP refused the tunnel to {where}: HTTP {status} for {self.identity()}; it needs the "
                    f"{TUNNEL_ROLE} role on project {project}"
                ) from None
            raise IapTunnelError(f"IAP answered HTTP {status} for the tunnel to {where}") from None
        try:
            first = websocket.recv(timeout=timeout)
        except ConnectionClosed as closed:
            code, reason = (closed.rcvd.code, closed.rcvd.reason) if closed.rcvd else (None, "closed")
            said = f"IAP closed the tunnel to {where}: [{code}: {reason!r}]"
            if code == NOT_AUTHORIZED:
                raise IapTunnelRefused(f"{said}. {self.identity()} needs the {TUNNEL_ROLE} role on project {project}") from None
            if code in NOT_YET:
                raise IapTunnelError(f"{said} (the VM is not running or not listening yet, or a firewall rule does "
                                     "not let 35.235.240.0/20 reach it)") from None
            raise IapTunnelError(said) from None
        except TimeoutError:
            websocket.close()
            raise IapTunnelError(f"IAP did not open the tunnel to {where} within {timeout:g} s") from None
        if not isinstance(first, bytes) or struct.unpack(">H", first[:2])[0] != TAG_CONNECT_SUCCESS_SID:
            websocket.close()
            raise IapTunnelError(f"IAP's relay sent an unexpected first frame for the tunnel to {where}")
        ours, theirs = socket.socketpair()
        threading.Thread(target=_to_relay, args=(ours, websocket), daemon=True, name=f"iap-out-{instance}").start()
        threading.Thread(target=_from_relay, args=(websocket, ours), daemon=True, name=f"iap-in-{instance}").start()
        return theirs


def _to_relay(ours: socket.socket, websocket) -> None:
    """SSH's bytes to the relay in DATA frames; the WebSocket closes when SSH closes its end."""
    try:
        while data := ours.recv(MAX_DATA_FRAME):
            websocket.send(struct.pack(">HI", TAG_DATA, len(data)) + data)
    except Exception:  # noqa: BLE001 - either side gone: the tunnel ends
        pass
    finally:
        websocket.close()


def _from_relay(websocket, ours: socket.socket) -> None:
    """The relay's DATA frames to SSH, acknowledged as gcloud acknowledges them; SSH sees the end
    of its connection when the relay closes."""
    received = acknowledged = 0
    try:
        for message in websocket:
            if not isinstance(message, bytes) or len(message) < 6:
                continue
            (tag,) = struct.unpack(">H", message[:2])
            if tag != TAG_DATA:
                continue  # the relay's ACKs: nothing is kept to resend
            (length,) = struct.unpack(">I", message[2:6])
            ours.sendall(message[6 : 6 + length])
            received += length
            if received - acknowledged > ACK_AFTER_BYTES:
                websocket.send(struct.pack(">HQ", TAG_ACK, received))
                acknowledged = received
    except Exception:  # noqa: BLE001 - either side gone: the tunnel ends
        pass
    finally:
        try:
            ours.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        ours.close()


def iap_target(gcp_conn_id: str, project: str, zone: str, instance: str, port: int = 22) -> dict:
    """What a tunnel to a VM needs, as plain JSON values (a trigger's argument: no secret in it)."""
    return {"gcp_conn_id": gcp_conn_id, "project": project, "zone": zone, "instance": instance, "port": port}


def open_tunnel(target: dict, timeout: float = 30, caller: str = "worker") -> socket.socket:
    """IapTunnelHook.open for an `iap_target`."""
    hook = IapTunnelHook(gcp_conn_id=target["gcp_conn_id"], caller=caller)
    return hook.open(project=target["project"], zone=target["zone"], instance=target["instance"],
                     port=int(target.get("port", 22)), timeout=timeout)
