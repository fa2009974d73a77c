"""A TCP fault proxy for ``onceflow verify``: the job reaches a server through it, and faults
cut the path or lose a reply.

Guarantees:
* While no fault is active every byte passes unchanged, in order, in both directions (one
  thread per direction per connection; the stdlib only).
* :meth:`FaultProxy.partition` closes every open connection with a reset and refuses
  (accepts and resets) every new one until it returns: the server is unreachable, and no
  byte sent before the cut is delivered after it.
* :meth:`FaultProxy.lose_replies` (``postgres`` protocol only) lets chosen commits reach the
  server and drops the server's whole answer to them: the proxy forwards a ``COMMIT ...``
  statement (simple query or Parse message; ``COMMIT PREPARED`` included) or a ``PREPARE
  TRANSACTION`` (the server holds the prepared transaction, the task never learns it), withholds
  everything the server sends from then on, and resets both sides once the server's
  ReadyForQuery for it has arrived, i.e. after the server acted. The client only sees its
  connection die. Connections that negotiate TLS are passed through uninspected (the job's
  DSN through the proxy sets ``sslmode=disable``).
"""

from __future__ import annotations

import re
import socket
import struct
import threading
import time

_SSL_REQUEST, _GSS_REQUEST, _CANCEL, _PROTO_3 = 80877103, 80877104, 80877102, 196608
#: statements whose answer a lost reply drops: a commit, a COMMIT PREPARED, a PREPARE TRANSACTION
_COMMIT = re.compile(rb"^\s*(COMMIT|END|PREPARE\s+TRANSACTION)\b", re.IGNORECASE)


def _reset(sock: socket.socket) -> None:
    """Close with RST (no FIN, no lingering data). ``shutdown(SHUT_RD)`` wakes a thread blocked
    in ``recv`` on it (a plain close would not); the RST goes out when that call returns."""
    for call in (lambda: sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0)),
                 lambda: sock.shutdown(socket.SHUT_RD), sock.close):
        try:
            call()
        except OSError:
            pass


class _Frames:
    """Splits one direction of a PostgreSQL stream into ``(type, body, raw)`` messages. Startup
    messages (client side, before the StartupMessage) have type ``b""``; the server's one-byte
    answers to SSL/GSS requests are ``(b"N", b"", b"N")``."""

    def __init__(self, untyped: bool):
        self.buf = b""
        self.untyped = untyped  # client: untyped until the StartupMessage
        self.single = 0  # server: one-byte answers still expected

    def feed(self, data: bytes) -> list[tuple[bytes, bytes, bytes]]:
        self.buf += data
        out = []
        while True:
            if self.single and self.buf:
                raw, self.buf = self.buf[:1], self.buf[1:]
                self.single -= 1
                out.append((raw, b"", raw))
                continue
            head = 4 if self.untyped else 5
            if len(self.buf) < head:
                return out
            size = struct.unpack("!I", self.buf[head - 4:head])[0]
            end = head - 4 + size
            if len(self.buf) < end:
                return out
            raw, self.buf = self.buf[:end], self.buf[end:]
            out.append((b"" if self.untyped else raw[:1], raw[head:], raw))


