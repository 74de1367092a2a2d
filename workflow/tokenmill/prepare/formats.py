"""Record layouts -> OpenAI-style conversations, validation, turn selection and prompt ids.

Every format maps one record to `(messages, tools)` in one canonical shape:

    {"role": "system" | "user" | "assistant" | "tool", "content": str}
    assistant turns may add "tool_calls": [{"type": "function",
        "function": {"name": str, "arguments": dict}, "id"?: str}]
        (arguments are parsed to a dict: Hugging Face chat templates expect mappings)
    tool turns may add "name" and "tool_call_id"
    tools: [{"type": "function", "function": {"name", "description"?, "parameters"?}}] or None

Formats:
  messages     {"messages": [...], "tools"?: list or JSON string}; content may be a list of
               parts, whose text parts are joined with newlines (non-text parts are rejected).
  sharegpt     {"conversations": [{"from", "value"}], "system"?, "tools"?} in LLaMA-Factory's
               layout: human/user, gpt/assistant, system, function_call (JSON {"name",
               "arguments"} or a list of them -> assistant tool_calls), observation/tool.
  glaive       glaiveai/glaive-function-calling-v2: "system" holds the system text followed by
               JSON function definitions (-> tools); "chat" holds USER:/ASSISTANT:/FUNCTION
               RESPONSE: turns, `<functioncall> {...}` -> tool_calls, <|endoftext|> dropped.
  instruction  Alpaca style: user = instruction (+ "\\n\\n" + input when non-empty), optional
               system column; the output column is the answer to regenerate and is dropped.
               format_options renames the columns; null means "no such column" (input,
               system, output). Two roles reading one column is a config error: with
               OpenCodeInstruct's layout ({instruction: input}) the default input column
               would repeat every question, so it says {instruction: input, input: null}.
  hook         a user function(record) -> messages list or {"messages", "tools"?}.

Turn selection (`turns`), applied to a valid conversation:
  last   (default) the prompt ends with the last user (or tool) turn before the final
         assistant turn(s); earlier assistant turns stay as context. A conversation that does
         not end with an assistant turn is used whole.
  first  the prompt ends before the first assistant turn (later turns are dropped).
  all    one prompt per assistant turn that follows a user/tool turn: everything before it.
         A conversation without assistant turns gives one prompt, the whole conversation.

Context of later turns (`context`, a category option):
  dataset      (default) the prompts above: earlier assistant turns are the dataset's text
               (another model's answers: off-policy context).
  regenerated  the whole conversation is one prompt row (its prompt_id hashes the whole
               conversation, so all its turns land in one shard); `tokenmill generate`
               regenerates every assistant turn in order, each on top of the model's own
               earlier turns (docs/multi-turn.md). `turns` is ignored.

Problems raise RecordError with a stable reason code (see REASONS).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable

from tokenmill.contracts import canonical_json

# Stable reason codes of the prepare stage (they appear in rejected rows and in stats).
UNPARSEABLE = "unparseable"
MISSING_FIELD = "missing_field"
EMPTY_CONVERSATION = "empty_conversation"
ROLES_OUT_OF_ORDER = "roles_out_of_order"
INVALID_TOOL_JSON = "invalid_tool_json"
NO_USER_TURN = "no_user_turn"
UNKNOWN_ROLE = "unknown_role"
UNSUPPORTED_CONTENT = "unsupported_content"
HOOK_ERROR = "hook_error"
DUPLICATE_PROMPT = "duplicate_prompt"
OVER_MAX_PROMPTS = "over_max_prompts"
REASONS = (
    UNPARSEABLE,
    MISSING_FIELD,
    EMPTY_CONVERSATION,
    ROLES_OUT_OF_ORDER,
    INVALID_TOOL_JSON,
    NO_USER_TURN,
    UNKNOWN_ROLE,
    UNSUPPORTED_CONTENT,
    HOOK_ERROR,
    DUPLICATE_PROMPT,
    OVER_MAX_PROMPTS,
)

ROLES = ("system", "user", "assistant", "tool")
FORMATS = ("messages", "sharegpt", "glaive", "instruction", "hook")
TURNS = ("last", "first", "all")
CONTEXTS = ("dataset", "regenerated")


class RecordError(ValueError):
    """A record that cannot become a prompt; `reason` is a stable code from REASONS."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


def prompt_id(messages: list[dict], tools: list[dict] | None) -> str:
    """The prompt's identity: a hash of its canonical JSON (stable across machines)."""
    text = canonical_json({"messages": messages, "tools": tools})
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:32]


