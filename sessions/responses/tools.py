"""The Responses API's ``tools`` and ``tool_choice``: what a create body offers the model.

Every tool type of openai-python's ``ToolParam`` union has an answer here
(docs/protocol.md, "The create body"), walked by a test so that an SDK release with a
new type fails until it is placed:

- ``function``: served (the engines' own kind of tool).
- ``namespace``: its function tools are offered to the model under one flat name each,
  ``NAMESPACE__NAME`` (the engines and their chat templates take nothing else), and a call
  of one comes back as a ``function_call`` item with ``namespace`` and the inner ``name``.
- The tools that OpenAI's servers run or that produce OpenAI's own item types
  (:data:`HOSTED_TOOL_TYPES`): no engine here can run them. They are noted in
  :attr:`ToolSet.hosted`, and the dialect applies ``--hosted-tools``: left out of the
  prompt (``ignore``, the default: Codex offers ``web_search`` on every request) or
  refused (``refuse``). A ``tool_choice`` that names one is refused either way.
- ``custom`` (free-form input): offered to the model as a function of one string
  parameter, ``input`` (a ``grammar`` format goes in its description too), marked
  ``freeform`` with its ``grammar`` for the engines, which constrain that input to it
  or refuse the request (gateway/engines/tool_format.py); a call comes back as a
  ``custom_tool_call`` item whose input streams in ``response.custom_tool_call_input``
  events, decoded from the arguments as they arrive (:class:`InputDecoder`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from gateway.engines.base import TOOL_CHOICE_MODES, Constraint, Tool, ToolChoice
from sessions.codec import JSON, MAX_TOOLS, TOOL_NAME, Reader, function_tool, tools_json

# The fields of openai-python's FunctionToolParam (and of a namespace's function tools).
_FUNCTION_FIELDS = frozenset(
    {"type", "name", "description", "parameters", "strict"}
    | {"allowed_callers", "defer_loading", "output_schema", "async"}
)
_NAMESPACE_FIELDS = frozenset({"type", "name", "description", "tools"})
_CUSTOM_FIELDS = frozenset(
    {"type", "name", "description", "format", "allowed_callers", "defer_loading", "async"}
)
SERVED_TOOL_TYPES = frozenset({"function", "namespace", "custom"})
REFUSED_TOOL_TYPES: frozenset[str] = frozenset()
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
class Mapped:
    """A tool the engine is offered under another name or kind than the client declared:
    a namespace's (``namespace`` set), a custom one (``custom_format`` set), or both."""

    flat: str
    name: str
    namespace: str = ""
    namespace_description: str = ""
    custom_format: JSON | None = None
    description: str = ""  # a custom tool's own, for the echo


@dataclass(frozen=True, slots=True)
class ToolSet:
    tools: tuple[Tool, ...] = ()  # flat: what the engine is offered
    mapped: tuple[Mapped, ...] = ()
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
    mapped: list[Mapped] = []
    hosted: list[tuple[str, str]] = []
    for index, raw in enumerate(value):
        tool = _common_function(raw, tools)
        if tool is not None:
            tools.append(tool)
            continue
        t = r.child_at("tools", index, raw)
        kind = t.obj.get("type", "function")
        if kind == "function":
            tools.append(_function(t, tools))
        elif kind == "custom":
            mapped.append(_custom(t, tools))
        elif kind == "namespace":
            mapped.extend(_namespace(t, tools))
        elif kind in HOSTED_TOOL_TYPES:
            hosted.append((f"tools[{index}]", kind))
        else:
            raise t.fail(
                "type",
                f"Unknown tool type {str(kind)[:64]!r}: use 'function', 'custom' or 'namespace'.",
                "invalid_value",
            )
    return ToolSet(tuple(tools), tuple(mapped), tuple(hosted))


def _common_function(raw: object, tools: list[Tool]) -> Tool | None:
    """:func:`_function`'s answer for a well-formed function tool, read without a
    :class:`Reader`; None for anything else (anything wrong included): read so, and
    refused naming the param."""
    if type(raw) is not dict or raw.get("type", "function") != "function":
        return None
    if not raw.keys() <= _FUNCTION_FIELDS:
        return None
    name, description, parameters = raw.get("name"), raw.get("description"), raw.get("parameters")
    if type(name) is not str or not TOOL_NAME.fullmatch(name):
        return None
    if description is not None and type(description) is not str:
        return None
    if parameters is None:
        parameters = {"type": "object", "properties": {}}
    elif type(parameters) is not dict or parameters.get("type", "object") != "object":
        return None
    if any(tool.name == name for tool in tools):
        return None
    return Tool(name, description or "", parameters)


def _tool_name(t: Reader, tools: list[Tool], flat: str | None) -> tuple[str, str]:
    """The tool's own name and the name the engine is offered (unique among ``tools``)."""
    t.required("name")
    name = t.string("name")
    if not TOOL_NAME.fullmatch(name):
        raise t.fail("name", f"'{t.param('name')}' must be 1 to 64 letters, digits, '_' or '-'.")
    flat = flat or name
    if len(flat) > 64:
        raise t.fail("name", f"'{flat}' (namespace and name) must be at most 64 characters.")
    if any(tool.name == flat for tool in tools):
        raise t.fail("name", f"Two tools are named '{flat}': tool names must be unique.")
    return name, flat


def _function(t: Reader, tools: list[Tool], flat: str | None = None) -> Tool:
    """A function tool, offered under ``flat`` (a namespace's) or its own name."""
    t.only(_FUNCTION_FIELDS)
    _, flat = _tool_name(t, tools, flat)
    return function_tool(t, flat)


