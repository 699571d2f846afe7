"""A TCP load balancer for tests, without session affinity, on a loopback port.

Each new client connection is piped to the next backend, round robin: a backend marked
down is passed over, and so is one that refuses the connection (or does not accept it
within ``connect_timeout``), for the one after it. With no backend left the client's
connection is reset. Bytes pass both ways unchanged, a half-close (EOF) is passed on, and
reading one side pauses while the other side's transport is full (backpressure), so a
slow reader slows its writer down instead of filling the balancer's memory.

:meth:`Balancer.cut_all` drops every piped connection at once, both sides, the way a
network failure would: no close frame, no FIN, a reset (``SO_LINGER`` 0). Shutting the
balancer down (:meth:`Balancer.close`, or leaving ``async with``) closes its listener and
every link and waits until their sockets are closed.

    async with Balancer([a.address, b.address]) as lb:
        async with connect(lb.ws_url("/v1/realtime")) as ws: ...
        lb.cut_all()

Backends are ``(host, port)`` pairs or ``"host:port"`` strings; the counts are keyed by
``(host, port)``.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import time
from collections import Counter
from collections.abc import Iterable
from types import TracebackType
from typing import cast

Address = tuple[str, int]
AddressLike = Address | str

CONNECT_TIMEOUT = 5.0  # seconds a backend has to accept a connection before the next is tried


def parse_address(address: AddressLike) -> Address:
    """``("127.0.0.1", 8000)`` from itself or from ``"127.0.0.1:8000"``."""
    if isinstance(address, str):
        host, sep, port = address.rpartition(":")
        if not sep or not host:
            raise ValueError(f"expected host:port, got {address!r}")
        return host.strip("[]"), int(port)
    return str(address[0]), int(address[1])


def _reset(transport: asyncio.BaseTransport | None) -> None:
    """Closes at once with a TCP reset: buffered bytes are dropped, the peer sees no FIN."""
    if transport is None or transport.is_closing():
        return
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError, AttributeError, ValueError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    cast(asyncio.Transport, transport).abort()


class _Side(asyncio.Protocol):
    """One end of a link: the client's connection to the balancer, or the balancer's
    connection to a backend."""

    def __init__(self, link: _Link, backend: Address | None) -> None:
        self.link = link
        self.backend = backend  # None for the client's side
        self.transport: asyncio.Transport | None = None
        self.eof = False  # the peer of this socket sent FIN
        self.lost = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        self.link.made(self)

    def data_received(self, data: bytes) -> None:
        self.link.forward(self, data)

    def eof_received(self) -> bool:
        self.eof = True
        self.link.half_closed(self)
        return True  # the other direction goes on until the link closes both

    def pause_writing(self) -> None:
        self.link.flow(self, pause=True)

    def resume_writing(self) -> None:
        self.link.flow(self, pause=False)

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self.link.side_lost(self, exc)


class _Link:
    """A client connection and the backend connection it is piped to."""

    def __init__(self, balancer: Balancer) -> None:
        self.balancer = balancer
        self.client = _Side(self, None)
        self.upstream: _Side | None = None  # the backend side, once connected
        self.pending: list[bytes] = []  # client bytes before the backend is connected
        self.connecting: asyncio.Task[None] | None = None
        self.done = asyncio.get_running_loop().create_future()
        self.finished = False

    @property
    def backend(self) -> Address | None:
        return self.upstream.backend if self.upstream is not None else None

    def sides(self) -> list[_Side]:
        return [self.client] if self.upstream is None else [self.client, self.upstream]

    def peer(self, side: _Side) -> _Side | None:
        return self.upstream if side is self.client else self.client

    # -- callbacks of the sides -------------------------------------------------------

    def made(self, side: _Side) -> None:
        if side is self.client:
            assert side.transport is not None
            if self.balancer.closing:
                side.transport.abort()
                return
            self.balancer.adopt(self)
            side.transport.pause_reading()  # until a backend takes the connection
            self.balancer.tune(side.transport)
            self.connecting = asyncio.get_running_loop().create_task(self.balancer.route(self))
            return
        # A backend accepted: the link is complete.
        assert side.transport is not None
        if self.finished or self.client.lost:
            side.transport.abort()
            return
        self.upstream = side
        self.balancer.tune(side.transport)
        self.balancer.connected(side.backend)
        for data in self.pending:
            side.transport.write(data)
        self.pending.clear()
        if self.client.eof:
            self.half_closed(self.client)
        client = self.client.transport
        if client is not None and not self.client.eof and not client.is_closing():
            client.resume_reading()

    def forward(self, side: _Side, data: bytes) -> None:
        if side is not self.client and side is not self.upstream:
            return  # a backend connection the link gave up on
        peer = self.peer(side)
        if peer is None or peer.transport is None:
            self.pending.append(data)
        elif not peer.transport.is_closing():
            peer.transport.write(data)

    def half_closed(self, side: _Side) -> None:
        """``side``'s socket sent FIN: pass it on; with both directions ended, close."""
        peer = self.peer(side)
        if peer is None or peer.transport is None:
            return  # passed on once the backend is connected (made)
        if not peer.transport.is_closing() and peer.transport.can_write_eof():
            peer.transport.write_eof()
        if side.eof and peer.eof:
            for s in (side, peer):
                if s.transport is not None:
                    s.transport.close()  # what is still buffered goes out first

    def flow(self, side: _Side, *, pause: bool) -> None:
        """``side``'s transport went over (or back under) its high-water mark: reading
        from its peer pauses (or resumes)."""
        peer = self.peer(side)
        if peer is None or peer.transport is None or peer.eof or peer.transport.is_closing():
            return
        if pause:
            self.balancer.pauses += 1
            peer.transport.pause_reading()
        else:
            peer.transport.resume_reading()

    def side_lost(self, side: _Side, exc: Exception | None) -> None:
        if side is not self.client and side is not self.upstream:
            return
        peer = self.peer(side)
        if peer is not None and peer.transport is not None and not peer.lost:
            if exc is None:
                peer.transport.close()  # flushes what it holds, then FIN
            else:
                _reset(peer.transport)  # a reset is passed on as a reset
        if self.connecting is not None and side is self.client:
            self.connecting.cancel()
        self.check_finished()

    def check_finished(self) -> None:
        if self.finished:
            return
        if not self.client.lost or (self.upstream is not None and not self.upstream.lost):
            return
        if self.connecting is not None and not self.connecting.done():
            return  # route() finishes it when the attempt ends
        self.finished = True
        self.balancer.forget(self)
        if not self.done.done():
            self.done.set_result(None)

    # -- the balancer's orders --------------------------------------------------------

    def cut(self) -> None:
        """Both sides reset at once."""
        if self.connecting is not None:
            self.connecting.cancel()
        for side in self.sides():
            _reset(side.transport)

    def abort(self) -> None:
        if self.connecting is not None:
            self.connecting.cancel()
        for side in self.sides():
            if side.transport is not None and not side.transport.is_closing():
                side.transport.abort()


