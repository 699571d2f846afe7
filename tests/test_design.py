"""The one-file engine of examples/echo_engine.py, served by a real gateway: the engine
interface is as small as docs/design.md says."""

from __future__ import annotations

from examples.echo_engine import EchoEngine
from tests.support.harness import RawClient, running_gateway


async def test_a_one_file_engine_serves_answers_and_cancels() -> None:
    engine = EchoEngine(step_s=0.005)
    async with running_gateway(engine) as gw:
        async with RawClient.connect(gw.ws_url) as client:
            await client.say("hello from a new engine")
            turn = await client.respond()
            assert turn.status == "completed"
            assert turn.text == turn.final_text == "hello from a new engine"
            await client.say(" ".join(["word"] * 200))
            await client.send({"type": "response.create"})
            await client.recv_until("response.output_text.delta")
            await client.send({"type": "response.cancel"})
            done = await client.recv_until("response.done")
            assert done["response"]["status"] == "cancelled"
        await gw.wait_idle()
        assert not engine._words  # the engine let go of the cancelled request
