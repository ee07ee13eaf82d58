"""The Responses request maps onto the shared request fields (``generation.protocol``) under its own names,
so the pipeline's checks name the field the client sent with no renaming; the error bodies pinned here are
those the API has always given. The server-level walk is ``test_responses.py``'s."""

from __future__ import annotations

import pytest

pytest.importorskip("pydantic")  # absent on some hosts (the GPU host has no package index)

from rawpaged.entrypoints.generation.protocol import GenerationRequest
from rawpaged.entrypoints.generation.request_body import parse_request
from rawpaged.entrypoints.http.errors import ProtocolError
from rawpaged.entrypoints.openai.responses.protocol import ResponsesRequest
from rawpaged.entrypoints.server.config import Limits

LIMITS = Limits(max_tokens=1000)
TOOL = {"type": "function", "name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}}
HISTORY = [{"role": "user", "content": "h"}, {"role": "assistant", "content": "a"}]
ROLES = "'system', 'developer', 'user', 'assistant' or 'tool'"


def started(body: dict, history: list = ()) -> tuple:
    req = parse_request(ResponsesRequest, body, LIMITS)
    return req, req.start(list(history), LIMITS)


TOOL_MESSAGE = {"role": "tool", "content": "x"}
REFUSALS = [  # (body, history, param, message)
    ({"input": "Hi", "temperature": -1}, [], "temperature", "temperature must be a number in [0, 100], got -1.0"),
    (
        {"input": "Hi", "max_output_tokens": 0},
        [],
        "max_output_tokens",
        "max_output_tokens must be an integer >= 1, got 0",
    ),
    (
        {"input": "Hi", "max_output_tokens": 5000},
        [],
        "max_output_tokens",
        "max_output_tokens is 5000; this server allows at most 1000",
    ),
    ({"input": 5, "temperature": "hot"}, [], "input", "input: Input should be a valid string, got 5"),
    (
        {"input": [{"role": "bogus", "content": "x"}]},
        HISTORY,
        "input",
        f'input.2.role: Input should be {ROLES}, got "bogus"',
    ),
    (
        {"input": [{"type": "reasoning"}]},
        [],
        "input",
        "input must be a non-empty list of {role, content} objects, got []",
    ),
    (
        {"input": [TOOL_MESSAGE]},
        [],
        "input",
        'input.0: Value error, a tool message needs the tool_call_id it answers, got {"role": "tool", "content": "x"}',
    ),
    ({"input": "Hi", "tools": [TOOL, TOOL]}, [], "tools", "function names in tools must be unique; ['f'] repeat"),
    ({"input": "Hi", "tool_choice": "required"}, [], "tool_choice", "tool_choice is only allowed when tools are given"),
]


@pytest.mark.parametrize("body, history, param, message", REFUSALS)
def test_refusals_name_the_responses_field(body, history, param, message):
    with pytest.raises(ProtocolError) as e:
        started(body, history)
    assert (e.value.message, e.value.param, e.value.status) == (message, param, 400)


def test_the_request_is_a_generation_request_of_its_own_fields():
    req, conversation = started(
        {
            "input": "Hi",
            "instructions": "Be brief.",
            "max_output_tokens": 7,
            "top_logprobs": 2,
            "include": ["message.output_text.logprobs"],
            "tools": [TOOL],
            "tool_choice": {"type": "function", "name": "f"},
            "n": 3,  # not a Responses field: not read
            "top_k": 5,
        },
        HISTORY,
    )
    assert isinstance(req, GenerationRequest)
    assert (req.kind, req.prompt_param, req.max_tokens_param, req.requested_max_tokens) == (
        "chat",
        "input",
        "max_output_tokens",
        7,
    )
    assert req.num_choices == 1 and req.top_k is None and req.num_logprobs == 2
    assert [m["role"] for m in req.template_messages()] == ["system", "user", "assistant", "user"]
    assert conversation == [*HISTORY, {"role": "user", "content": "Hi"}]  # without the instructions
    assert req.template_tools() == [{"type": "function", "function": {"name": "f", "parameters": TOOL["parameters"]}}]
    assert req.tool_mode == "named" and req.structured_outputs_fields() is not None
    params = req.sampling_params(7)
    assert params.n == 1 and params.logprobs == 2 and params.max_tokens == 7