# ---------------------------------------------------------------------------------------------
# Canonical pieces shared by all formats


def _parse_json_field(value, what: str):
    if isinstance(value, str):
        try:
            return json.loads(value)
        except json.JSONDecodeError as exc:
            raise RecordError(INVALID_TOOL_JSON, f"{what} is not valid JSON: {exc}") from exc
    return value


def parse_arguments(value, where: str) -> dict:
    """Tool-call arguments as a dict (chat templates iterate over them as a mapping)."""
    if value is None or value == "":
        return {}
    args = _parse_json_field(value, f"{where} arguments")
    if not isinstance(args, dict):
        raise RecordError(
            INVALID_TOOL_JSON, f"{where} arguments must be a JSON object, got {type(args).__name__}"
        )
    return args


def canonical_tool_call(call, where: str) -> dict:
    if not isinstance(call, dict):
        raise RecordError(INVALID_TOOL_JSON, f"{where} is not an object")
    fn = call.get("function") if isinstance(call.get("function"), dict) else call
    name = fn.get("name")
    if not isinstance(name, str) or not name:
        raise RecordError(MISSING_FIELD, f"{where} has no function name")
    out = {
        "type": "function",
        "function": {"name": name, "arguments": parse_arguments(fn.get("arguments"), where)},
    }
    if isinstance(call.get("id"), str) and call["id"]:
        out["id"] = call["id"]
    return out


def canonical_tools(value) -> list[dict] | None:
    """Tool definitions as [{"type": "function", "function": {...}}]; none or [] -> None."""
    if value is None or value == "":
        return None
    tools = _parse_json_field(value, "tools")
    if isinstance(tools, dict):
        tools = [tools]
    if not isinstance(tools, list):
        raise RecordError(INVALID_TOOL_JSON, f"tools must be a list, got {type(tools).__name__}")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict):
            raise RecordError(INVALID_TOOL_JSON, f"tools[{i}] is not an object")
        fn = tool.get("function") if isinstance(tool.get("function"), dict) else tool
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise RecordError(INVALID_TOOL_JSON, f"tools[{i}] has no name")
        spec = {"name": fn["name"]}
        if fn.get("description") is not None:
            spec["description"] = fn["description"]
        if fn.get("parameters") is not None:
            # Some datasets store the JSON schema as a string; templates need the mapping.
            spec["parameters"] = _parse_json_field(fn["parameters"], f"tools[{i}].parameters")
        out.append({"type": "function", "function": spec})
    return out or None


