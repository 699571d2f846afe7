"""The Responses API's ``tools`` and ``tool_choice``: what a create body offers the model.

Every tool type of openai-python's ``ToolParam`` union has an answer here
(docs/protocol.md, "Tools"), walked by a test so that an SDK release with a new type fails
until it is placed:

- ``function``: served (the engines' own kind of tool).
- ``namespace``: its function tools are offered to the model under one flat name each,
  ``NAMESPACE__NAME`` (the engines and their chat templates take nothing else), and a call
  of one comes back as a ``function_call`` item with ``namespace`` and the inner ``name``.
- The tools that OpenAI's servers run or that produce OpenAI's own item types
  (:data:`HOSTED_TOOL_TYPES`): no engine here can run them. They are noted in
  :attr:`ToolSet.hosted`, and the dialect applies ``--hosted-tools``: left out of the
  prompt (``ignore``, the default: Codex offers ``web_search`` on every request) or
  refused (``refuse``). A ``tool_choice`` that names one is refused either way.
- ``custom`` (free-form input): refused with ``unsupported_value`` (the engines here
  emit JSON arguments only).
"""

from __future__ import annotations

from dataclasses import dataclass

from gateway.engines.base import TOOL_CHOICE_MODES, Tool, ToolChoice
from sessions.codec import JSON, MAX_TOOLS, TOOL_NAME, Reader, function_tool, tools_json

# The fields of openai-python's FunctionToolParam (and of a namespace's function tools).
_FUNCTION_FIELDS = frozenset(
    {"type", "name", "description", "parameters", "strict"}
    | {"allowed_callers", "defer_loading", "output_schema", "async"}
)
_NAMESPACE_FIELDS = frozenset({"type", "name", "description", "tools"})
SERVED_TOOL_TYPES = frozenset({"function", "namespace"})
REFUSED_TOOL_TYPES = frozenset({"custom"})
HOSTED_TOOL_TYPES = frozenset(
    {
        "file_search",
        "computer",
        "computer_use_preview",
        "web_search",
        "web_search_2025_08_26",
        "web_search_preview",
        "web_search_preview_2025_03_11",
        "mcp",
        "code_interpreter",
        "programmatic_tool_calling",
        "image_generation",
        "local_shell",
        "shell",
        "tool_search",
        "apply_patch",
    }
)
NAMESPACE_SEPARATOR = "__"


@dataclass(frozen=True, slots=True)
class Namespaced:
    """One function of a ``namespace`` tool: its flat name and where it came from."""

    flat: str
    namespace: str
    name: str
    namespace_description: str = ""


@dataclass(frozen=True, slots=True)
class ToolSet:
    tools: tuple[Tool, ...] = ()  # flat: what the engine is offered
    namespaced: tuple[Namespaced, ...] = ()
    hosted: tuple[tuple[str, str], ...] = ()  # (param, type) of each hosted tool


def read_tools(r: Reader) -> ToolSet:
    value = r.obj["tools"]
    if value is None:
        return ToolSet()
    if not isinstance(value, list):
        raise r.fail("tools", "'tools' must be a list of tools.", "invalid_type")
    if len(value) > MAX_TOOLS:
        raise r.fail("tools", f"'tools' holds at most {MAX_TOOLS} tools.")
    tools: list[Tool] = []
    namespaced: list[Namespaced] = []
    hosted: list[tuple[str, str]] = []
    for index, raw in enumerate(value):
        t = r.child_at("tools", index, raw)
        kind = t.obj.get("type", "function")
        if kind == "function":
            tools.append(_function(t, tools))
        elif kind == "namespace":
            for inner in _namespace(t, tools):
                namespaced.append(inner)
        elif kind in HOSTED_TOOL_TYPES:
            hosted.append((f"tools[{index}]", kind))
        elif kind in REFUSED_TOOL_TYPES:
            raise t.fail(
                "type",
                "Custom (free-form) tools are not served: the engines here call functions "
                "with JSON arguments. Send a 'function' tool.",
                "unsupported_value",
            )
        else:
            raise t.fail(
                "type",
                f"Unknown tool type {str(kind)[:64]!r}: use 'function' or 'namespace'.",
                "invalid_value",
            )
    return ToolSet(tuple(tools), tuple(namespaced), tuple(hosted))


