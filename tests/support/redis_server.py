"""A real ``redis-server`` for tests: no mocks, a process of its own on a loopback port.

:class:`RedisServer` runs Debian's ``redis-server`` (``apt-get install redis-server``;
``.ci/run`` installs it) on a free port of 127.0.0.1, in a temporary folder, without
persistence by default (``--save '' --appendonly no``). It can be stopped (SIGTERM), killed
(SIGKILL) and started again on the same port with the same settings, like a restarted or
crashed Redis that clients reconnect to.

Fixtures, for a test module that imports them (``from tests.support.redis_server import
redis_server_fixture  # noqa: F401``: the functions are named so that a test's parameter
does not shadow the import) or names this module in ``pytest_plugins``:

- ``redis_server``: a fresh server for each test;
- ``redis_module``: one server shared by the tests of a module.

Both skip the test where ``redis-server`` is not installed, except under ``CI=true``, where
they fail: a CI run that silently skipped Redis would prove nothing.

:func:`redis_cli` runs one command synchronously, for assertions
(``redis_cli(url, "keys", "*")``, ``redis_cli(url, "ttl", key)``).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import weakref
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType
from typing import Any

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

# The redis-server binary: $REDIS_SERVER where set (a path or a name on PATH).
EXECUTABLE_ENV_VAR = "REDIS_SERVER"
DEFAULT_EXECUTABLE = "redis-server"
START_TIMEOUT = 10.0  # seconds for a started server to answer PING; it takes milliseconds
STOP_TIMEOUT = 10.0  # seconds for a SIGTERM to end it before it is killed
_LOG_TAIL = 2000  # characters of the server's log quoted in an error


class RedisServerMissing(RuntimeError):
    """``redis-server`` is not installed (or not where ``$REDIS_SERVER`` points)."""


def free_port() -> int:
    """A TCP port of 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def find_redis_server(executable: str | None = None) -> str | None:
    """The path of the ``redis-server`` binary, or None where it is not installed."""
    name = executable or os.environ.get(EXECUTABLE_ENV_VAR) or DEFAULT_EXECUTABLE
    return shutil.which(name)


def _missing_reason(executable: str | None = None) -> str:
    name = executable or os.environ.get(EXECUTABLE_ENV_VAR) or DEFAULT_EXECUTABLE
    return (
        f"{name} not found: install Redis (apt-get install redis-server) "
        f"or point ${EXECUTABLE_ENV_VAR} at a redis-server binary"
    )


def require_redis_server() -> str:
    """The ``redis-server`` path; else skips the calling test (fails it under ``CI=true``)."""
    path = find_redis_server()
    if path is None:
        reason = _missing_reason()
        if os.environ.get("CI") == "true":
            pytest.fail(reason)
        pytest.skip(reason)
    return path


def redis_cli(url: str, *args: str | int | float | bytes, decode: bool = True) -> Any:
    """Runs one Redis command on a short-lived connection and returns its reply.

    Replies are decoded as UTF-8 unless ``decode=False``: ``redis_cli(url, "keys", "*")``
    is a list of str, ``redis_cli(url, "ttl", key)`` an int.
    """
    with redis.Redis.from_url(
        url, decode_responses=decode, socket_timeout=START_TIMEOUT, retry=_NO_RETRY
    ) as r:
        return r.execute_command(*args)


# One try: a server that is down fails the command at once (redis-py's default retries
# with a backoff for seconds).
_NO_RETRY = Retry(NoBackoff(), 0)


