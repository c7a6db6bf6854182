"""A webhook receiver for notification tests: records every JSON body POSTed to it, and the path
it was POSTed to (a Slack incoming webhook's path holds its token)."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class WebhookReceiver:
    """An HTTP server on 127.0.0.1 (a thread of the test process) keeping each POSTed JSON body."""

    def __init__(self) -> None:
        self.messages: list[dict] = []
        self.paths: list[str] = []
        self._changed = threading.Condition()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - http.server's naming
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                with receiver._changed:
                    receiver.messages.append(json.loads(body))
                    receiver.paths.append(self.path)
                    receiver._changed.notify_all()
                # 200 "ok", as Slack answers (its client checks both); a JSON webhook takes any 2xx.
                self.send_response(200)
                self.send_header("Content-Type", "text/plain")
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"ok")

            def log_message(self, *args):
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_port}/hook"

    def connection_uri(self) -> str:
        """The connection (AIRFLOW_CONN_...) a notifier posts to: its host is the URL."""
        return json.dumps({"conn_type": "http", "host": self.url})

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_port}"

    def slack_connection_uri(self, token: str) -> str:
        """A Slack incoming-webhook connection whose endpoint (host) is this server, as a user
        points one at a proxy: the provider's hook POSTs to host + "/" + the token (password)."""
        return json.dumps({"conn_type": "slack_incoming_webhook", "host": f"{self.base_url}/services", "password": token})

    def wait_for(self, predicate, timeout: float) -> list[dict]:
        """The messages matching `predicate`, once there is one; AssertionError after `timeout`."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while not (found := [m for m in self.messages if predicate(m)]):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"no matching notification in {timeout}s; got {self.messages}")
                self._changed.wait(left)
        return found

    def __enter__(self) -> WebhookReceiver:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()
