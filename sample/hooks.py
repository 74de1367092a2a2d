"""Example user hooks for `format: hook` (config: `hook: sample.hooks:qa_to_messages`).

A hook receives one raw record (a dict) and returns either a list of OpenAI-style messages
or {"messages": [...], "tools": [...]}. Raising an exception (or returning anything else)
turns the record into a rejected row with reason `hook_error`; the message is kept.
"""


def qa_to_messages(record: dict) -> list[dict]:
    """{"question", "answer", "context"?} -> system (optional), user, assistant."""
    question = record["question"]  # a missing key raises KeyError -> hook_error
    messages = []
    if record.get("context"):
        messages.append({"role": "system", "content": f"Context: {record['context']}"})
    messages.append({"role": "user", "content": question})
    if record.get("answer"):
        messages.append({"role": "assistant", "content": record["answer"]})
    return messages


def with_tools(record: dict) -> dict:
    """{"ask", "tool"} -> {"messages", "tools"}: offer one tool described by name only."""
    return {
        "messages": [{"role": "user", "content": record["ask"]}],
        "tools": [{"type": "function", "function": {"name": record["tool"]}}],
    }
