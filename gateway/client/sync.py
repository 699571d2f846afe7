"""The blocking client: the asyncio client driven from a private event-loop thread.

``asyncio.run()`` fails where a loop already runs (a Jupyter cell), and blocking that loop
would freeze it. So each :class:`SyncChat` owns a daemon thread running its own loop; every
call hands a coroutine to that loop and blocks the caller until it is done. This works the
same in a plain script, in a thread, or inside a running loop.

Ctrl-C arrives as ``KeyboardInterrupt`` in the waiting (main) thread, never in the loop
thread: the waiting call then cancels its coroutine and, during a stream, cancels the answer
on the gateway before re-raising. While a call waits, a SIGINT does not raise inside the
wait: Python's handler would raise wherever the main thread is, and inside the lock of the
future it waits on (between the lock's acquisition and the ``with`` block that releases it)
it leaves that lock held for good; the loop thread then blocks on it and every later call
waits forever (Ctrl-C froze ``python -m gateway.client`` that way). The wait's own handler
cancels the future instead, and the call raises ``KeyboardInterrupt`` once it has returned.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import signal
import threading
import weakref
from collections.abc import Coroutine, Iterator
from types import TracebackType
from typing import Any, TypeVar, Unpack

from gateway.client.aio import DEFAULT_TIMEOUT, AsyncChat, AsyncStream
from gateway.client.errors import ClientError
from gateway.client.events import JSON, ResponseOptions, SessionOptions
from gateway.client.reply import Reply
from gateway.client.resume import RESUME_TIMEOUT

T = TypeVar("T")


class _LoopThread:
    """An event loop on its own daemon thread, and a blocking way to run coroutines on it.

    The thread itself finishes the loop's leftover tasks and closes the loop once the loop is
    stopped, so :meth:`stop` works from any thread, the loop's own included (where a garbage
    collection may run a chat's finalizer).
    """

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._stopping = False
        self._thread = threading.Thread(target=self._serve, name="gateway-client", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_forever()
            self.loop.run_until_complete(self._drain())
        finally:
            self.loop.close()

    async def _drain(self) -> None:
        current = asyncio.current_task()
        leftovers = [t for t in asyncio.all_tasks() if t is not current]
        for task in leftovers:
            task.cancel()
        await asyncio.gather(*leftovers, return_exceptions=True)
        await self.loop.shutdown_asyncgens()

    @property
    def thread(self) -> threading.Thread:
        return self._thread

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the private loop and wait for it; interrupting the wait cancels it."""
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError("a sync chat cannot be used from its own loop thread")
        if self._stopping or self.loop.is_closed():
            coro.close()
            raise ClientError("this chat is closed")
        with _interrupt_cancels() as interrupt:
            future = asyncio.run_coroutine_threadsafe(coro, self.loop)
            interrupt.future = future
            if interrupt.pressed:  # before the handler knew the future
                future.cancel()
            try:
                result = _wait(future)
            except BaseException:
                # KeyboardInterrupt (or any exit) while waiting: the coroutine must not go
                # on alone. cancel() is a no-op if it already finished.
                future.cancel()
                if interrupt.pressed:
                    raise KeyboardInterrupt from None
                raise
        if interrupt.pressed:  # as it finished: the caller still hears of it
            raise KeyboardInterrupt
        return result

    def stop(self, last: Coroutine[Any, Any, Any] | None = None) -> None:
        """Run ``last`` (if given), stop the loop, and join the thread unless called on it.

        The loop's thread then cancels the leftover tasks and closes the loop.
        """
        if self._stopping:
            if last is not None:
                last.close()
            return
        self._stopping = True

        async def finish() -> None:
            try:
                if last is not None:
                    await last
            finally:
                self.loop.stop()

        try:
            asyncio.run_coroutine_threadsafe(finish(), self.loop)
        except RuntimeError:  # the loop is closed already
            return
        if threading.current_thread() is not self._thread:
            self._thread.join()


class SyncStream:
    """One answer as it is generated: ``for delta in stream`` yields the new text.

    Leaving the loop early (``break``, an exception, Ctrl-C while waiting or while printing)
    cancels the answer on the gateway; the exception then propagates.
    """

    def __init__(self, chat: SyncChat, stream: AsyncStream) -> None:
        self._chat = chat  # keeps the chat, and so its loop, alive while the stream is used
        self._runner = chat._runner
        self._stream = stream

    def __iter__(self) -> Iterator[str]:
        # A generator, so that CPython closes it as soon as the caller's loop is left, even by
        # an exception raised in the loop body: the ``finally`` then stops the answer at once.
        try:
            while True:
                try:
                    delta = self._runner.run(_next(self._stream))
                except StopAsyncIteration:
                    return
                yield delta
        finally:
            if not self._stream.finished:
                with contextlib.suppress(ClientError, RuntimeError):
                    self.cancel()

    def cancel(self) -> Reply | None:
        """Stop this answer on the gateway and wait for its end; returns the final reply."""
        return self._runner.run(self._stream.cancel())

    @property
    def reply(self) -> Reply | None:
        """The final reply once the answer ended, else ``None``."""
        return self._stream.reply

    @property
    def finished(self) -> bool:
        return self._stream.finished