def _content_text(content, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if isinstance(part, str):
                texts.append(part)
            elif isinstance(part, dict) and part.get("type", "text") == "text":
                if not isinstance(part.get("text"), str):
                    raise RecordError(MISSING_FIELD, f"{where} content part {j} has no text")
                texts.append(part["text"])
            else:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise RecordError(UNSUPPORTED_CONTENT, f"{where} has a non-text part ({kind})")
        # Joined with newlines, as vLLM's chat handling does for text parts.
        return "\n".join(texts)
    raise RecordError(UNSUPPORTED_CONTENT, f"{where} content is a {type(content).__name__}")


def canonical_message(msg, i: int) -> dict:
    """One OpenAI-style message in canonical shape (unknown keys and nulls dropped)."""
    where = f"message {i}"
    if not isinstance(msg, dict):
        raise RecordError(UNPARSEABLE, f"{where} is not an object")
    role = msg.get("role")
    if role is None:
        raise RecordError(MISSING_FIELD, f"{where} has no role")
    if role not in ROLES:
        raise RecordError(UNKNOWN_ROLE, f"{where} has role {role!r}")
    out: dict = {"role": role}
    calls = msg.get("tool_calls") if role == "assistant" else None
    if calls:
        if not isinstance(calls, list):
            raise RecordError(INVALID_TOOL_JSON, f"{where} tool_calls is not a list")
        out["tool_calls"] = [
            canonical_tool_call(c, f"{where} tool_calls[{k}]") for k, c in enumerate(calls)
        ]
    content = msg.get("content")
    if content is None:
        if "tool_calls" not in out:
            raise RecordError(MISSING_FIELD, f"{where} ({role}) has no content")
        content = ""
    out["content"] = _content_text(content, where)
    if role == "tool":
        for key in ("name", "tool_call_id"):
            if isinstance(msg.get(key), str) and msg[key]:
                out[key] = msg[key]
    return out


def validate(messages: list[dict]) -> None:
    """Check the role order of a canonical conversation; raises RecordError."""
    if not messages:
        raise RecordError(EMPTY_CONVERSATION, "the conversation has no turns")
    roles = [m["role"] for m in messages]
    if "user" not in roles:
        raise RecordError(NO_USER_TURN, f"no user turn (roles: {', '.join(roles)})")
    seen_user = False
    tool_ok = False  # a tool turn must answer a preceding assistant tool call
    for i, m in enumerate(messages):
        role = m["role"]
        if role == "system" and i != 0:
            raise RecordError(ROLES_OUT_OF_ORDER, f"system turn at position {i} (only first)")
        if role == "assistant" and not seen_user:
            raise RecordError(ROLES_OUT_OF_ORDER, f"assistant turn {i} before any user turn")
        if role == "tool" and not tool_ok:
            raise RecordError(
                ROLES_OUT_OF_ORDER, f"tool turn {i} without a preceding assistant tool call"
            )
        seen_user = seen_user or role == "user"
        if role == "assistant":
            tool_ok = bool(m.get("tool_calls"))
        elif role != "tool":
            tool_ok = False


def select_turns(messages: list[dict], turns: str = "last") -> list[list[dict]]:
    """Prompts (message lists) cut from a valid conversation; see the module docstring."""
    roles = [m["role"] for m in messages]
    if turns == "last":
        end = len(messages)
        while end > 0 and roles[end - 1] == "assistant":
            end -= 1
        return [messages[:end]]
    if turns == "first":
        end = roles.index("assistant") if "assistant" in roles else len(messages)
        return [messages[:end]]
    if turns == "all":
        starts = [
            i for i, r in enumerate(roles) if r == "assistant" and roles[i - 1] != "assistant"
        ]
        return [messages[:i] for i in starts] or [messages]
    raise ValueError(f"turns must be one of {TURNS}, got {turns!r}")


# ---------------------------------------------------------------------------------------------
# Formats


def _require(record: dict, key: str):
    if key not in record or record[key] is None:
        raise RecordError(MISSING_FIELD, f"record has no '{key}'")
    return record[key]


def from_messages(record: dict, options: dict | None = None):
    msgs = _require(record, "messages")
    if isinstance(msgs, str):
        try:
            msgs = json.loads(msgs)
        except json.JSONDecodeError as exc:
            raise RecordError(UNPARSEABLE, f"messages is not valid JSON: {exc}") from exc
    if not isinstance(msgs, list):
        raise RecordError(UNPARSEABLE, f"messages is a {type(msgs).__name__}, not a list")
    messages = [canonical_message(m, i) for i, m in enumerate(msgs)]
    return messages, canonical_tools(record.get("tools"))


SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "system": "system",
    "observation": "tool",
    "tool": "tool",
    "function_call": "assistant",
}


def from_sharegpt(record: dict, options: dict | None = None):
    conv = _require(record, "conversations")
    if not isinstance(conv, list):
        raise RecordError(UNPARSEABLE, "conversations is not a list")
    if not conv:
        raise RecordError(EMPTY_CONVERSATION, "conversations is empty")
    messages = []
    system = record.get("system")
    if isinstance(system, str) and system.strip():
        messages.append({"role": "system", "content": system})
    for i, turn in enumerate(conv):
        if not isinstance(turn, dict):
            raise RecordError(UNPARSEABLE, f"conversations[{i}] is not an object")
        frm = turn.get("from")
        if frm is None:
            raise RecordError(MISSING_FIELD, f"conversations[{i}] has no 'from'")
        if frm not in SHAREGPT_ROLES:
            raise RecordError(UNKNOWN_ROLE, f"conversations[{i}] is from {frm!r}")
        value = turn.get("value")
        if not isinstance(value, str):
            raise RecordError(MISSING_FIELD, f"conversations[{i}] has no string 'value'")
        if frm == "function_call":
            calls = _parse_json_field(value, f"conversations[{i}] function_call")
            calls = calls if isinstance(calls, list) else [calls]
            tool_calls = [
                canonical_tool_call(c, f"conversations[{i}] function_call") for c in calls
            ]
            messages.append({"role": "assistant", "content": "", "tool_calls": tool_calls})
        else:
            messages.append({"role": SHAREGPT_ROLES[frm], "content": value})
    return messages, canonical_tools(record.get("tools"))