def _custom(t: Reader, tools: list[Tool], namespace: str = "", space: str = "") -> Mapped:
    """A custom tool, offered as a function whose one parameter is its free-form input."""
    t.only(_CUSTOM_FIELDS)
    flat = f"{namespace}{NAMESPACE_SEPARATOR}{t.obj.get('name')}" if namespace else None
    name, flat = _tool_name(t, tools, flat)
    description = t.optional_string("description") or ""
    fmt: JSON = {"type": "text"}
    about = "Free-form text input."
    grammar: Constraint | None = None
    if t.obj.get("format") is not None:
        f = t.child("format")
        kind = f.required("type")
        if kind == "grammar":
            f.only(frozenset({"type", "syntax", "definition"}))
            syntax = f.required("syntax")
            if syntax not in ("lark", "regex"):
                raise f.fail("syntax", "'format.syntax' must be 'lark' or 'regex'.")
            f.required("definition")
            definition = f.string("definition")
            fmt = {"type": "grammar", "syntax": syntax, "definition": definition}
            about = f"Input that matches this {syntax} grammar:\n{definition}"
            grammar = Constraint(syntax, definition, name)
        elif kind == "text":
            f.only(frozenset({"type"}))
        else:
            raise f.fail("type", "'format.type' must be 'text' or 'grammar'.")
    parameters = {
        "type": "object",
        "properties": {"input": {"type": "string", "description": about}},
        "required": ["input"],
    }
    tools.append(Tool(flat, description, parameters, freeform=True, grammar=grammar))
    return Mapped(flat, name, namespace, space, fmt, description)


def _namespace(t: Reader, tools: list[Tool]) -> list[Mapped]:
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
    made: list[Mapped] = []
    for index, raw in enumerate(inner):
        f = t.child_at("tools", index, raw)
        kind = f.obj.get("type")
        if kind == "custom":
            made.append(_custom(f, tools, namespace, description))
            continue
        if kind != "function":
            raise f.fail("type", "A namespace's tools must be 'function' or 'custom'.")
        f.required("name")
        name = f.string("name", max_chars=64)
        flat = f"{namespace}{NAMESPACE_SEPARATOR}{name}"
        tools.append(_function(f, tools, flat))
        made.append(Mapped(flat, name, namespace, description))
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
    if kind not in ("function", "custom"):
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
        inner = [m.flat for m in toolset.mapped if m.name == name]
        if len(inner) == 1:
            return inner[0]
    return name


def tools_echo(tools: tuple[Tool, ...], mapped: tuple[Mapped, ...]) -> list[JSON]:
    """The ``tools`` of a ``Response``, as the client declared them: functions, custom
    tools, and a namespace's gathered again."""
    by_flat = {m.flat: m for m in mapped}
    echoed: list[JSON] = []
    spaces: dict[str, JSON] = {}
    for tool, shown in zip(tools, tools_json(tools), strict=True):
        m = by_flat.get(tool.name)
        if m is None:
            echoed.append({**shown, "strict": tool.strict})
            continue
        if m.custom_format is not None:
            declared: JSON = {
                "type": "custom",
                "name": m.name,
                "description": m.description,
                "format": m.custom_format,
            }
        else:
            declared = {**shown, "name": m.name, "strict": tool.strict}
        if not m.namespace:
            echoed.append(declared)
            continue
        space = spaces.get(m.namespace)
        if space is None:
            space = spaces[m.namespace] = {
                "type": "namespace",
                "name": m.namespace,
                "description": m.namespace_description,
                "tools": [],
            }
            echoed.append(space)
        space["tools"].append(declared)
    return echoed


_INPUT_KEY = re.compile(r'\s*\{\s*"input"\s*:\s*"')
_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}
_MAX_OPENING = 64  # arguments that do not open with {"input": " within this: not streamed


class InputDecoder:
    """A custom tool call's input as its JSON arguments arrive: :meth:`feed` each piece,
    get the text it adds (so that the input streams as it comes). Linear in the input:
    only an escape cut in two is held back between pieces."""

    __slots__ = ("_done", "_pending", "_started")

    def __init__(self) -> None:
        self._pending = ""
        self._started = False
        self._done = False  # the closing quote, or arguments of another form

    def feed(self, piece: str) -> str:
        if self._done:
            return ""
        pending = self._pending + piece
        if not self._started:
            opening = _INPUT_KEY.match(pending)
            if opening is None:
                self._pending = pending
                self._done = len(pending) > _MAX_OPENING
                return ""
            self._started = True
            pending = pending[opening.end() :]
        out: list[str] = []
        i, end = 0, len(pending)
        while i < end:
            ch = pending[i]
            if ch == '"':
                self._done = True
                break
            if ch != "\\":
                j = i + 1
                while j < end and pending[j] not in '"\\':
                    j += 1
                out.append(pending[i:j])
                i = j
                continue
            decoded, used = _escape(pending, i)
            if used == 0:  # cut in two: wait for the rest
                break
            out.append(decoded)
            i += used
        self._pending = "" if self._done else pending[i:]
        return "".join(out)


def _escape(text: str, i: int) -> tuple[str, int]:
    """The escape at ``text[i]`` (a backslash): its text and length, or ("", 0) if it is
    not whole yet (or not JSON: freeform_input() gives the raw arguments at the end)."""
    if i + 1 >= len(text):
        return "", 0
    kind = text[i + 1]
    if kind != "u":
        return _ESCAPES.get(kind, kind), 2
    try:
        if i + 6 > len(text):
            return "", 0
        code = int(text[i + 2 : i + 6], 16)
        if 0xD800 <= code < 0xDC00:  # a surrogate pair: wait for its second half
            if i + 12 > len(text):
                return "", 0
            low = int(text[i + 8 : i + 12], 16)
            return chr(0x10000 + ((code - 0xD800) << 10) + (low - 0xDC00)), 12
        return chr(code), 6
    except ValueError:
        return "", 0
