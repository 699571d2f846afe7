"""The baselines the gateway is measured against, in the same run: servers with none of its
logic (``bare_server``: plain websockets; ``fastapi_sse_server``: FastAPI + uvicorn)."""