_GLAIVE_TURN = re.compile(r"(?:^|\n)[ \t]*(USER|ASSISTANT|FUNCTION RESPONSE):[ \t]?")
_GLAIVE_EOT = "<|endoftext|>"
# glaive writes arguments as a single-quoted JSON string: {"name": "f", "arguments": '{...}'}
_GLAIVE_CALL = re.compile(
    r"^\{\s*\"name\"\s*:\s*(\"(?:[^\"\\]|\\.)*\")\s*,\s*\"arguments\"\s*:\s*'(.*)'\s*\}$", re.S
)


def _glaive_tools(system: str):
    """Split glaive's system string into (system text, tools)."""
    text = system.strip()
    if text.startswith("SYSTEM:"):
        text = text[len("SYSTEM:") :]
    start = text.find("{")
    if start < 0:
        return text.strip(), None
    head, rest = text[:start].strip(), text[start:]
    decoder = json.JSONDecoder()
    defs, pos = [], 0
    while pos < len(rest):
        if rest[pos].isspace():
            pos += 1
            continue
        try:
            value, pos = decoder.raw_decode(rest, pos)
        except json.JSONDecodeError as exc:
            raise RecordError(INVALID_TOOL_JSON, f"function definition in system: {exc}") from exc
        defs.append(value)
    return head, canonical_tools(defs)


def parse_glaive_call(text: str) -> dict:
    """`{"name": ..., "arguments": '...'}` (glaive's not-quite-JSON) -> canonical tool call."""
    text = text.replace(_GLAIVE_EOT, "").strip()
    try:
        call = json.loads(text)
    except json.JSONDecodeError:
        m = _GLAIVE_CALL.match(text)
        if not m:
            detail = f"functioncall is not parseable: {text[:200]}"
            raise RecordError(INVALID_TOOL_JSON, detail) from None
        name = json.loads(m.group(1))
        raw_args = m.group(2)
        try:
            args = json.loads(raw_args)
        except json.JSONDecodeError:
            # Some records escape the quotes inside the single-quoted string.
            try:
                args = json.loads(raw_args.replace("\\'", "'"))
            except json.JSONDecodeError as exc:
                raise RecordError(
                    INVALID_TOOL_JSON, f"functioncall arguments are not JSON: {exc}"
                ) from exc
        call = {"name": name, "arguments": args}
    return canonical_tool_call(call, "functioncall")


def from_glaive(record: dict, options: dict | None = None):
    chat = _require(record, "chat")
    if not isinstance(chat, str):
        raise RecordError(UNPARSEABLE, "chat is not a string")
    system = record.get("system") or ""
    if not isinstance(system, str):
        raise RecordError(UNPARSEABLE, "system is not a string")
    system_text, tools = _glaive_tools(system)
    parts = _GLAIVE_TURN.split(chat)
    if parts[0].replace(_GLAIVE_EOT, "").strip():
        raise RecordError(UNPARSEABLE, f"text before the first turn marker: {parts[0][:80]!r}")
    if len(parts) == 1:
        raise RecordError(EMPTY_CONVERSATION, "chat has no USER:/ASSISTANT: turns")
    messages = [{"role": "system", "content": system_text}] if system_text else []
    for marker, body in zip(parts[1::2], parts[2::2], strict=True):
        body = body.replace(_GLAIVE_EOT, "").strip()
        if marker == "USER":
            messages.append({"role": "user", "content": body})
        elif marker == "FUNCTION RESPONSE":
            messages.append({"role": "tool", "content": body})
        elif "<functioncall>" in body:
            before, _, call = body.partition("<functioncall>")
            messages.append(
                {
                    "role": "assistant",
                    "content": before.strip(),
                    "tool_calls": [parse_glaive_call(call)],
                }
            )
        else:
            messages.append({"role": "assistant", "content": body})
    return messages, tools


# The instruction format's roles and their default columns (format_options renames them).
INSTRUCTION_COLUMNS = {"instruction": "instruction", "input": "input", "output": "output",
                       "system": "system"}  # fmt: skip


class ColumnClash(ValueError):
    """Two roles of the instruction format read the same column; `role` is the one to change."""

    def __init__(self, role: str, message: str):
        super().__init__(message)
        self.role = role


