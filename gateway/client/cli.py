"""Terminal chat: ``python -m gateway.client [URL]``.

Each answer streams as it is generated. Ctrl-C while an answer streams stops that answer
(on the gateway too) and returns to the prompt; Ctrl-D at the prompt exits. ``--once``
asks one question (``-`` reads it from stdin) and prints only the answer, for pipelines.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Callable
from typing import TextIO

from gateway.client.aio import DEFAULT_TIMEOUT
from gateway.client.errors import ClientError
from gateway.client.events import DEFAULT_URL, URL_ENV, SessionOptions
from gateway.client.sync import SyncChat, connect_sync

HELP = """commands:
  /reset          start a new conversation (keeps the instructions)
  /system TEXT    set the instructions ("/system" alone clears them)
  /help           this text
Ctrl-C stops an answer, Ctrl-D exits."""

STOPPED = " [stopped]"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m gateway.client", description="Chat with the gateway in the terminal."
    )
    parser.add_argument(
        "url", nargs="?", default=None, help=f"WebSocket URL (default: ${URL_ENV} or {DEFAULT_URL})"
    )
    parser.add_argument("--once", metavar="QUESTION", help='ask one question ("-": read stdin)')
    parser.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    parser.add_argument("--system", "--instructions", dest="instructions", default=None)
    parser.add_argument("--max-output-tokens", type=int, default=None)
    parser.add_argument("--temperature", type=float, default=None)
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--frequency-penalty", type=float, default=None, help="-2.0 to 2.0")
    parser.add_argument("--presence-penalty", type=float, default=None, help="-2.0 to 2.0")
    parser.add_argument(
        "--timeout", type=float, default=DEFAULT_TIMEOUT, help="seconds to wait for any event"
    )
    parser.add_argument(
        "--no-resume",
        dest="resume",
        action="store_false",
        help="do not resume the conversation after a dropped connection",
    )
    return parser


def session_options(args: argparse.Namespace) -> SessionOptions:
    options = SessionOptions()
    if args.instructions:
        options["instructions"] = args.instructions
    if args.max_output_tokens is not None:
        options["max_output_tokens"] = args.max_output_tokens
    if args.temperature is not None:
        options["temperature"] = args.temperature
    if args.top_p is not None:
        options["top_p"] = args.top_p
    if args.seed is not None:
        options["seed"] = args.seed
    if args.frequency_penalty is not None:
        options["frequency_penalty"] = args.frequency_penalty
    if args.presence_penalty is not None:
        options["presence_penalty"] = args.presence_penalty
    return options


def stream_answer(chat: SyncChat, question: str, out: TextIO) -> bool:
    """Print the answer as it comes; returns False if Ctrl-C stopped it."""
    stream = chat.stream(question)
    try:
        for delta in stream:
            out.write(delta)
            out.flush()
    except KeyboardInterrupt:  # leaving the loop has already cancelled the answer on the gateway
        out.write(STOPPED + "\n")
        out.flush()
        return False
    out.write("\n")
    out.flush()
    return True


class Repl:
    """The interactive loop; holds the chat so that ``/reset`` can replace it."""

    def __init__(self, connect: Callable[[SessionOptions], SyncChat], options: SessionOptions):
        self._connect = connect
        self.options = options
        self.chat = connect(options)

    def run(self) -> int:
        _enable_line_editing()
        print(
            "connected. /help for commands, Ctrl-C stops an answer, Ctrl-D exits.", file=sys.stderr
        )
        try:
            while True:
                try:
                    line = input("> ")
                except KeyboardInterrupt:  # like a shell: drop the line, keep going
                    print("", file=sys.stderr)
                    continue
                except EOFError:
                    print("", file=sys.stderr)
                    return 0
                self.handle(line.strip())
        finally:
            self.chat.close()

    def handle(self, line: str) -> None:
        """One line: a command or a question. A failed one is reported and the REPL goes on."""
        if not line:
            return
        try:
            if line.startswith("/"):
                self.command(line)
            else:
                stream_answer(self.chat, line, sys.stdout)
        except ClientError as exc:
            print(f"error: {exc}", file=sys.stderr)
            if self.chat.closed:
                self.reconnect()
                print("(reconnected: new conversation)", file=sys.stderr)

    def command(self, line: str) -> None:
        name, _, rest = line.partition(" ")
        if name == "/reset":
            self.reconnect()
            print("(new conversation)", file=sys.stderr)
        elif name == "/system":
            self.chat.update(instructions=rest.strip())  # refused: the old ones stay
            self.options["instructions"] = rest.strip()
            print(
                "(instructions set)" if rest.strip() else "(instructions cleared)", file=sys.stderr
            )
        elif name in ("/help", "/?"):
            print(HELP, file=sys.stderr)
        else:
            print(f"unknown command {name}; /help lists them", file=sys.stderr)

    def reconnect(self) -> None:
        """A new connection is a new, empty conversation; the settings are sent again."""
        self.chat.close()
        self.chat = self._connect(self.options)


def _enable_line_editing() -> None:
    """Importing readline gives input() history and editing (where it exists)."""
    if sys.stdin.isatty():
        with contextlib.suppress(ImportError):
            import readline  # noqa: F401


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    def connect(options: SessionOptions) -> SyncChat:
        return connect_sync(
            args.url, api_key=args.api_key, timeout=args.timeout, resume=args.resume, **options
        )

    try:
        if args.once is not None:
            question = sys.stdin.read().strip() if args.once == "-" else args.once
            with connect(session_options(args)) as chat:
                return 0 if stream_answer(chat, question, sys.stdout) else 130
        return Repl(connect, session_options(args)).run()
    except ClientError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
