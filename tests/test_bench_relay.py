"""The envelope benchmark's byte-counting relay (tools/bench/envelope.py) closes every socket
it opens: one left to the garbage collector raised a ResourceWarning in an unrelated test
of a CI run (``filterwarnings = error``), from the relay's accept thread."""

from __future__ import annotations

import gc
import socket
import threading
import warnings

from tools.bench.envelope import _Relay


def _echo_server() -> tuple[socket.socket, threading.Thread]:
    srv = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        conn, _ = srv.accept()
        with conn:
            while data := conn.recv(65536):
                conn.sendall(data)

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    return srv, t


def _leaks(run: object) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run()  # type: ignore[operator]
        gc.collect()
    return [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)]


def test_relay_counts_and_closes_every_socket() -> None:
    srv, server = _echo_server()

    def run() -> None:
        relay = _Relay("127.0.0.1", srv.getsockname()[1])
        with socket.create_connection(("127.0.0.1", relay.port), timeout=10) as c:
            c.sendall(b"x" * 1000)
            got = b""
            while len(got) < 1000:
                got += c.recv(1000 - len(got))
        relay.close()
        assert (relay.sent, relay.received, relay.connections) == (1000, 1000, 1)
        assert not relay._acceptor.is_alive()  # noqa: SLF001 - woken by the shutdown
        assert not any(t.is_alive() for t in relay._threads)  # noqa: SLF001

    try:
        assert _leaks(run) == []
    finally:
        srv.close()
        server.join(5)


def test_relay_to_a_dead_broker_closes_the_accepted_socket() -> None:
    dead = socket.create_server(("127.0.0.1", 0))
    port = dead.getsockname()[1]
    dead.close()

    def run() -> None:
        relay = _Relay("127.0.0.1", port)
        with socket.create_connection(("127.0.0.1", relay.port), timeout=10) as c:
            assert c.recv(1) == b""  # the relay hung up: nothing upstream
        relay.close()
        assert not relay._acceptor.is_alive()  # noqa: SLF001

    assert _leaks(run) == []