def instruction_columns(options: dict | None) -> dict[str, str | None]:
    """{role: column or None} for the instruction format. Raises ColumnClash when two roles
    read one column (OpenCodeInstruct's question is in `input`: {instruction: input} alone
    would also read it as the input column and repeat every question)."""
    options = options or {}
    columns = {role: options.get(role, default) for role, default in INSTRUCTION_COLUMNS.items()}
    if columns["instruction"] is None:
        raise ColumnClash("instruction", "the instruction column cannot be null")
    seen: dict[str, str] = {}
    for role, column in columns.items():
        if column is None:
            continue
        if column in seen:
            first = seen[column]
            # Name the role whose column was defaulted (that is where the fix goes), but never
            # the instruction, which every record needs.
            fix = first if first not in options and first != "instruction" else role
            how = "by default" if fix not in options else "as set"
            raise ColumnClash(
                fix,
                f"roles '{first}' and '{role}' both read column '{column}' ('{fix}' {how}), "
                f"so that text would be used twice. Set format_options.{fix} to another "
                "column, or to null if the data has no such column",
            )
        seen[column] = role
    return columns


def from_instruction(record: dict, options: dict | None = None):
    columns = instruction_columns(options)
    col_instruction, col_input, col_system = (
        columns["instruction"], columns["input"], columns["system"]
    )  # fmt: skip
    instruction = record.get(col_instruction)
    if not isinstance(instruction, str) or not instruction.strip():
        raise RecordError(MISSING_FIELD, f"record has no (non-empty) '{col_instruction}'")
    content = instruction
    extra = record.get(col_input) if col_input is not None else None
    if extra is not None and not isinstance(extra, str):
        raise RecordError(UNSUPPORTED_CONTENT, f"'{col_input}' is a {type(extra).__name__}")
    if extra and extra.strip():
        content = f"{instruction}\n\n{extra}"
    messages = []
    system = record.get(col_system) if col_system is not None else None
    if isinstance(system, str) and system.strip():
        messages.append({"role": "system", "content": system})
    messages.append({"role": "user", "content": content})
    return messages, None


def from_hook(record: dict, hook: Callable):
    try:
        result = hook(record)
    except Exception as exc:  # noqa: BLE001 - the user's code; reported as a rejected row
        raise RecordError(HOOK_ERROR, f"{type(exc).__name__}: {exc}") from exc
    if isinstance(result, dict):
        if not isinstance(result.get("messages"), list):
            raise RecordError(HOOK_ERROR, "hook returned a dict without a 'messages' list")
        msgs, tools = result["messages"], result.get("tools")
    elif isinstance(result, list):
        msgs, tools = result, None
    else:
        raise RecordError(
            HOOK_ERROR, f"hook returned {type(result).__name__}, expected list or dict"
        )
    return [canonical_message(m, i) for i, m in enumerate(msgs)], canonical_tools(tools)


_CONVERTERS = {
    "messages": from_messages,
    "sharegpt": from_sharegpt,
    "glaive": from_glaive,
    "instruction": from_instruction,
}


def to_conversation(record: dict, fmt: str, options: dict | None = None, hook=None):
    """One record -> validated (messages, tools). Raises RecordError."""
    if fmt == "hook":
        if hook is None:
            raise ValueError("format 'hook' needs a hook function")
        messages, tools = from_hook(record, hook)
    elif fmt in _CONVERTERS:
        messages, tools = _CONVERTERS[fmt](record, options)
    else:
        raise ValueError(f"unknown format {fmt!r} (expected one of {FORMATS})")
    validate(messages)
    return messages, tools


def to_prompts(
    record: dict, fmt: str, options=None, hook=None, turns: str = "last", context: str = "dataset"
):
    """One record -> [(prompt_id, messages, tools), ...] after turn selection. With
    context=regenerated the whole conversation is the one "prompt" (its dataset assistant turns
    stay in it: tokenize needs them to find the template's pieces between turns)."""
    messages, tools = to_conversation(record, fmt, options, hook)
    if context == "regenerated":
        return [(prompt_id(messages, tools), messages, tools)]
    return [(prompt_id(p, tools), p, tools) for p in select_turns(messages, turns)]


def turn_spans(messages: list[dict]) -> list[tuple[int, int]]:
    """(start, end) of each turn to regenerate in a conversation (context: regenerated): a run
    of assistant messages after a user/tool message is one turn, replaced as a whole by the
    model's one answer; a conversation that ends with a user/tool message gets one more turn,
    (len, len), answered by the model with no dataset answer to replace."""
    roles = [m["role"] for m in messages]
    spans = []
    for i, role in enumerate(roles):
        if role == "assistant" and i > 0 and roles[i - 1] != "assistant":
            end = i
            while end < len(roles) and roles[end] == "assistant":
                end += 1
            spans.append((i, end))
    if roles and roles[-1] != "assistant":
        spans.append((len(roles), len(roles)))
    return spans
