"""An SMTP server for notification tests (aiosmtpd, a thread of the test process): keeps every
message it receives, parsed."""

from __future__ import annotations

import email
import email.policy
import json
import threading
import time
from email.message import EmailMessage

from aiosmtpd.controller import Controller

from localcloud.airflow_harness import free_port


class MailReceiver:
    """SMTP on 127.0.0.1 without TLS or login; `messages` are the mails received, in order."""

    def __init__(self) -> None:
        self.messages: list[EmailMessage] = []
        self.envelopes: list[tuple[str, list[str]]] = []  # (MAIL FROM, RCPT TO)
        self._changed = threading.Condition()
        self.port = free_port()
        self._controller = Controller(self, hostname="127.0.0.1", port=self.port)

    async def handle_DATA(self, server, session, envelope):  # noqa: N802 - aiosmtpd's handler name
        message = email.message_from_bytes(envelope.content, policy=email.policy.default)
        with self._changed:
            self.messages.append(message)
            self.envelopes.append((envelope.mail_from, list(envelope.rcpt_tos)))
            self._changed.notify_all()
        return "250 Message accepted for delivery"

    def connection_uri(self, from_email: str) -> str:
        """The SMTP provider's connection (AIRFLOW_CONN_...) that sends through this server."""
        return json.dumps({
            "conn_type": "smtp", "host": "127.0.0.1", "port": self.port,
            "extra": {"from_email": from_email, "disable_ssl": True, "disable_tls": True, "timeout": 10, "retry_limit": 1},
        })

    def wait_for(self, predicate, timeout: float) -> list[EmailMessage]:
        """The messages matching `predicate`, once there is one; AssertionError after `timeout`."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while not (found := [m for m in self.messages if predicate(m)]):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"no matching mail in {timeout}s; got {[m['Subject'] for m in self.messages]}")
                self._changed.wait(left)
        return found

    def __enter__(self) -> MailReceiver:
        self._controller.start()
        return self

    def __exit__(self, *exc) -> None:
        self._controller.stop()


def body_text(message: EmailMessage) -> str:
    """The mail's text: its HTML part with the markup left in (the tests look for phrases)."""
    part = message.get_body(preferencelist=("html", "plain"))
    return part.get_content() if part is not None else ""
