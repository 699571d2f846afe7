"""The baselines the gateway is measured against, in the same run: servers with none of its
logic, each named for what it runs.

- ``floor_server`` / ``floor_sse_server``: the floor, one loop turn writing a prebuilt frame
  (or SSE event) to every active socket with ``transport.write`` and nothing else
  (``prebuilt``: their bytes and that loop turn).
- ``bare_server``: bare websockets, a task per stream sending with ``await ws.send``.
- ``fastapi_server``: a minimal FastAPI + uvicorn app (a plain generator, a plain handler);
  ``vllm_shape_server``: the same with vLLM's per-request queue and producer task.
- ``fastapi_proxy``: FastAPI + httpx forwarding to an upstream (LiteLLM's architecture).
"""
