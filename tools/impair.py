"""A TCP impairment proxy: the links IoT devices really have, without ``netem``.

Each :class:`Link` listens on one address and forwards every connection to one target,
delaying, throttling, stalling and resetting the byte streams in both directions::

    impairment = Impairment(latency_s=0.2, jitter_s=0.1, bandwidth_bps=4000,
                            stall_every_s=20.0, stall_s=1.5, reset_every_s=30.0)
    with ProxyThread() as proxies:                      # an asyncio loop in a thread
        link = proxies.add(Link(name="dev-0003", listen=("127.0.0.1", 0),
                                target=("127.0.0.1", broker_port),
                                impairment=impairment, seed=7))
        ...  # point the device at link.address; read link.stats afterwards

or from a shell (``python -m tools.impair --help``)::

    python -m tools.impair --listen 127.0.0.1:18883 --target 127.0.0.1:8883 \
        --latency 0.2 --jitter 0.1 --bandwidth 4000 --reset-every 30 --seed 7

What one link does, per direction of each connection (a TCP stream stays in order, so a
delay can hold bytes back but never reorder them):

- latency: every chunk read is delivered ``latency_s +- jitter_s`` (uniform) after it
  arrived, and never before the chunk ahead of it;
- bandwidth: a chunk of n bytes occupies the direction for ``n / bandwidth_bps`` seconds
  (serialisation delay; chunks wait for the link to be free);
- stalls: at exponentially distributed intervals (mean ``stall_every_s``) the connection
  stops delivering in both directions for ``stall_s`` seconds (a radio fade);
- resets: after an exponentially distributed time (mean ``reset_every_s``) the connection
  is aborted with a TCP RST on both sides (a NAT or cellular link dropping it).

Every random draw comes from ``random.Random`` seeded by ``(seed, link name, connection
index)``: the same seed gives the same delays, stall and reset times to the same
connection of the same link, so a failing run can be replayed. These are test tools: the
randomness is a simulation seed and has nothing to do with privacy.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import random
import socket
import struct
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = ["Impairment", "Link", "LinkStats", "ProxyThread", "main"]

_READ_BYTES = 4096
# A capped link reads in slices of at most a tenth of a second's worth of bytes, so one
# large read does not arrive as a single burst after a long wait.
_SLICE_S = 0.1


@dataclass(frozen=True, slots=True, kw_only=True)
class Impairment:
    """What a link does to its connections (all times in seconds, rates in bytes/second).

    Attributes:
        latency_s: mean one-way delay added to every chunk, per direction (>= 0).
        jitter_s: the delay is uniform in ``latency_s +- jitter_s`` (0 <= jitter <= latency).
        bandwidth_bps: per-direction cap in bytes per second (None: uncapped).
        stall_every_s: mean time between stalls of a connection (None: no stalls).
        stall_s: how long each stall holds both directions (>= 0).
        reset_every_s: mean lifetime of a connection before a reset (None: no resets).
    """

    latency_s: float = 0.0
    jitter_s: float = 0.0
    bandwidth_bps: float | None = None
    stall_every_s: float | None = None
    stall_s: float = 0.0
    reset_every_s: float | None = None

    def __post_init__(self) -> None:
        for name in ("latency_s", "jitter_s", "stall_s"):
            v = getattr(self, name)
            if not (isinstance(v, int | float) and math.isfinite(v) and v >= 0):
                raise ValueError(f"{name} must be a finite number >= 0 seconds, got {v!r}")
        if self.jitter_s > self.latency_s:
            raise ValueError(f"jitter_s must be <= latency_s (a delay is never negative), "
                             f"got jitter {self.jitter_s!r} > latency {self.latency_s!r}")
        for name in ("bandwidth_bps", "stall_every_s", "reset_every_s"):
            v = getattr(self, name)
            if v is not None and not (isinstance(v, int | float) and math.isfinite(v)
                                      and v > 0):
                raise ValueError(f"{name} must be None or a finite number > 0, got {v!r}")


def chunk_delay(imp: Impairment, rng: random.Random) -> float:
    """One chunk's propagation delay in seconds: uniform in latency +- jitter."""
    if imp.jitter_s == 0:
        return imp.latency_s
    return rng.uniform(imp.latency_s - imp.jitter_s, imp.latency_s + imp.jitter_s)


def next_after(mean_s: float | None, rng: random.Random) -> float:
    """Seconds to the next event of a Poisson process with mean gap ``mean_s`` (inf: none)."""
    return math.inf if mean_s is None else rng.expovariate(1.0 / mean_s)


