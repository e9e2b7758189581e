"""Tool calling for chat: OpenAI's `tools` and `tool_choice`, the prompt that shows the tools to the model, the
grammar that makes every call parse (an xgrammar structural tag, compiled like any other constraint), and the
parsers that read calls back out of the model's text, whole or as it streams.

Formats, by what the served model's chat template knows (`tool_format`):
- "llama" (Llama 3.x: the template speaks of `ipython` or `<|python_tag|>`): a call is
  `{"name": "f", "parameters": {...}}`.
- "hermes" (Qwen2 / Qwen2.5 / Qwen3 and any template that mentions `<tool_call>`): a call is
  `<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>`. Qwen3's thinking is turned off for calls.
- a template that ignores `tools` (SmolLM2's) gets the hermes format, the nearest to its ChatML turns: the tools
  go into a system message written as Qwen2.5's template writes them, earlier calls into the assistant's text
  and tool results into user turns inside `<tool_response>` tags.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from specserve.core import Constraint


class ToolError(ValueError):
    """A request's tools or tool_choice that cannot be served; `param` names the field at fault."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ToolFormat:
    name: str  # "llama" or "hermes"
    native: bool  # the chat template renders `tools` itself
    thinks: bool = False  # Qwen3-style <think> template

    @property
    def xgrammar_model(self) -> str:
        return "llama" if self.name == "llama" else "qwen_3"


def tool_format(tokenizer) -> ToolFormat:
    """The served model's tool-call syntax, read from its chat template."""
    template = getattr(tokenizer, "chat_template", None) or ""
    if isinstance(template, dict):
        template = " ".join(template.values())
    if "<|python_tag|>" in template or "ipython" in template:
        return ToolFormat("llama", native=True)
    if "<tool_call>" in template:
        return ToolFormat("hermes", native=True, thinks="<think>" in template)
    return ToolFormat("hermes", native=False)


# -- the request ------------------------------------------------------------------
def checked_tools(tools, tool_choice) -> tuple[list[dict], str | dict]:
    """The tools in OpenAI's shape and the tool choice ("none", "auto", "required" or a named function);
    ToolError for anything else."""
    if tools is None:
        tools = []
    names = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise ToolError(f'tools[{i}] must be {{"type": "function", "function": {{"name": ..., '
                            f'"parameters": {{...}}}}}}', param="tools")
        function = tool["function"]
        name = function.get("name")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.\-]{1,64}", name):
            raise ToolError(f"tools[{i}].function.name must be 1 to 64 letters, digits, '_', '.' or '-', "
                            f"got {name!r}", param="tools")
        if name in names:
            raise ToolError(f"tools[{i}]: two tools are named {name!r}", param="tools")
        names.append(name)
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise ToolError(f"tools[{i}].function.parameters must be a JSON schema object", param="tools")
    if tool_choice is None:
        tool_choice = "auto" if tools else "none"
    if isinstance(tool_choice, str):
        if tool_choice not in ("none", "auto", "required"):
            raise ToolError(f'tool_choice must be "none", "auto", "required" or {{"type": "function", "function": '
                            f'{{"name": ...}}}}, got {tool_choice!r}', param="tool_choice")
        if tool_choice != "none" and not tools:
            raise ToolError(f'tool_choice "{tool_choice}" needs tools', param="tool_choice")
        return tools, tool_choice
    function = tool_choice.get("function") if tool_choice.get("type") == "function" else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise ToolError('a named tool_choice is {"type": "function", "function": {"name": ...}}',
                        param="tool_choice")
    if name not in names:
        raise ToolError(f"tool_choice names {name!r}, which is not among the tools", param="tool_choice")
    return tools, {"type": "function", "function": {"name": name}}


def tool_constraint(tools: list[dict], tool_choice, fmt: ToolFormat, parallel: bool = True) -> Constraint | None:
    """The grammar of the reply: free text or calls ("auto"), at least one call ("required"), exactly the named
    function's call; None for "none"."""
    if tool_choice == "none":
        return None
    import xgrammar

    options = {"reasoning": "disabled"} if fmt.xgrammar_model == "qwen_3" else {}
    try:
        tag = xgrammar.get_model_structural_tag(fmt.xgrammar_model, tools=tools, tool_choice=tool_choice,
                                                parallel_tool_calls=parallel, max_whitespace_cnt=2, **options)
    except Exception as e:  # pydantic's ValidationError, ValueError: the tools are not what xgrammar reads
        raise ToolError(f"tools: {str(e).strip().splitlines()[0][:500]}", param="tools") from None
    return Constraint("structural_tag", tag.model_dump_json())


