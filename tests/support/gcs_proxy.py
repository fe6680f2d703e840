"""A loopback TCP proxy in front of the GCS emulator that misbehaves on request, for GCS fault tests.

One HTTP exchange per connection (the emulator speaks HTTP/1.0 and closes when its reply is
done). Two ways to choose a fault: ``plan(n, head)`` for every request (tests/stories/test_faults_gcs.py:
stalls, 429/503 storms), and ``drop_next(marker)`` / ``cut_next(marker)`` for the next request
whose head contains a marker (tests/backends/test_gcs_backend.py: one lost reply at an exact point
of an upload; tests/backends/test_ranged_read.py: one ranged GET answered short).
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable

# A plan maps (request index, 1-based; request head) to an action: "pass", "stall" (hold the
# socket, answer nothing), "drop" (forward, apply, swallow the reply), "cut" (forward, then send
# the reply with half its body and a Content-Length to match), or an HTTP status to answer
# without forwarding (429, 503).
Plan = Callable[[int, bytes], "str | int"]


class LoopbackProxy:
    """A TCP proxy on 127.0.0.1 that can stall, drop replies, or answer with an error status.

    A dropped reply is the realistic lost reply: the request reaches the server and is applied;
    the client then sees its connection close without an answer.

    Attributes:
        endpoint: ``http://127.0.0.1:PORT``, for ``GCSBackend(endpoint_url=...)``.
        plan: consulted for every request not claimed by a ``drop_next`` rule.
        seen: ``(action, request line)`` of every request, in order.
        dropped: ``request line -> reply status line`` of every reply swallowed by a rule.
        cut: ``request line -> reply status line`` of every reply sent short by a rule.
        released: set by ``close()``; stalled connections wait for it (at most 60 s).
    """

    def __init__(self, upstream_port: int) -> None:
        self.upstream = upstream_port
        self.plan: Plan = lambda n, head: "pass"
        self.seen: list[tuple[str | int, bytes]] = []
        self.dropped: list[bytes] = []
        self.cut: list[bytes] = []
        self.released = threading.Event()
        self._rules: list[tuple[bytes, str, Callable[[], None] | None]] = []
        self._count = 0
        self._lock = threading.Lock()
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        threading.Thread(target=self._accept, daemon=True).start()

    def drop_next(self, marker: bytes, then: Callable[[], None] | None = None) -> None:
        """Swallow the reply to the next request whose head contains ``marker``.

        ``then`` runs after the server answered and before the client's connection is cut.
        """
        with self._lock:
            self._rules.append((marker, "drop", then))

    def cut_next(self, marker: bytes) -> None:
        """Send the reply to the next request whose head contains ``marker`` with half its body.

        The head is made consistent (``Content-Length``, ``Content-Range``), so the HTTP client
        sees a complete, well-formed reply that holds fewer bytes than were asked: a middlebox or
        store that ends a ranged answer early, which only the reader can notice.
        """
        with self._lock:
            self._rules.append((marker, "cut", None))

    def close(self) -> None:
        self.released.set()
        self.sock.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        client.settimeout(30)
        with client:
            head = b""
            try:
                while b"\r\n\r\n" not in head:
                    data = client.recv(65536)
                    if not data:
                        return
                    head += data
            except OSError:
                return
            request_head = head.split(b"\r\n\r\n")[0]
            with self._lock:
                self._count += 1
                rule = next((r for r in self._rules if r[0] in request_head), None)
                if rule is not None:
                    self._rules.remove(rule)
                    action: str | int = rule[1]
                else:
                    action = self.plan(self._count, head)
                self.seen.append((action, head.split(b"\r\n")[0]))
            if action == "stall":  # a frozen server: holds the socket, reads and answers nothing
                self.released.wait(60)
                return
            if isinstance(action, int):
                body = b'{"error": {"code": %d, "message": "injected"}}' % action
                client.sendall(
                    b"HTTP/1.1 %d Injected\r\nContent-Type: application/json\r\n"
                    b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (action, len(body), body)
                )
                return
            self._forward(client, head, action=str(action), then=rule[2] if rule else None)

    def _forward(self, client: socket.socket, head: bytes, *, action: str, then: Callable[[], None] | None) -> None:
        drop = action in ("drop", "cut")  # both hold the reply back: "cut" sends it short later
        with socket.create_connection(("127.0.0.1", self.upstream), timeout=30) as up:
            up.sendall(head)

            def pump() -> None:
                try:
                    while data := client.recv(1 << 20):
                        up.sendall(data)
                except OSError:
                    pass

            threading.Thread(target=pump, daemon=True).start()
            reply = b""
            answered = False
            try:
                while data := up.recv(1 << 20):  # the emulator closes when its reply is done
                    if drop:
                        reply += data
                    else:
                        client.sendall(data)
                answered = True
            except OSError:
                pass
            if action == "cut" and answered:
                self.cut.append(head.split(b"\r\n")[0] + b" -> " + reply.split(b"\r\n")[0])
                try:
                    client.sendall(_cut(reply))
                except OSError:
                    pass
            elif drop and answered:
                self.dropped.append(head.split(b"\r\n")[0] + b" -> " + reply.split(b"\r\n")[0])
                if then is not None:
                    then()
            # shutdown, not just close: close() would wait for the pump thread's recv() to end.
            for s in (client, up):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass


def _cut(reply: bytes) -> bytes:
    """``reply`` (one whole HTTP response) with the first half of its body and a head to match."""
    head, _, body = reply.partition(b"\r\n\r\n")
    kept = body[: len(body) // 2]
    lines = []
    for line in head.split(b"\r\n"):
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            line = b"Content-Length: %d" % len(kept)
        elif name.strip().lower() == b"content-range" and kept:  # bytes FIRST-LAST/TOTAL
            first, _, total = value.strip().removeprefix(b"bytes ").partition(b"-")
            total = total.partition(b"/")[2]
            line = b"Content-Range: bytes %d-%d/%s" % (int(first), int(first) + len(kept) - 1, total)
        lines.append(line)
    return b"\r\n".join(lines) + b"\r\n\r\n" + kept
