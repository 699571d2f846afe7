"""A stand-in OTLP/HTTP collector for bench.observability: ``python -m bench.otlp_sink PORT``
takes every ``POST`` (an ``ExportTraceServiceRequest``), reads its body and answers 200 with
an empty protobuf message, as a collector does, without decoding what it keeps nothing of.
It prints the requests and bytes it took when it is stopped (SIGTERM)."""

from __future__ import annotations

import asyncio
import signal
import sys

_ANSWER = b"HTTP/1.1 200 OK\r\nContent-Type: application/x-protobuf\r\nContent-Length: 0\r\n\r\n"


async def _serve(port: int) -> None:
    taken = [0, 0]

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while head := await reader.readuntil(b"\r\n\r\n"):
                length = 0
                for line in head.split(b"\r\n"):
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value)
                await reader.readexactly(length)
                taken[0] += 1
                taken[1] += length
                writer.write(_ANSWER)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", port)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    print("ready", flush=True)
    async with server:
        await stop.wait()
    print(f"requests {taken[0]} bytes {taken[1]}", flush=True)


if __name__ == "__main__":
    asyncio.run(_serve(int(sys.argv[1])))
