"""STAND-IN for ``tensorrt_llm.executor`` (tests only): the one name the stand-in's results
use, where the real package keeps it."""
