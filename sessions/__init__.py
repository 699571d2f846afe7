"""Per-connection state: the session actor, its conversation and its outbox.

Pure asyncio; nothing here imports ``websockets``, so a session can be driven in
tests by feeding it events and reading what it puts in its outbox.
"""