def _function(t: Reader, tools: list[Tool], flat: str | None = None) -> Tool:
    """A function tool, offered under ``flat`` (a namespace's) or its own name."""
    t.only(_FUNCTION_FIELDS)
    t.required("name")
    name = t.string("name")
    if not TOOL_NAME.fullmatch(name):
        raise t.fail("name", f"'{t.param('name')}' must be 1 to 64 letters, digits, '_' or '-'.")
    flat = flat or name
    if len(flat) > 64:
        raise t.fail("name", f"'{flat}' (namespace and name) must be at most 64 characters.")
    if any(tool.name == flat for tool in tools):
        raise t.fail("name", f"Two tools are named '{flat}': tool names must be unique.")
    return function_tool(t, flat)


def _namespace(t: Reader, tools: list[Tool]) -> list[Namespaced]:
    t.only(_NAMESPACE_FIELDS)
    t.required("name")
    namespace = t.string("name", max_chars=64)
    if not TOOL_NAME.fullmatch(namespace):
        raise t.fail("name", f"'{t.param('name')}' must be 1 to 64 letters, digits, '_' or '-'.")
    description = t.optional_string("description") or ""
    t.required("tools")
    inner = t.obj["tools"]
    if not isinstance(inner, list) or not inner:
        raise t.fail("tools", f"'{t.param('tools')}' must be a non-empty list.", "invalid_type")
    made: list[Namespaced] = []
    for index, raw in enumerate(inner):
        f = t.child_at("tools", index, raw)
        if f.obj.get("type") != "function":
            raise f.fail(
                "type",
                "A namespace's tools must be functions here (custom tools are not served).",
                "unsupported_value",
            )
        f.required("name")
        name = f.string("name", max_chars=64)
        flat = f"{namespace}{NAMESPACE_SEPARATOR}{name}"
        tools.append(_function(f, tools, flat))
        made.append(Namespaced(flat, namespace, name, description))
    return made


def read_tool_choice(r: Reader, toolset: ToolSet | None) -> ToolChoice:
    """``auto``, ``none``, ``required``, or a function by name (a namespaced one by its
    inner name, when that names one function). Any other kind is refused: the tools it
    names are not served."""
    value = r.obj["tool_choice"]
    if value is None:
        return "auto"
    if isinstance(value, str):
        if value not in TOOL_CHOICE_MODES:
            raise r.fail(
                "tool_choice",
                f"'{r.param('tool_choice')}' must be 'auto', 'none', 'required' or "
                '{"type": "function", "name": ...}.',
            )
        return value
    c = r.child("tool_choice")
    kind = c.required("type")
    if kind != "function":
        raise c.fail(
            "type",
            f"A tool_choice of type {str(kind)[:64]!r} names a tool this gateway does not "
            'serve: choose a function ({"type": "function", "name": ...}) or a mode.',
            "unsupported_value",
        )
    c.only(frozenset({"type", "name"}))
    c.required("name")
    name = c.string("name", max_chars=64)
    if name in TOOL_CHOICE_MODES:
        # The engines take the chosen name in the same field as the three modes.
        raise c.fail("name", f"A function named '{name}' cannot be chosen by name.")
    if toolset is not None and all(t.name != name for t in toolset.tools):
        inner = [n.flat for n in toolset.namespaced if n.name == name]
        if len(inner) == 1:
            return inner[0]
    return name


def tools_echo(tools: tuple[Tool, ...], namespaced: tuple[Namespaced, ...]) -> list[JSON]:
    """The ``tools`` of a ``Response``: functions as sent, a namespace's gathered again."""
    by_flat = {n.flat: n for n in namespaced}
    echoed: list[JSON] = []
    spaces: dict[str, JSON] = {}
    for tool, shown in zip(tools, tools_json(tools), strict=True):
        n = by_flat.get(tool.name)
        if n is None:
            echoed.append({**shown, "strict": False})
            continue
        space = spaces.get(n.namespace)
        if space is None:
            space = spaces[n.namespace] = {
                "type": "namespace",
                "name": n.namespace,
                "description": n.namespace_description,
                "tools": [],
            }
            echoed.append(space)
        space["tools"].append({**shown, "name": n.name, "strict": False})
    return echoed
