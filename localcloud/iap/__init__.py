"""Identity-Aware Proxy's TCP forwarding (the relay behind `gcloud compute start-iap-tunnel`) and
the OAuth 2.0 token endpoint whose tokens it checks, served by the compute emulator's process
(the relay reaches the VMs the Compute API knows, by their internal address).

- tokens: service-account keys' JWT-bearer grant (what oauth2.googleapis.com/token does for a key
  file's `token_uri`), the access tokens it issued and whose they are
- relay: the WebSocket relay (tunnel.cloudproxy.app /v4/connect): who may tunnel to which
  project's instances, the subprotocol's frames, its refusals
"""
