"""The blocking client: the asyncio client driven from a private event-loop thread.

``asyncio.run()`` fails where a loop already runs (a Jupyter cell), and blocking that loop
would freeze it. So each :class:`SyncChat` owns a daemon thread running its own loop; every
call hands a coroutine to that loop and blocks the caller until it is done. This works the
same in a plain script, in a thread, or inside a running loop.

Ctrl-C arrives as ``KeyboardInterrupt`` in the waiting (main) thread, never in the loop
thread: the waiting call then cancels its coroutine and, during a stream, cancels the answer
on the gateway before re-raising.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Coroutine, Iterator
from types import TracebackType
from typing import Any, TypeVar, Unpack

from gateway.client.aio import DEFAULT_TIMEOUT, AsyncChat, AsyncStream
from gateway.client.errors import ClientError
from gateway.client.events import JSON, ResponseOptions, SessionOptions
from gateway.client.reply import Reply

T = TypeVar("T")


class _LoopThread:
    """An event loop on its own daemon thread, and a blocking way to run coroutines on it."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._serve, name="gateway-client", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the private loop and wait for it; interrupting the wait cancels it."""
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError("a sync chat cannot be used from its own loop thread")
        if self.loop.is_closed():
            coro.close()
            raise ClientError("this chat is closed")
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result()
        except BaseException:
            # KeyboardInterrupt (or any exit) while waiting: the coroutine must not go on
            # alone. cancel() is a no-op if it already finished.
            future.cancel()
            raise

    def stop(self) -> None:
        """Finish the loop's leftover tasks, stop it and join the thread."""
        if self.loop.is_closed():
            return

        async def drain() -> None:
            current = asyncio.current_task()
            leftovers = [t for t in asyncio.all_tasks() if t is not current]
            for task in leftovers:
                task.cancel()
            await asyncio.gather(*leftovers, return_exceptions=True)
            await self.loop.shutdown_asyncgens()

        if self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(drain(), self.loop).result()
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join()
        self.loop.close()


class SyncStream:
    """One answer as it is generated: ``for delta in stream`` yields the new text.

    Leaving the loop early (``break``, an exception, Ctrl-C while waiting or while printing)
    cancels the answer on the gateway; the exception then propagates.
    """

    def __init__(self, runner: _LoopThread, stream: AsyncStream) -> None:
        self._runner = runner
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


class SyncChat:
    """One conversation, blocking calls. See :class:`gateway.client.aio.AsyncChat`."""

    def __init__(self, runner: _LoopThread, chat: AsyncChat) -> None:
        self._runner = runner
        self._chat = chat

    @property
    def session(self) -> JSON:
        return self._chat.session

    @property
    def closed(self) -> bool:
        return self._chat.closed

    def ask(self, text: str, **options: Unpack[ResponseOptions]) -> Reply:
        """Send ``text`` and return the whole answer; Ctrl-C cancels it on the gateway."""
        try:
            return self._runner.run(self._chat.ask(text, **options))
        except KeyboardInterrupt:
            self._runner.run(self._chat.cancel())
            raise

    def stream(self, text: str, **options: Unpack[ResponseOptions]) -> SyncStream:
        """``for delta in chat.stream(text): print(delta, end="", flush=True)``."""
        return SyncStream(self._runner, self._chat.stream(text, **options))

    def update(self, **options: Unpack[SessionOptions]) -> JSON:
        """Change session settings (instructions, sampling...); returns the updated session."""
        return self._runner.run(self._chat.update(**options))

    def cancel(self) -> Reply | None:
        """Stop the answer in progress, if any."""
        return self._runner.run(self._chat.cancel())

    def close(self) -> None:
        """Close the connection and stop the private loop thread."""
        try:
            if not self._runner.loop.is_closed():
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


def connect_sync(
    url: str | None = None,
    *,
    api_key: str | None = None,
    timeout: float | None = DEFAULT_TIMEOUT,
    **options: Unpack[SessionOptions],
) -> SyncChat:
    """Open a conversation with blocking calls: ``with connect_sync(url) as chat``.

    Same arguments as :func:`gateway.client.connect`. Works inside a running event loop too.
    """
    runner = _LoopThread()
    try:
        chat = runner.run(AsyncChat.open(url, api_key=api_key, timeout=timeout, **options))
    except BaseException:
        runner.stop()
        raise
    return SyncChat(runner, chat)
