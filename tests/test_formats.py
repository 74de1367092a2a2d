"""Unit tests for tokenmill.prepare.formats: every format, every reason code, turn selection, ids."""

# Tables of records read best with one record per line.
# ruff: noqa: E501

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tokenmill.prepare import formats
from tokenmill.prepare.formats import (
    RecordError,
    prompt_id,
    select_turns,
    to_conversation,
    to_prompts,
)
from tokenmill.prepare.hooks import load_hook

U = {"role": "user", "content": "hi"}


def reason_of(record, fmt, **kw) -> str:
    with pytest.raises(RecordError) as info:
        to_conversation(record, fmt, **kw)
    assert info.value.reason in formats.REASONS
    return info.value.reason


# ---------------------------------------------------------------------------------------------
# prompt_id


def test_prompt_id_is_pinned():
    # Hard-coded once: a change of the canonical form (and so of every prompt_id) fails here.
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello, world"}]
    assert prompt_id(msgs, None) == "229d8f1f4b87b50db663ed51be54f049"
    tools = [
        {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
    ]
    assert prompt_id([{"role": "user", "content": "Time?"}], tools) == (
        "139c4b6e65d8fac32f88fa8f04329816"
    )


def test_prompt_id_ignores_key_order_but_not_content():
    a = prompt_id([{"role": "user", "content": "x"}], None)
    assert a == prompt_id([{"content": "x", "role": "user"}], None)
    assert a != prompt_id([{"role": "user", "content": "x "}], None)
    assert a != prompt_id([{"role": "user", "content": "x"}], [])
    assert len(a) == 32


# ---------------------------------------------------------------------------------------------
# messages


def test_messages_canonical_shape_and_tools_as_string():
    tools = [{"type": "function", "function": {"name": "f", "parameters": '{"type":"object"}'}}]
    record = {
        "messages": [
            {
                "role": "user",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            },
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "c1",
                        "type": "function",
                        "function": {"name": "f", "arguments": '{"x": 1}'},
                    }
                ],
                "reasoning_content": "dropped",
            },
            {"role": "tool", "tool_call_id": "c1", "name": "f", "content": "42", "extra": 1},
            {"role": "assistant", "content": "done"},
        ],
        "tools": json.dumps(tools),
    }
    messages, out_tools = to_conversation(record, "messages")
    assert messages[0] == {"role": "user", "content": "a\nb"}
    assert messages[1] == {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"x": 1}}}
        ],
    }
    assert messages[2] == {"role": "tool", "content": "42", "name": "f", "tool_call_id": "c1"}
    assert out_tools == [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    ]


def test_messages_as_json_string_and_bare_tools():
    record = {"messages": json.dumps([U]), "tools": [{"name": "g", "description": "d"}]}
    messages, tools = to_conversation(record, "messages")
    assert messages == [U]
    assert tools == [{"type": "function", "function": {"name": "g", "description": "d"}}]
    assert to_conversation({"messages": [U], "tools": []}, "messages")[1] is None


