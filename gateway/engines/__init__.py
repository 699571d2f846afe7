"""Engine registry: each engine module registers its flags and builds itself from them.

Modules are imported lazily by name so that an engine's heavy dependency
(``tensorrt_llm``, ``xllamacpp``) is touched only when that engine is chosen.
Each module defines ``add_arguments(group)`` and ``from_args(args) -> Engine``;
``add_arguments`` must not import the engine's dependency.
"""

from __future__ import annotations

import argparse
import importlib
from types import ModuleType

from gateway.engines.base import Engine

ENGINES: dict[str, str] = {
    "llamacpp": "gateway.engines.llamacpp",
    "sim": "gateway.engines.sim",
    "trtllm": "gateway.engines.trtllm",
    "upstream": "gateway.engines.upstream",
}
DEFAULT_ENGINE = "llamacpp"


def _module(name: str) -> ModuleType:
    return importlib.import_module(ENGINES[name])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    for name in ENGINES:
        _module(name).add_arguments(parser.add_argument_group(f"{name} engine"))


def from_args(args: argparse.Namespace) -> Engine:
    engine: Engine = _module(args.engine).from_args(args)
    return engine