@dataclass(slots=True)
class LinkStats:
    """What a link did so far (all connections). Bytes count what was delivered."""

    connections: int = 0
    resets: int = 0
    stalls: int = 0
    stalled_s: float = 0.0
    bytes_up: int = 0  # client -> target
    bytes_down: int = 0  # target -> client
    chunks: int = 0
    delay_sum_s: float = 0.0  # propagation delays drawn (jitter included)
    delay_max_s: float = 0.0
    refused: int = 0  # connections whose target could not be reached
    # the first delays drawn for client -> target chunks (all connections), for replay checks
    delays_up: list[float] = field(default_factory=list)

    def as_dict(self) -> dict[str, float | int]:
        """Plain numbers (for JSON reports); ``mean_delay_s`` over every chunk."""
        return {"connections": self.connections, "resets": self.resets,
                "stalls": self.stalls, "stalled_s": round(self.stalled_s, 3),
                "bytes_up": self.bytes_up, "bytes_down": self.bytes_down,
                "chunks": self.chunks, "refused": self.refused,
                "mean_delay_s": round(self.delay_sum_s / self.chunks, 4) if self.chunks else 0.0,
                "max_delay_s": round(self.delay_max_s, 4)}


_KEPT_DELAYS = 64


class _Conn:
    """One proxied connection: two pumps, a stall clock and a reset timer."""

    def __init__(self, link: Link, index: int, client: tuple[asyncio.StreamReader,
                 asyncio.StreamWriter]) -> None:
        self.link = link
        # one generator per purpose: the i-th chunk up gets the i-th draw however the two
        # directions, the stalls and the reset interleave in time
        key = f"{link.seed}/{link.name}/{index}"
        self.rng = {p: random.Random(f"{key}/{p}") for p in ("up", "down", "stall", "reset")}
        self.client = client
        self.stalled_until = 0.0
        self.broken = False
        self.tasks: list[asyncio.Task[bool]] = []
        self.writers: tuple[asyncio.StreamWriter, ...] = ()

    async def run(self) -> None:
        link, imp = self.link, self.link.impairment
        c_reader, c_writer = self.client
        try:
            t_reader, t_writer = await asyncio.open_connection(*link.target)
        except OSError:
            link.stats.refused += 1
            _abort(c_writer)
            return
        except BaseException:  # cancelled (an outage, or closing) while connecting
            _abort(c_writer)
            raise
        loop = asyncio.get_running_loop()
        self.tasks = [loop.create_task(self._pump(c_reader, t_writer, up=True)),
                      loop.create_task(self._pump(t_reader, c_writer, up=False))]
        if imp.stall_every_s is not None:
            self.tasks.append(loop.create_task(self._stalls()))
        reset_at = loop.time() + next_after(imp.reset_every_s, self.rng["reset"])
        self.writers = (c_writer, t_writer)
        pending = set(self.tasks[:2])
        try:
            while pending and not self.broken:
                left = reset_at - loop.time()
                if left <= 0:
                    link.stats.resets += 1
                    break
                done, pending = await asyncio.wait(
                    pending, timeout=None if math.isinf(left) else left,
                    return_when=asyncio.FIRST_COMPLETED)
                if any(not t.result() for t in done):  # an error on one side ends both
                    break
        finally:
            for t in self.tasks:
                t.cancel()
            await asyncio.gather(*self.tasks, return_exceptions=True)
            _abort(c_writer)
            _abort(t_writer)

    async def _stalls(self) -> None:
        imp = self.link.impairment
        while True:
            await asyncio.sleep(next_after(imp.stall_every_s, self.rng["stall"]))
            now = time.monotonic()
            self.stalled_until = max(self.stalled_until, now + imp.stall_s)
            self.link.stats.stalls += 1
            self.link.stats.stalled_s += imp.stall_s

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *,
                    up: bool) -> bool:
        """Read, stamp each chunk with its delivery time, deliver in order. True: the
        reader's side closed cleanly and everything read was delivered."""
        imp, stats = self.link.impairment, self.link.stats
        size = _READ_BYTES if imp.bandwidth_bps is None else max(
            1, min(_READ_BYTES, int(imp.bandwidth_bps * _SLICE_S)))
        rng = self.rng["up" if up else "down"]
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()
        link_free = 0.0  # when this direction finishes sending what it holds
        last_due = 0.0

        async def deliver() -> None:
            while True:
                due, data = await queue.get()
                if not data:
                    return
                while True:  # a stall that begins while waiting holds the chunk too
                    now = time.monotonic()
                    wait = max(due, self.stalled_until) - now
                    if wait <= 0:
                        break
                    await asyncio.sleep(wait)
                if up:  # counted before the write, so a reader of the stats who got the
                    stats.bytes_up += len(data)  # bytes always sees them counted
                else:
                    stats.bytes_down += len(data)
                try:
                    writer.write(data)
                    await writer.drain()
                except OSError:  # the receiving side is gone: so is the connection
                    self.broken = True
                    for w in self.writers:
                        _abort(w)
                    return

        sender = asyncio.get_running_loop().create_task(deliver())
        try:
            while True:
                data = await reader.read(size)
                now = time.monotonic()
                if not data:
                    queue.put_nowait((now, b""))
                    break
                delay = chunk_delay(imp, rng)
                stats.chunks += 1
                stats.delay_sum_s += delay
                stats.delay_max_s = max(stats.delay_max_s, delay)
                if up and len(stats.delays_up) < _KEPT_DELAYS:
                    stats.delays_up.append(delay)
                if imp.bandwidth_bps is not None:
                    link_free = max(link_free, now) + len(data) / imp.bandwidth_bps
                    ready = link_free
                else:
                    ready = now
                last_due = max(last_due, ready + delay)
                queue.put_nowait((last_due, data))
            await sender  # deliver what was read before EOF, then half-close
            if self.broken:
                return False
            with contextlib.suppress(OSError):
                if writer.can_write_eof():
                    writer.write_eof()
            return True
        except OSError:
            return False
        finally:
            sender.cancel()
            await asyncio.gather(sender, return_exceptions=True)