class RedisServer:
    """One ``redis-server`` process on ``127.0.0.1:port``, started by :meth:`start`.

    The port is chosen when the object is made (``port=`` picks one) and kept for its
    whole life, so a restarted server is where its clients left it (where another process
    takes a chosen port before the first start, :meth:`start` chooses again). ``save`` and
    ``appendonly`` are Redis's own settings (the defaults keep nothing on disk; with
    ``appendonly=True`` the data survive :meth:`restart` and :meth:`kill`); ``args`` are
    more ``--name value`` words for the command line. A context manager: starts on enter,
    stops and removes its folder on exit.
    """

    def __init__(
        self,
        *args: str,
        port: int | None = None,
        save: str = "",
        appendonly: bool = False,
        executable: str | None = None,
        config: str | None = None,
    ) -> None:
        self._config = config  # a config file's text (Sentinel needs one it can rewrite)
        self._explicit_port = port is not None
        self._port = port if port is not None else free_port()
        self._extra = list(args)
        self._save = save
        self._appendonly = appendonly
        self._executable = executable
        self._dir: Path | None = None
        self._process: subprocess.Popen[bytes] | None = None
        _LIVE.add(self)

    # -- where it is ------------------------------------------------------------------

    @property
    def port(self) -> int:
        return self._port

    @property
    def host(self) -> str:
        return "127.0.0.1"

    @property
    def url(self) -> str:
        """``redis://127.0.0.1:PORT/0``."""
        return f"redis://127.0.0.1:{self._port}/0"

    @property
    def dir(self) -> Path:
        """The server's working folder (its log, and its files where it persists)."""
        if self._dir is None:
            self._dir = Path(tempfile.mkdtemp(prefix="redis-test-"))
        return self._dir

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    @property
    def pid(self) -> int | None:
        return self._process.pid if self.running and self._process is not None else None

    def client(self, *, decode: bool = True, **options: Any) -> redis.Redis:
        """A synchronous client of this server (close it, or use it as a context manager);
        ``options`` go to :class:`redis.Redis` (``retry=``, ``socket_timeout=``...)."""
        return redis.Redis(host=self.host, port=self._port, decode_responses=decode, **options)

    def log(self) -> str:
        """What the server has written to its log so far."""
        try:
            return (self.dir / "redis.log").read_text(errors="replace")
        except OSError:
            return ""

    # -- life -------------------------------------------------------------------------

    def argv(self) -> list[str]:
        """The command line :meth:`start` runs."""
        path = find_redis_server(self._executable)
        if path is None:
            raise RedisServerMissing(_missing_reason(self._executable))
        argv = [path]
        if self._config is not None:
            config = self.dir / "redis.conf"
            if not config.exists():  # kept on a restart: Sentinel writes what it learnt
                config.write_text(self._config)
            argv.append(str(config))
        argv += ["--port", str(self._port), "--bind", "127.0.0.1"]
        argv += ["--save", self._save, "--appendonly", "yes" if self._appendonly else "no"]
        argv += ["--dir", str(self.dir), "--daemonize", "no", "--logfile", ""]
        return argv + self._extra

    def start(self, timeout: float = START_TIMEOUT) -> RedisServer:
        """Starts the server and returns once it answers PING.

        Raises :class:`RedisServerMissing` where there is no ``redis-server``, and
        RuntimeError (with the server's log) where it exits or does not answer in time.
        A port taken by another process since it was chosen is replaced by a free one on
        the first start only (never on a restart, nor a port given by the caller).
        """
        if self.running:
            raise RuntimeError(f"redis-server is already running on port {self._port}")
        first = self._process is None and not self._explicit_port
        for attempt in range(3):
            try:
                self._spawn(timeout)
                return self
            except _PortTaken:
                if not first or attempt == 2:
                    raise RuntimeError(
                        f"redis-server could not listen on 127.0.0.1:{self._port}, "
                        f"which another process holds:\n{self._log_tail()}"
                    ) from None
                self._port = free_port()
        raise AssertionError("unreachable")

    def _spawn(self, timeout: float) -> None:
        argv = self.argv()
        logged = len(self.log())  # this start's own lines come after
        with open(self.dir / "redis.log", "ab") as log:
            self._process = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT
            )
        deadline = time.monotonic() + timeout
        while True:
            code = self._process.poll()
            if code is not None:
                self._process = None
                if "Address already in use" in self.log()[logged:]:
                    raise _PortTaken
                raise RuntimeError(
                    f"redis-server exited with code {code} before answering:\n{self._log_tail()}"
                )
            if self._answers():
                return
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(
                    f"redis-server did not answer PING on port {self._port} within "
                    f"{timeout:g} s:\n{self._log_tail()}"
                )
            time.sleep(0.01)

    def _answers(self) -> bool:
        try:
            with redis.Redis(
                host=self.host,
                port=self._port,
                socket_connect_timeout=1,
                socket_timeout=1,
                retry=_NO_RETRY,
            ) as r:
                return bool(r.ping())
        except redis.exceptions.ConnectionError:  # refused, or still loading its data
            return False

    def _log_tail(self) -> str:
        return self.log()[-_LOG_TAIL:]

    def stop(self, timeout: float = STOP_TIMEOUT) -> None:
        """SIGTERM (Redis's clean shutdown), then waits for the process to end (SIGKILL
        after ``timeout``). Does nothing where it is not running."""
        process, self._process = self._process, None
        if process is None:
            return
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        else:
            process.wait()
        self._process = process  # remembered: a later start is a restart (same port)

    def kill(self) -> None:
        """SIGKILL, like a crash: nothing saved, no goodbye to clients."""
        process = self._process
        if process is None:
            return
        if process.poll() is None:
            process.send_signal(signal.SIGKILL)
        process.wait()

    def restart(self, timeout: float = START_TIMEOUT) -> RedisServer:
        """:meth:`stop` then :meth:`start`: the same port, folder and settings."""
        self.stop()
        return self.start(timeout)

    def close(self) -> None:
        """Stops the server and removes its folder."""
        self.stop()
        _LIVE.discard(self)
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def __enter__(self) -> RedisServer:
        if not self.running:
            self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        return f"<RedisServer {self.url} {state}>"


class _PortTaken(Exception):
    pass


# Servers still running when the interpreter exits (a test run interrupted past its
# fixtures' teardown) are killed rather than left behind.
_LIVE: weakref.WeakSet[RedisServer] = weakref.WeakSet()


@atexit.register
def _kill_leftovers() -> None:
    for server in list(_LIVE):
        with contextlib.suppress(Exception):
            server.kill()


@pytest.fixture(name="redis_server")
def redis_server_fixture() -> Iterator[RedisServer]:
    """A fresh ``redis-server`` for one test (stopped and removed after it)."""
    require_redis_server()
    with RedisServer() as server:
        yield server


@pytest.fixture(name="redis_module", scope="module")
def redis_module_fixture() -> Iterator[RedisServer]:
    """One ``redis-server`` for all the tests of a module; its data carry over between
    them. A test that stops or kills it starts it again before it ends."""
    require_redis_server()
    with RedisServer() as server:
        yield server