@pytest.mark.parametrize(
    "record, reason",
    [
        ({"conversation": [U]}, "missing_field"),
        ({"messages": "[not json"}, "unparseable"),
        ({"messages": []}, "empty_conversation"),
        ({"messages": [{"content": "x"}]}, "missing_field"),
        ({"messages": [{"role": "user"}]}, "missing_field"),
        ({"messages": [{"role": "bot", "content": "x"}]}, "unknown_role"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, "unsupported_content"),
        ({"messages": [{"role": "system", "content": "s"}]}, "no_user_turn"),
        ({"messages": [U, {"role": "system", "content": "s"}]}, "roles_out_of_order"),
        ({"messages": [{"role": "system", "content": "a"}, {"role": "system", "content": "b"}, U]}, "roles_out_of_order"),
        ({"messages": [{"role": "assistant", "content": "a"}, U]}, "roles_out_of_order"),
        ({"messages": [U, {"role": "tool", "content": "t"}]}, "roles_out_of_order"),
        ({"messages": [U, {"role": "assistant", "content": "a"}, {"role": "tool", "content": "t"}]}, "roles_out_of_order"),
        ({"messages": [U, {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f", "arguments": "{x"}}]}]}, "invalid_tool_json"),
        ({"messages": [U, {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f", "arguments": "[1]"}}]}]}, "invalid_tool_json"),
        ({"messages": [U], "tools": "{not json"}, "invalid_tool_json"),
        ({"messages": [U], "tools": [{"description": "no name"}]}, "invalid_tool_json"),
    ],
)  # fmt: skip
def test_messages_rejections(record, reason):
    assert reason_of(record, "messages") == reason


# ---------------------------------------------------------------------------------------------
# sharegpt


def test_sharegpt_with_system_tools_and_function_calls():
    record = {
        "system": "Be nice.",
        "tools": json.dumps([{"name": "w", "description": "weather", "parameters": {}}]),
        "conversations": [
            {"from": "human", "value": "weather?"},
            {"from": "function_call", "value": '{"name": "w", "arguments": {"city": "Rome"}}'},
            {"from": "observation", "value": "sunny"},
            {"from": "gpt", "value": "It is sunny."},
            {"from": "user", "value": "thanks"},
            {"from": "assistant", "value": "welcome"},
        ],
    }
    messages, tools = to_conversation(record, "sharegpt")
    assert [m["role"] for m in messages] == [
        "system",
        "user",
        "assistant",
        "tool",
        "assistant",
        "user",
        "assistant",
    ]
    assert messages[0]["content"] == "Be nice."
    assert messages[2]["tool_calls"] == [
        {"type": "function", "function": {"name": "w", "arguments": {"city": "Rome"}}}
    ]
    assert tools[0]["function"]["name"] == "w"


@pytest.mark.parametrize(
    "record, reason",
    [
        ({"messages": []}, "missing_field"),
        ({"conversations": []}, "empty_conversation"),
        ({"conversations": [{"from": "bot", "value": "x"}]}, "unknown_role"),
        ({"conversations": [{"value": "x"}]}, "missing_field"),
        ({"conversations": [{"from": "human"}]}, "missing_field"),
        ({"conversations": [{"from": "human", "value": "q"}, {"from": "function_call", "value": "{bad"}]}, "invalid_tool_json"),
        ({"conversations": [{"from": "human", "value": "q"}, {"from": "observation", "value": "r"}]}, "roles_out_of_order"),
        ({"system": "s", "conversations": [{"from": "system", "value": "t"}, {"from": "human", "value": "q"}]}, "roles_out_of_order"),
        ({"conversations": [{"from": "gpt", "value": "a"}]}, "no_user_turn"),
    ],
)  # fmt: skip
def test_sharegpt_rejections(record, reason):
    assert reason_of(record, "sharegpt") == reason


# ---------------------------------------------------------------------------------------------
# glaive

GLAIVE_SYSTEM = (
    "SYSTEM: You are a helpful assistant with access to the following functions. "
    "Use them if required -\n"
    + json.dumps({"name": "get_rate", "description": "FX rate", "parameters": {"type": "object"}}, indent=4)
    + "\n\n"
    + json.dumps({"name": "tip", "description": "Tip", "parameters": {"type": "object"}}, indent=4)
    + "\n\n\n"
)  # fmt: skip
GLAIVE_CHAT = (
    "USER: Rate from USD to EUR?\n\n\n"
    "ASSISTANT: <functioncall> {\"name\": \"get_rate\", \"arguments\": '{\"base\": \"USD\", \"to\": \"EUR\"}'} "
    "<|endoftext|>\n\n\n"
    "FUNCTION RESPONSE: {\"rate\": 0.9}\n\n\n"
    "ASSISTANT: It is 0.9. <|endoftext|>\n\n\n"
)  # fmt: skip


def test_glaive_real_layout():
    messages, tools = to_conversation({"system": GLAIVE_SYSTEM, "chat": GLAIVE_CHAT}, "glaive")
    assert messages == [
        {
            "role": "system",
            "content": "You are a helpful assistant with access to the following functions. "
            "Use them if required -",
        },
        {"role": "user", "content": "Rate from USD to EUR?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"type": "function", "function": {"name": "get_rate", "arguments": {"base": "USD", "to": "EUR"}}}
            ],
        },
        {"role": "tool", "content": '{"rate": 0.9}'},
        {"role": "assistant", "content": "It is 0.9."},
    ]  # fmt: skip
    assert [t["function"]["name"] for t in tools] == ["get_rate", "tip"]


def test_glaive_without_functions_and_call_quirks():
    system = "SYSTEM: You are a helpful assistant, with no access to external functions.\n\n\n"
    messages, tools = to_conversation(
        {"system": system, "chat": "USER: Hi\n\n\nASSISTANT: Hello <|endoftext|>"}, "glaive"
    )
    assert tools is None
    assert messages[0]["content"].startswith("You are a helpful assistant, with no access")
    # arguments as a real object, and with escaped single quotes inside the quoted string
    assert formats.parse_glaive_call('{"name": "f", "arguments": {"a": 1}}')["function"][
        "arguments"
    ] == {"a": 1}
    call = formats.parse_glaive_call(
        '{"name": "f", "arguments": \'{"q": "it\\\'s"}\'} <|endoftext|>'
    )
    assert call["function"] == {"name": "f", "arguments": {"q": "it's"}}


@pytest.mark.parametrize(
    "record, reason",
    [
        ({"system": GLAIVE_SYSTEM}, "missing_field"),
        ({"system": GLAIVE_SYSTEM, "chat": ""}, "empty_conversation"),
        ({"system": GLAIVE_SYSTEM, "chat": "USER: x\n\n\nASSISTANT: <functioncall> {\"name\": \"f\", \"arguments\": '{\"a\": '} <|endoftext|>"}, "invalid_tool_json"),
        ({"system": GLAIVE_SYSTEM, "chat": "USER: x\n\n\nASSISTANT: <functioncall> {name: f} <|endoftext|>"}, "invalid_tool_json"),
        ({"system": "SYSTEM: Use these -\n{\"name\": \"f\", broken", "chat": "USER: x"}, "invalid_tool_json"),
        ({"system": GLAIVE_SYSTEM, "chat": "FUNCTION RESPONSE: {}\n\n\nUSER: x"}, "roles_out_of_order"),
        ({"system": GLAIVE_SYSTEM, "chat": "hello USER: x"}, "unparseable"),
        ({"system": GLAIVE_SYSTEM, "chat": "ASSISTANT: hi <|endoftext|>"}, "no_user_turn"),
    ],
)  # fmt: skip
def test_glaive_rejections(record, reason):
    assert reason_of(record, "glaive") == reason


# ---------------------------------------------------------------------------------------------
# instruction


def test_instruction_columns_and_input():
    rec = {"instruction": "Sum these.", "input": "1 2", "output": "3", "system": "Be exact."}
    messages, tools = to_conversation(rec, "instruction")
    assert messages == [
        {"role": "system", "content": "Be exact."},
        {"role": "user", "content": "Sum these.\n\n1 2"},
    ]
    assert tools is None
    rec = {"q": "Say hi.", "ctx": "", "sys": "S"}
    opts = {"instruction": "q", "input": "ctx", "system": "sys", "output": "a"}
    assert to_conversation(rec, "instruction", options=opts)[0] == [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "Say hi."},
    ]


@pytest.mark.parametrize(
    "record, reason",
    [
        ({"input": "x", "output": "y"}, "missing_field"),
        ({"instruction": "   "}, "missing_field"),
        ({"instruction": "x", "input": ["a"]}, "unsupported_content"),
    ],
)
def test_instruction_rejections(record, reason):
    assert reason_of(record, "instruction") == reason


# ---------------------------------------------------------------------------------------------
# hook


def test_hook_list_dict_and_errors(monkeypatch):
    # sample/hooks.py is imported as prepare does it: the repo root on sys.path.
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent.parent))
    qa_to_messages = load_hook("sample.hooks:qa_to_messages")
    with_tools = load_hook("sample.hooks:with_tools")

    msgs, tools = to_conversation({"question": "q", "answer": "a"}, "hook", hook=qa_to_messages)
    assert msgs == [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    assert tools is None
    msgs, tools = to_conversation({"ask": "t?", "tool": "clock"}, "hook", hook=with_tools)
    assert tools == [{"type": "function", "function": {"name": "clock"}}]

    with pytest.raises(RecordError) as info:
        to_conversation({"answer": "a"}, "hook", hook=qa_to_messages)
    assert info.value.reason == "hook_error" and "KeyError" in info.value.detail
    assert reason_of({}, "hook", hook=lambda r: "text") == "hook_error"
    assert reason_of({}, "hook", hook=lambda r: {"tools": []}) == "hook_error"
    # a well-formed return with a bad role keeps the specific code
    assert reason_of({}, "hook", hook=lambda r: [{"role": "x", "content": "c"}]) == "unknown_role"


# ---------------------------------------------------------------------------------------------
# turn selection

SYS = {"role": "system", "content": "s"}
A1 = {"role": "assistant", "content": "a1"}
CALL = {
    "role": "assistant",
    "content": "",
    "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": {}}}],
}
TOOL = {"role": "tool", "content": "r"}
U2 = {"role": "user", "content": "again"}
A2 = {"role": "assistant", "content": "a2"}


def test_turns_last():
    conv = [SYS, U, A1, U2, A2]
    assert select_turns(conv, "last") == [[SYS, U, A1, U2]]
    assert select_turns([U, CALL, TOOL, A2], "last") == [[U, CALL, TOOL]]
    assert select_turns([U, A1, U2], "last") == [[U, A1, U2]]  # no final assistant: whole
    assert select_turns([U, A1, A2], "last") == [[U]]


def test_turns_first_and_all():
    conv = [SYS, U, A1, U2, CALL, TOOL, A2]
    assert select_turns(conv, "first") == [[SYS, U]]
    assert select_turns([U], "first") == [[U]]
    assert select_turns(conv, "all") == [[SYS, U], [SYS, U, A1, U2], [SYS, U, A1, U2, CALL, TOOL]]
    assert select_turns([U], "all") == [[U]]
    with pytest.raises(ValueError):
        select_turns(conv, "middle")


def test_to_prompts_ids_match_prompt_messages():
    rec = {"messages": [U, A1, U2, A2]}
    out = to_prompts(rec, "messages", turns="all")
    assert [p[1] for p in out] == [[U], [U, A1, U2]]
    assert all(pid == prompt_id(msgs, tools) for pid, msgs, tools in out)