def _abort(writer: asyncio.StreamWriter) -> None:
    """Close with a TCP RST (SO_LINGER 0), as a dropped NAT mapping or radio link does."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


class Link:
    """One listening address forwarding to one target through an :class:`Impairment`.

    Args:
        name: names the link in reports and in the seed of its random draws.
        listen: (host, port) to listen on; port 0 picks a free one (see :attr:`address`).
        target: (host, port) every connection is forwarded to.
        impairment: what to do to the connections.
        seed: the simulation seed (connection i of the link draws from generators seeded
            with ``f"{seed}/{name}/{i}/<purpose>"``, purpose one of up, down, stall, reset).
    """

    def __init__(self, *, name: str, listen: tuple[str, int], target: tuple[str, int],
                 impairment: Impairment, seed: int) -> None:
        if not isinstance(impairment, Impairment):
            raise ValueError(f"impairment must be an Impairment, got {impairment!r}")
        self.name = name
        self.listen = listen
        self.target = target
        self.impairment = impairment
        self.seed = seed
        self.stats = LinkStats()
        self._listener: socket.socket | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._retry: asyncio.TimerHandle | None = None
        self._conns: set[asyncio.Task[None]] = set()
        self._next = 0
        self.address: tuple[str, int] = listen

    async def start(self) -> None:
        # An accept loop of our own rather than asyncio.start_server: with Python 3.11's
        # server, a connection accepted just before Server.close() is handed to a task
        # that then fails (Server._attach asserts the server is open) and leaves the
        # accepted socket for the garbage collector, whose ResourceWarning then fails
        # whatever test is running when it is collected. Here every accepted socket is
        # owned by a tracked task from the accept on.
        self._listener = socket.create_server(self.listen, reuse_port=False)
        self._listener.setblocking(False)
        host, port = self._listener.getsockname()[:2]
        self.address = (host, port)
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self._listener.fileno(), self._on_readable)

    def _on_readable(self) -> None:
        # Accepted synchronously, in the reader callback, so no socket ever sits in a
        # future that a cancellation could drop.
        assert self._listener is not None and self._loop is not None
        while True:
            try:
                conn, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:  # e.g. out of file descriptors: back off, keep the others
                self._loop.remove_reader(self._listener.fileno())
                self._retry = self._loop.call_later(0.1, self._resume)
                return
            conn.setblocking(False)
            self._accepted(conn)

    def _resume(self) -> None:
        if self._loop is not None and self._listener is not None and self._listener.fileno() >= 0:
            self._loop.add_reader(self._listener.fileno(), self._on_readable)

    def _accepted(self, conn: socket.socket) -> None:
        index = self._next
        self._next += 1
        self.stats.connections += 1
        task = asyncio.get_running_loop().create_task(self._serve(index, conn))
        self._conns.add(task)

        def done(t: asyncio.Task[None]) -> None:
            self._conns.discard(t)
            # Every path through _serve has aborted the transport by now; this closes the
            # socket of a task cancelled before it made one (a no-op otherwise).
            conn.close()

        task.add_done_callback(done)

    async def _serve(self, index: int, conn: socket.socket) -> None:
        reader, writer = await asyncio.open_connection(sock=conn)
        await _Conn(self, index, (reader, writer)).run()

    async def reset_all(self) -> int:
        """Reset every open connection now (a link outage); returns how many."""
        tasks = list(self._conns)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)  # each aborts its sockets
        await asyncio.sleep(0)  # the aborts close their sockets on the next iteration
        self.stats.resets += len(tasks)
        return len(tasks)

    async def close(self) -> None:
        if self._retry is not None:
            self._retry.cancel()
        if self._listener is not None and self._listener.fileno() >= 0:
            asyncio.get_running_loop().remove_reader(self._listener.fileno())
            self._listener.close()
        await self.reset_all()


class ProxyThread:
    """An asyncio loop in a daemon thread hosting links, for synchronous callers (tests)."""

    def __init__(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="impair",
                                        daemon=True)
        self._thread.start()
        self.links: list[Link] = []

    def _call(self, coro: object, timeout: float = 30.0) -> object:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)  # type: ignore[arg-type]

    def add(self, link: Link) -> Link:
        """Start ``link`` (its :attr:`Link.address` is then the bound address)."""
        self._call(link.start())
        self.links.append(link)
        return link

    def reset(self, link: Link) -> int:
        return int(self._call(link.reset_all()))  # type: ignore[call-overload]

    def close(self) -> None:
        """Close every link, then every task and transport left on the loop, then the loop.

        Every socket is closed before this returns: one left to the garbage collector
        would surface as a ResourceWarning in whatever test runs when it is collected."""
        if not self._loop.is_running():
            return
        with contextlib.suppress(Exception):
            self._call(self._shutdown(), timeout=20.0)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10.0)
        if not self._thread.is_alive():
            self._loop.close()

    async def _shutdown(self) -> None:
        for link in self.links:
            with contextlib.suppress(Exception):
                await link.close()
        me = asyncio.current_task()
        rest = [t for t in asyncio.all_tasks() if t is not me]
        for t in rest:
            t.cancel()
        await asyncio.gather(*rest, return_exceptions=True)
        # transport.abort() closes its socket in a callback scheduled for the next loop
        # iteration; let those callbacks run before the loop stops
        for _ in range(3):
            await asyncio.sleep(0)

    def __enter__(self) -> ProxyThread:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _addr(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit():
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
    return host, int(port)


def main(argv: Sequence[str] | None = None) -> int:
    """Run one link until interrupted, printing its stats as JSON every ``--report`` s."""
    import json

    p = argparse.ArgumentParser(prog="python -m tools.impair", description=__doc__.splitlines()[0])
    p.add_argument("--listen", type=_addr, required=True, help="HOST:PORT to listen on")
    p.add_argument("--target", type=_addr, required=True, help="HOST:PORT to forward to")
    p.add_argument("--latency", type=float, default=0.0, help="mean one-way delay, s")
    p.add_argument("--jitter", type=float, default=0.0, help="delay is latency +- jitter, s")
    p.add_argument("--bandwidth", type=float, help="bytes per second per direction")
    p.add_argument("--stall-every", type=float, help="mean seconds between stalls")
    p.add_argument("--stall", type=float, default=0.0, help="stall length, s")
    p.add_argument("--reset-every", type=float, help="mean connection lifetime before a RST, s")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--report", type=float, default=10.0, help="seconds between stats lines")
    a = p.parse_args(argv)
    try:
        imp = Impairment(latency_s=a.latency, jitter_s=a.jitter, bandwidth_bps=a.bandwidth,
                         stall_every_s=a.stall_every, stall_s=a.stall,
                         reset_every_s=a.reset_every)
    except ValueError as e:
        p.error(str(e))

    async def run() -> None:
        link = Link(name="cli", listen=a.listen, target=a.target, impairment=imp, seed=a.seed)
        await link.start()
        print(json.dumps({"event": "listening", "address": list(link.address)}), flush=True)
        try:
            while True:
                await asyncio.sleep(a.report)
                print(json.dumps({"event": "stats", **link.stats.as_dict()}), flush=True)
        finally:
            await link.close()

    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(run())
    return 0


if __name__ == "__main__":
    sys.exit(main())
