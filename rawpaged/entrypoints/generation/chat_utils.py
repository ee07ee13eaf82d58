"""A conversation as the model's chat template takes it, with tools (vLLM's ``entrypoints/chat_utils``).

A template that reads ``tools`` (Qwen2.5, Llama 3.1, Mistral, ...) renders them, the calls of assistant
messages and the ``tool`` answers itself. For one that does not (SmolLM2's), the tools go into the system
message, described in the Hermes call format the ``"auto"`` parser reads; past calls are written in that
format into their assistant messages, and ``tool`` answers become user messages in ``<tool_response>``
blocks, so that templates which accept only system/user/assistant turns still render the conversation.
"""

from __future__ import annotations

import json

from rawpaged.entrypoints.generation.tool_parsers.hermes_tool_parser import CLOSE, OPEN

TOOLS_PROMPT = """# Tools

You can call functions to answer the user. Their signatures, as JSON, are between <tools> and </tools>:
<tools>
{tools}
</tools>

To call a function, write a JSON object with its name and its arguments between {open} and {close}:
{open}
{{"name": <function name>, "arguments": <arguments as a JSON object>}}
{close}"""


def tools_system_prompt(tools: list) -> str:
    """The system-message text describing ``tools`` (OpenAI's tool dicts) for a template without them."""
    listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return TOOLS_PROMPT.format(tools=listing, open=OPEN, close=CLOSE)


def template_message(message) -> dict:
    """A ``protocol.ChatMessage`` as chat templates take it (HF transformers' form): text parts joined,
    "developer" as "system", and each call's ``arguments`` as an object where its JSON text is one
    (templates write them with ``tojson``)."""
    content = message.content or ""
    if isinstance(content, list):
        content = "".join(p.text for p in content)
    msg = {"role": "system" if message.role == "developer" else message.role, "content": content}
    if message.tool_calls:
        msg["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": _arguments(c)}}
            for c in message.tool_calls
        ]
    for key in ("tool_call_id", "name"):
        if getattr(message, key) is not None:
            msg[key] = getattr(message, key)
    return msg


def _arguments(call):
    """A call's ``arguments``: its JSON text as an object, or the text where it is not one."""
    try:
        value = json.loads(call.function.arguments)
    except ValueError:
        return call.function.arguments
    return value if isinstance(value, dict) else call.function.arguments


def template_conversation(messages: list, tools: list | None, template_supports_tools: bool) -> tuple:
    """``(messages, tools)`` to render: unchanged where the template renders tools (or none are given),
    else the tools written into the messages (see the module) and None.

    Args:
        messages: HF-style message dicts (``template_message``).
        tools: OpenAI tool dicts, or None.
        template_supports_tools: ``Tokenizer.supports_tools``.
    """
    if not tools or template_supports_tools:
        return messages, tools
    prompt = tools_system_prompt(tools)
    if messages[0]["role"] == "system":
        out = [{**messages[0], "content": messages[0]["content"] + "\n\n" + prompt}]
        messages = messages[1:]
    else:
        out = [{"role": "system", "content": prompt}]
    answers = None  # the user message gathering consecutive tool answers
    for m in messages:
        if m["role"] == "tool":
            block = f"<tool_response>\n{m['content']}\n</tool_response>"
            if answers is None:
                answers = {"role": "user", "content": block}
                out.append(answers)
            else:
                answers["content"] += "\n" + block
            continue
        answers = None
        if m["role"] == "assistant" and m.get("tool_calls"):
            calls = [f"{OPEN}\n{_call_json(c['function'])}\n{CLOSE}" for c in m["tool_calls"]]
            text = "\n".join(([m["content"]] if m["content"] else []) + calls)
            out.append({"role": "assistant", "content": text})
        else:
            out.append(m)
    return out, None


def _call_json(function: dict) -> str:
    return json.dumps({"name": function["name"], "arguments": function["arguments"]}, ensure_ascii=False)
