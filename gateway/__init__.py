"""A streaming LLM gateway speaking the text subset of the OpenAI Realtime API."""

__version__ = "0.1.0"