def template_messages(messages: list[dict], fmt: ToolFormat) -> list[dict]:
    """The conversation as the chat template is given it. Native templates get assistant `tool_calls` with
    arguments as objects (Llama's and Qwen's templates write them with `tojson`) and `tool` messages; the
    others get calls written into the assistant's text and results as user turns."""
    out = []
    for i, m in enumerate(messages):
        calls = m.get("tool_calls")
        if calls:
            parsed = []
            for j, call in enumerate(calls):
                function = call.get("function") if isinstance(call, dict) else None
                if not isinstance(function, dict) or not isinstance(function.get("name"), str):
                    raise ToolError(f"messages[{i}].tool_calls[{j}] needs function.name", param="messages")
                arguments = function.get("arguments", "{}")
                if isinstance(arguments, str):
                    try:
                        arguments = json.loads(arguments or "{}")
                    except json.JSONDecodeError:
                        raise ToolError(f"messages[{i}].tool_calls[{j}].function.arguments is not JSON",
                                        param="messages") from None
                parsed.append({"id": call.get("id"), "type": "function",
                               "function": {"name": function["name"], "arguments": arguments}})
            if fmt.native:
                out.append({"role": "assistant", "content": m.get("content") or "", "tool_calls": parsed})
            else:
                text = "\n".join(_hermes_call(c["function"]["name"], c["function"]["arguments"]) for c in parsed)
                content = m.get("content") or ""
                out.append({"role": "assistant", "content": f"{content}\n{text}" if content else text})
        elif m["role"] == "tool":
            before = messages[i - 1] if i else {}
            if not (before.get("tool_calls") or before.get("role") == "tool"):
                raise ToolError(f"messages[{i}]: a tool message answers a preceding assistant message with "
                                "tool_calls", param="messages")
            if fmt.native:
                tool = {"role": "tool", "content": m["content"]}
                if m.get("tool_call_id"):
                    tool["tool_call_id"] = m["tool_call_id"]
                out.append(tool)
            else:
                out.append({"role": "user", "content": f"<tool_response>\n{m['content']}\n</tool_response>"})
        else:
            out.append({"role": m["role"], "content": m["content"]})
    return out


def system_prompt(tools: list[dict]) -> str:
    """The tools' description for a template that ignores `tools`, as Qwen2.5's template words it."""
    listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
            f"{listed}\n</tools>\n\nFor each function call, return a json object with function name and arguments "
            "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
            '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')


def with_tool_system_prompt(messages: list[dict], tools: list[dict]) -> list[dict]:
    prompt = system_prompt(tools)
    if messages and messages[0]["role"] == "system":
        return [{"role": "system", "content": f"{messages[0]['content']}\n\n{prompt}"}, *messages[1:]]
    return [{"role": "system", "content": prompt}, *messages]


def _hermes_call(name: str, arguments) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False) + "\n</tool_call>"


# -- the reply --------------------------------------------------------------------
@dataclass
class ParsedCall:
    name: str
    arguments: str  # the arguments' JSON text as the model wrote it (so far, while it streams)
    closed: bool


_HERMES_START = "<tool_call>"
_HERMES_END = "</tool_call>"
_HERMES_HEAD = re.compile(r'<tool_call>\s*\{\s*"name"\s*:\s*"([^"]*)"\s*,\s*"arguments"\s*:\s*')
_LLAMA_START = '{"name": '
_LLAMA_HEAD = re.compile(r'\{"name":\s*"([^"]*)"\s*,\s*"(?:parameters|arguments)"\s*:\s*')