class Balancer:
    """A round-robin TCP balancer on ``127.0.0.1`` (a free port unless ``port`` is given).

    ``write_limit`` sets the high-water mark of every transport (asyncio's default where
    None): the bytes it holds for a side that does not read before it stops reading the
    other side.
    """

    def __init__(
        self,
        backends: Iterable[AddressLike] = (),
        *,
        port: int = 0,
        connect_timeout: float = CONNECT_TIMEOUT,
        write_limit: int | None = None,
    ) -> None:
        self._backends: list[Address] = [parse_address(b) for b in backends]
        self._down: set[Address] = set()
        self._next = 0
        self._port = port
        self._connect_timeout = connect_timeout
        self._write_limit = write_limit
        self._server: asyncio.Server | None = None
        self._links: set[_Link] = set()
        self.closing = False
        self.connections: Counter[Address] = Counter()  # links piped to each backend, ever
        self.refused: Counter[Address] = Counter()  # connection attempts each one refused
        self.clients = 0  # client connections accepted
        self.unrouted = 0  # client connections no backend took (reset)
        self.pauses = 0  # times reading one side paused for the other's full transport

    # -- where it is ------------------------------------------------------------------

    @property
    def port(self) -> int:
        """The listening port (kept after :meth:`close`: a later :meth:`start` reuses it)."""
        if self._port == 0:
            raise RuntimeError("the balancer is not started")
        return self._port

    @property
    def address(self) -> str:
        """``127.0.0.1:PORT``."""
        return f"127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        """``http://127.0.0.1:PORT``."""
        return f"http://127.0.0.1:{self.port}"

    def ws_url(self, path: str = "/v1/realtime") -> str:
        """``ws://127.0.0.1:PORT/path``."""
        return f"ws://127.0.0.1:{self.port}/{path.lstrip('/')}"

    # -- backends ---------------------------------------------------------------------

    @property
    def backends(self) -> list[Address]:
        return list(self._backends)

    def set_backends(self, backends: Iterable[AddressLike]) -> None:
        """The backends new connections go to from now on (live links stay where they
        are; marks and counts are kept, by address)."""
        self._backends = [parse_address(b) for b in backends]

    def mark_down(self, address: AddressLike, *, cut: bool = False) -> None:
        """New connections pass ``address`` over; with ``cut=True`` its live links are
        dropped too (reset, like :meth:`cut_all`)."""
        backend = parse_address(address)
        self._down.add(backend)
        if cut:
            for link in list(self._links):
                if link.backend == backend:
                    link.cut()

    def mark_up(self, address: AddressLike) -> None:
        self._down.discard(parse_address(address))

    def is_down(self, address: AddressLike) -> bool:
        return parse_address(address) in self._down

    # -- links ------------------------------------------------------------------------

    @property
    def links(self) -> int:
        """Live client connections (piped, or still looking for a backend)."""
        return len(self._links)

    def active(self) -> Counter[Address]:
        """Live links per backend."""
        return Counter(link.backend for link in self._links if link.backend is not None)

    def cut_all(self) -> int:
        """Drops every live link, both sides, with a reset: no FIN, no close frame, what
        was in flight is lost. Returns how many links it cut; their sockets are closed by
        the next turn of the loop (:meth:`wait_links` waits for that)."""
        links = list(self._links)
        for link in links:
            link.cut()
        return len(links)

    async def wait_links(self, count: int = 0, timeout: float = 10.0) -> None:
        """Waits until exactly ``count`` links are live (and routed)."""
        deadline = time.monotonic() + timeout
        while not (self.links == count and all(lnk.upstream is not None for lnk in self._links)):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.links} live links after {timeout:g} s, not {count}")
            await asyncio.sleep(0.005)

    # -- life -------------------------------------------------------------------------

    async def start(self) -> Balancer:
        if self._server is not None:
            raise RuntimeError("the balancer is already started")
        loop = asyncio.get_running_loop()
        self.closing = False
        self._server = await loop.create_server(
            lambda: _Link(self).client, "127.0.0.1", self._port, reuse_address=True
        )
        self._port = self._server.sockets[0].getsockname()[1]
        return self

    async def close(self, timeout: float = 10.0) -> None:
        """Closes the listener and every link, and waits until all their sockets are."""
        self.closing = True
        server, self._server = self._server, None
        if server is not None:
            server.close()
        links = list(self._links)
        for link in links:
            link.abort()
        tasks = [link.connecting for link in links if link.connecting is not None]
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        if links:
            await asyncio.wait_for(asyncio.gather(*(link.done for link in links)), timeout)
        if server is not None:
            await server.wait_closed()

    async def __aenter__(self) -> Balancer:
        return await self.start()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    def __repr__(self) -> str:
        where = self.address if self._server is not None else "not started"
        return f"<Balancer {where} backends={self._backends} links={self.links}>"

    # -- for _Link --------------------------------------------------------------------

    def adopt(self, link: _Link) -> None:
        self._links.add(link)
        self.clients += 1

    def forget(self, link: _Link) -> None:
        self._links.discard(link)

    def connected(self, backend: Address | None) -> None:
        if backend is not None:
            self.connections[backend] += 1

    def tune(self, transport: asyncio.Transport) -> None:
        if self._write_limit is not None:
            transport.set_write_buffer_limits(high=self._write_limit)

    async def route(self, link: _Link) -> None:
        """Connects ``link`` to the next backend that takes it; resets the client where
        none does."""
        loop = asyncio.get_running_loop()
        try:
            candidates = list(self._backends)
            for _ in range(len(candidates)):
                backend = candidates[self._next % len(candidates)]
                self._next += 1
                if backend in self._down:
                    continue

                def side(backend: Address = backend) -> _Side:
                    return _Side(link, backend)

                try:
                    await asyncio.wait_for(
                        loop.create_connection(side, *backend),
                        self._connect_timeout,
                    )
                except (OSError, TimeoutError):
                    self.refused[backend] += 1
                    continue
                if link.upstream is not None or link.client.lost:
                    return
            self.unrouted += 1
            _reset(link.client.transport)
        finally:
            link.connecting = None
            link.check_finished()