async def _next(stream: AsyncStream) -> str:
    return await stream.__anext__()


class _Interrupt:
    """What a SIGINT during a wait did: cancel the future waited on, and say so."""

    __slots__ = ("future", "pressed")

    def __init__(self) -> None:
        self.future: concurrent.futures.Future[Any] | None = None
        self.pressed = False

    def __call__(self, signum: int, frame: object) -> None:
        self.pressed = True
        if self.future is not None:
            self.future.cancel()  # its lock is an RLock: taking it here, on its holder, is safe


def _wait(future: concurrent.futures.Future[T]) -> T:
    """``future.result()``, looking again every so often: the SIGINT handler may cancel the
    future between result()'s look at its state and its wait, whose wake-up is then missed."""
    while True:
        with contextlib.suppress(TimeoutError):
            return future.result(timeout=_RECHECK_S)


_RECHECK_S = 0.1


@contextlib.contextmanager
def _interrupt_cancels() -> Iterator[_Interrupt]:
    """Within: a SIGINT cancels the wait instead of raising inside it (the module's
    docstring says why). Only on the main thread, and only over Python's own handler: a
    program (or a notebook's kernel) that handles SIGINT itself keeps its handler."""
    interrupt = _Interrupt()
    if (
        threading.current_thread() is not threading.main_thread()
        or signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    ):
        yield interrupt
        return
    signal.signal(signal.SIGINT, interrupt)
    try:
        yield interrupt
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)


class SyncChat:
    """One conversation, blocking calls. See :class:`gateway.client.aio.AsyncChat`.

    Close it (``with`` or :meth:`close`). One that is garbage-collected unclosed (a notebook
    cell run again) hangs up and stops its thread then, instead of leaving both behind.
    """

    def __init__(self, runner: _LoopThread, chat: AsyncChat) -> None:
        self._runner = runner
        self._chat = chat
        # The finalizer must not hold ``self``: it gets only the runner and the connection.
        self._finalizer = weakref.finalize(self, _close_unreferenced, runner, chat)

    @property
    def session(self) -> JSON:
        return self._chat.session

    @property
    def closed(self) -> bool:
        """True once the chat cannot be used any more (see :attr:`AsyncChat.closed`)."""
        return self._chat.closed

    @property
    def session_id(self) -> str | None:
        """The gateway's id of this conversation (it stays the same across resumes)."""
        return self._chat.session_id

    def ask(self, text: str, **options: Unpack[ResponseOptions]) -> Reply:
        """Send ``text`` and return the whole answer; Ctrl-C cancels it on the gateway."""
        try:
            return self._runner.run(self._chat.ask(text, **options))
        except KeyboardInterrupt:
            self._runner.run(self._chat.cancel())
            raise

    def stream(self, text: str, **options: Unpack[ResponseOptions]) -> SyncStream:
        """``for delta in chat.stream(text): print(delta, end="", flush=True)``."""
        return SyncStream(self, self._chat.stream(text, **options))

    def update(self, **options: Unpack[SessionOptions]) -> JSON:
        """Change session settings (instructions, sampling...); returns the updated session."""
        return self._runner.run(self._chat.update(**options))

    def cancel(self) -> Reply | None:
        """Stop the answer in progress, if any."""
        return self._runner.run(self._chat.cancel())

    def close(self) -> None:
        """Close the connection and stop the private loop thread."""
        self._finalizer.detach()
        try:
            with contextlib.suppress(ClientError):  # closed already
                self._runner.run(self._chat.close())
        finally:
            self._runner.stop()

    def __enter__(self) -> SyncChat:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


HANG_UP_S = 2.0
"""How long a garbage-collected chat waits for the gateway to confirm the close."""


def _close_unreferenced(runner: _LoopThread, chat: AsyncChat) -> None:
    """The finalizer of an unclosed :class:`SyncChat`: hang up, then stop its loop thread.

    It may run on any thread, the loop's own included, and at interpreter exit.
    """

    async def hang_up() -> None:
        try:
            async with asyncio.timeout(HANG_UP_S):
                await chat.close()
        except TimeoutError:
            chat._ws.transport.abort()  # the gateway treats it as a dropped connection

    runner.stop(hang_up())


def connect_sync(
    url: str | None = None,
    *,
    api_key: str | None = None,
    timeout: float | None = DEFAULT_TIMEOUT,
    resume: bool = True,
    resume_timeout: float = RESUME_TIMEOUT,
    **options: Unpack[SessionOptions],
) -> SyncChat:
    """Open a conversation with blocking calls: ``with connect_sync(url) as chat``.

    Same arguments as :func:`gateway.client.connect`. Works inside a running event loop too.
    """
    runner = _LoopThread()
    try:
        opening = AsyncChat.open(
            url,
            api_key=api_key,
            timeout=timeout,
            resume=resume,
            resume_timeout=resume_timeout,
            **options,
        )
        chat = runner.run(opening)
    except BaseException:
        runner.stop()
        raise
    return SyncChat(runner, chat)