def parse(text: str, fmt: ToolFormat, final: bool) -> tuple[str, list[ParsedCall]]:
    """(the text outside calls, the calls) of the reply so far. While it streams (final False), text that may
    be the start of a call is held back and a call's arguments stop short of what may be its closing, so each
    later parse extends the earlier one."""
    start = _HERMES_START if fmt.name == "hermes" else _LLAMA_START
    content, calls, pos = [], [], 0
    while True:
        at = text.find(start, pos)
        if at < 0:
            tail = text[pos:]
            if not final:
                tail = tail[:len(tail) - _partial_suffix(tail, start)]
            content.append(tail)
            break
        content.append(text[pos:at])
        call, end = (_hermes_call_at if fmt.name == "hermes" else _llama_call_at)(text, at, final)
        if call is None:  # the head is not complete yet (or never was: then it is text)
            if final:
                content.append(text[at:])
            break
        calls.append(call)
        if not call.closed:
            break
        pos = end
    return "".join(content), calls


def _partial_suffix(text: str, start: str) -> int:
    """The length of the longest end of `text` that begins `start`."""
    for n in range(min(len(start) - 1, len(text)), 0, -1):
        if start.startswith(text[-n:]):
            return n
    return 0


def _hermes_call_at(text: str, at: int, final: bool) -> tuple[ParsedCall | None, int]:
    head = _HERMES_HEAD.match(text, at)
    if head is None:
        return None, at
    end = text.find(_HERMES_END, head.end())
    if end >= 0:
        body = text[head.end():end].rstrip()
        return ParsedCall(head.group(1), body[:-1].strip() if body.endswith("}") else body.strip(), True), \
            end + len(_HERMES_END)
    body = text[head.end():]
    if not final:
        body = body[:max(0, len(body) - len("}\n" + _HERMES_END))]
    return ParsedCall(head.group(1), body.strip(), False), len(text)


def _llama_call_at(text: str, at: int, final: bool) -> tuple[ParsedCall | None, int]:
    head = _LLAMA_HEAD.match(text, at)
    if head is None:
        return None, at
    try:
        _, args_end = json.JSONDecoder().raw_decode(text, head.end())
    except json.JSONDecodeError:
        body = text[head.end():]
        if not final:
            body = body[:max(0, len(body) - 1)]
        return ParsedCall(head.group(1), body.strip(), False), len(text)
    rest = text[args_end:]
    closed = rest.lstrip().startswith("}")
    end = args_end + (len(rest) - len(rest.lstrip()) + 1 if closed else 0)
    return ParsedCall(head.group(1), text[head.end():args_end].strip(), closed), end if closed else len(text)


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def message_of(text: str, fmt: ToolFormat, finish: str | None) -> tuple[dict, str | None]:
    """The assistant message for a whole reply, and its finish reason ("tool_calls" when it calls)."""
    content, calls = parse(text, fmt, final=True)
    if not calls:
        return {"role": "assistant", "content": text}, finish
    content = content if content.strip() else None
    tool_calls = [{"id": call_id(), "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                  for c in calls]
    return {"role": "assistant", "content": content, "tool_calls": tool_calls}, \
        ("tool_calls" if finish == "stop" else finish)


class ToolStream:
    """One choice's streamed reply: turns the text so far into content and tool_calls deltas."""

    def __init__(self, fmt: ToolFormat) -> None:
        self.fmt = fmt
        self.text = ""
        self.sent_content = ""
        self.sent = []  # per call: [id, arguments sent]

    def feed(self, piece: str, final: bool) -> tuple[str, list[dict]]:
        """(content delta, tool_calls deltas) for the new piece of text."""
        self.text += piece
        content, calls = parse(self.text, self.fmt, final)
        deltas = []
        for i, call in enumerate(calls):
            if i == len(self.sent):
                self.sent.append([call_id(), ""])
                deltas.append({"index": i, "id": self.sent[i][0], "type": "function",
                               "function": {"name": call.name, "arguments": ""}})
            done = self.sent[i][1]
            if call.arguments.startswith(done) and len(call.arguments) > len(done):
                deltas.append({"index": i, "function": {"arguments": call.arguments[len(done):]}})
                self.sent[i][1] = call.arguments
        text = ""
        # Text of only whitespace waits: beside calls it is no content (message_of), alone it is the reply.
        if content.startswith(self.sent_content) and (content.strip() or (final and not calls)):
            text = content[len(self.sent_content):]
            self.sent_content = content
        return text, deltas

    @property
    def called(self) -> bool:
        return bool(self.sent)