class _Conn:
    """One client connection and its server connection."""

    def __init__(self, proxy: FaultProxy, client: socket.socket, server: socket.socket):
        self.proxy, self.client, self.server = proxy, client, server
        inspect = proxy.protocol == "postgres"
        self.up = _Frames(untyped=True) if inspect else None
        self.down = _Frames(untyped=False) if inspect else None
        self.syncs = 0  # ReadyForQuery messages the client's messages so far will get
        self.ready = 0  # ReadyForQuery messages the server sent so far
        self.doom: tuple[int, str] | None = None  # (ReadyForQuery count to cut at, the commit)
        self.tag = ""  # the server's CommandComplete tag after the doomed commit
        self.closed = threading.Event()

    def start(self) -> None:
        for fn in (self._pump_up, self._pump_down):
            threading.Thread(target=fn, daemon=True, name="verify-proxy").start()

    def close(self) -> None:
        if not self.closed.is_set():
            self.closed.set()
            _reset(self.client)
            _reset(self.server)
            self.proxy._forget(self)

    def _pump_up(self) -> None:
        try:
            while not self.closed.is_set():
                data = self.client.recv(65536)
                if not data:
                    break
                if self.up is not None:
                    for kind, body, _ in self.up.feed(data):
                        self._inspect_up(kind, body)
                self.server.sendall(data)
        except OSError:
            pass
        self.close()

    def _inspect_up(self, kind: bytes, body: bytes) -> None:
        assert self.up is not None and self.down is not None
        if kind == b"":  # startup phase
            code = struct.unpack("!I", body[:4])[0] if len(body) >= 4 else 0
            if code in (_SSL_REQUEST, _GSS_REQUEST):
                self.down.single += 1
            elif code == _PROTO_3:
                self.up.untyped, self.syncs = False, 1  # the startup ends with one ReadyForQuery
            elif code == _CANCEL:
                self.up, self.down = None, None
            return
        if kind in (b"Q", b"S"):
            self.syncs += 1
        if kind not in (b"Q", b"P") or self.doom is not None:
            return
        query = body.split(b"\0", 2)[0 if kind == b"Q" else 1]
        if _COMMIT.match(query) and self.proxy._take_commit():
            # a simple query is answered by its own ReadyForQuery; a Parse by the next Sync's
            text = " ".join(query.decode(errors="replace").split())[:80]
            self.doom = (self.syncs if kind == b"Q" else self.syncs + 1, text)

    def _pump_down(self) -> None:
        try:
            while not self.closed.is_set():
                data = self.server.recv(65536)
                if not data:
                    break
                if self.down is None:
                    self.client.sendall(data)
                    continue
                passed = []
                for kind, body, raw in self.down.feed(data):
                    if kind == b"S" and not body and self.ready == 0 and self.up is not None and self.up.untyped:
                        self.up, self.down = None, None  # TLS accepted: opaque from here on
                        passed.append(raw)
                        break
                    if self.doom is None:
                        passed.append(raw)
                    elif kind == b"C":
                        self.tag = body.rstrip(b"\0").decode(errors="replace")
                    if kind == b"Z":
                        self.ready += 1
                    if self.doom is not None and self.ready >= self.doom[0]:
                        self.proxy._dropped(f"{self.doom[1]} (PostgreSQL answered {self.tag or 'nothing'})")
                        self.close()
                        return
                if passed:
                    self.client.sendall(b"".join(passed))
        except OSError:
            pass
        self.close()


class FaultProxy:
    """Listens on 127.0.0.1 (an ephemeral port, or ``port``) and forwards each connection to
    ``upstream``. ``protocol`` is ``postgres`` (commits recognised) or ``raw``."""

    def __init__(self, upstream: tuple[str, int], protocol: str = "raw", port: int = 0):
        if protocol not in ("raw", "postgres"):
            raise ValueError(f"unknown proxy protocol {protocol!r}")
        self.upstream, self.protocol = upstream, protocol
        self._listener = socket.create_server(("127.0.0.1", port), reuse_port=False)
        self.port: int = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._conns: set[_Conn] = set()
        self._refusing, self._refused = False, 0
        self._plan: list[int] = []  # commits to let through before each reply to drop
        self._drops: list[str] = []
        self._stop = threading.Event()
        self.connections = 0  # accepted and forwarded, over the proxy's life
        threading.Thread(target=self._accept, daemon=True, name="verify-proxy-accept").start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            with self._lock:
                refusing = self._refusing
                if refusing:
                    self._refused += 1
            if refusing:
                _reset(client)
                continue
            try:
                server = socket.create_connection(self.upstream, timeout=10)
                server.settimeout(None)
            except OSError:
                _reset(client)
                continue
            for s in (client, server):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn = _Conn(self, client, server)
            with self._lock:
                self._conns.add(conn)
                self.connections += 1
            conn.start()

    def _forget(self, conn: _Conn) -> None:
        with self._lock:
            self._conns.discard(conn)

    # ---- faults ------------------------------------------------------------------------

    def partition(self, seconds: float) -> tuple[int, int]:
        """Reset every connection, refuse new ones for ``seconds``, heal; returns (connections
        cut, connections refused)."""
        with self._lock:
            self._refusing, self._refused = True, 0
            conns = list(self._conns)
        for c in conns:
            c.close()
        time.sleep(seconds)
        with self._lock:
            self._refusing = False
            return len(conns), self._refused

    def lose_replies(self, skips: list[int], timeout: float) -> list[str]:
        """For each entry ``k`` of ``skips``: let ``k`` commits through, then drop the reply to
        the next one. Waits until all are dropped or ``timeout``; returns what was dropped."""
        with self._lock:
            self._plan, self._drops = list(skips), []
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if len(self._drops) >= len(skips):
                    break
            time.sleep(0.1)
        with self._lock:
            self._plan = []
            # a drop armed but whose answer is still on its way is reported when it lands
        time.sleep(0.5)
        with self._lock:
            return list(self._drops)

    def _take_commit(self) -> bool:
        """Called per commit seen: True when this one's reply is to be dropped."""
        with self._lock:
            if not self._plan:
                return False
            if self._plan[0] > 0:
                self._plan[0] -= 1
                return False
            self._plan.pop(0)
            return True

    def _dropped(self, what: str) -> None:
        with self._lock:
            self._drops.append(what)

    def close(self) -> None:
        self._stop.set()
        try:
            self._listener.close()
        except OSError:
            pass
        with self._lock:
            conns = list(self._conns)
        for c in conns:
            c.close()
