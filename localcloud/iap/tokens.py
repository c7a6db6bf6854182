"""The OAuth 2.0 token endpoint for service-account keys: the JWT-bearer grant (RFC 7523) that
google-auth's service_account.Credentials sends to a key file's `token_uri`, answered as
oauth2.googleapis.com/token answers it. A key registered here (its public half) gets access
tokens; the relay (relay.py) asks whose a token is.

What is checked, as Google documents for the grant ("Using OAuth 2.0 for Server to Server
Applications", "Preparing to make an authorized API call"): an RS256 signature by the account's
key, `iss` the account, `aud` https://oauth2.googleapis.com/token (the audience the docs name;
google-auth sends it whatever the key file's token_uri), `exp` no more than an hour after `iat`,
not expired.
The refusals' bodies are the ones google-auth's RefreshError quotes in many public reports (a
key whose account is deleted, a corrupted or rotated key, a skewed clock): `invalid_grant` with
"Invalid grant: account not found", "Invalid JWT Signature." or "Invalid JWT: Token must be a
short-lived token (60 minutes) and in a reasonable timeframe. Check your iat and exp values in
the JWT claim."; and RFC 6749 section 5.2's `unsupported_grant_type`.
"""

from __future__ import annotations

import base64
import json
import secrets
import threading
import time
from urllib.parse import parse_qs

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import padding

PATH = "/token"
TOKENINFO_PATH = "/tokeninfo"
AUDIENCE = "https://oauth2.googleapis.com/token"
JWT_BEARER = "urn:ietf:params:oauth:grant-type:jwt-bearer"
LIFETIME_SECONDS = 3599  # what Google's endpoint answers for a service account's token
MAX_ASSERTION_SECONDS = 3600  # exp - iat, at most an hour
CLOCK_SKEW_SECONDS = 300
TIMEFRAME = ("Invalid JWT: Token must be a short-lived token (60 minutes) and in a reasonable timeframe. "
             "Check your iat and exp values in the JWT claim.")


def _b64decode(part: str) -> bytes:
    return base64.urlsafe_b64decode(part + "=" * (-len(part) % 4))


def _refusal(error: str, description: str) -> tuple[int, dict]:
    return 400, {"error": error, "error_description": description}


def _signed_by(key, signature: bytes, signed: bytes) -> bool:
    try:
        key.verify(signature, signed, padding.PKCS1v15(), hashes.SHA256())
    except InvalidSignature:
        return False
    return True


class TokenIssuer:
    """Service accounts' public keys (by email) and the tokens issued to them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._keys: dict[str, list] = {}  # an account may have several keys, as on Google Cloud
        self._tokens: dict[str, tuple[str, float]] = {}  # token -> (email, expires at)

    def add_service_account(self, email: str, public_key_pem: str) -> dict:
        key = serialization.load_pem_public_key(public_key_pem.encode())
        with self._lock:
            self._keys.setdefault(email, []).append(key)
        return {"email": email}

    def grant(self, form_body: bytes) -> tuple[int, dict]:
        """Answer one POST to the token endpoint."""
        form = {k: v[0] for k, v in parse_qs(form_body.decode(errors="replace")).items()}
        if form.get("grant_type") != JWT_BEARER:
            return _refusal("unsupported_grant_type", f"Invalid grant_type: {form.get('grant_type', '')}")
        try:
            header_b64, claims_b64, signature_b64 = form.get("assertion", "").split(".")
            header = json.loads(_b64decode(header_b64))
            claims = json.loads(_b64decode(claims_b64))
            signature = _b64decode(signature_b64)
        except ValueError:  # no signature that could verify
            return _refusal("invalid_grant", "Invalid JWT Signature.")
        with self._lock:
            keys = list(self._keys.get(claims.get("iss", ""), ()))
        if not keys:
            return _refusal("invalid_grant", "Invalid grant: account not found")
        if header.get("alg") != "RS256" or not any(
            _signed_by(key, signature, f"{header_b64}.{claims_b64}".encode()) for key in keys
        ):
            return _refusal("invalid_grant", "Invalid JWT Signature.")
        now = time.time()
        issued, expires = claims.get("iat", 0), claims.get("exp", 0)
        if (claims.get("aud") != AUDIENCE or not isinstance(issued, (int, float)) or not isinstance(expires, (int, float))
                or expires - issued > MAX_ASSERTION_SECONDS or expires < now - CLOCK_SKEW_SECONDS
                or issued > now + CLOCK_SKEW_SECONDS):
            return _refusal("invalid_grant", TIMEFRAME)
        token = "ya29.localcloud-" + secrets.token_urlsafe(24)
        with self._lock:
            self._tokens[token] = (claims["iss"], now + LIFETIME_SECONDS)
        return 200, {"access_token": token, "expires_in": LIFETIME_SECONDS, "token_type": "Bearer"}

    def tokeninfo(self, token: str) -> tuple[int, dict]:
        """GET /tokeninfo?access_token=T, as oauth2.googleapis.com/tokeninfo answers it: the token's
        email, scope and seconds left; 400 invalid_token "Invalid Value" for any other token (the
        body Google's endpoint gives an unknown or expired token, quoted in public reports)."""
        with self._lock:
            entry = self._tokens.get(token)
        if entry is None or entry[1] < time.time():
            return 400, {"error": "invalid_token", "error_description": "Invalid Value"}
        return 200, {"email": entry[0], "email_verified": "true", "expires_in": str(int(entry[1] - time.time())),
                     "scope": "https://www.googleapis.com/auth/cloud-platform", "access_type": "online"}

    def identity(self, token: str) -> str | None:
        """The service account a current token was issued to; None for any other token."""
        with self._lock:
            entry = self._tokens.get(token)
        if entry is None or entry[1] < time.time():
            return None
        return entry[0]
