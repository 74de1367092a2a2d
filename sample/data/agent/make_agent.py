"""Writes agent_sample.parquet: OpenAI `messages` records with tools, tool calls and tool turns.

messages and tools are stored as JSON strings (one column each), the layout most agent
datasets on the hub use. Run from anywhere; the output is byte-identical on every run:
    python sample/data/agent/make_agent.py
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

OUT = Path(__file__).resolve().parent / "agent_sample.parquet"


def tool(name, description, **params):
    props = {k: {"type": t, "description": d} for k, (t, d) in params.items()}
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {"type": "object", "properties": props, "required": list(params)},
        },
    }


TOOLS = {
    "read_file": tool("read_file", "Read a text file", path=("string", "File path")),
    "list_dir": tool("list_dir", "List a directory", path=("string", "Directory path")),
    "run_shell": tool("run_shell", "Run a shell command", command=("string", "The command")),
    "search_web": tool("search_web", "Search the web", query=("string", "Search terms")),
    "get_time": tool("get_time", "Current time in a time zone", tz=("string", "IANA zone")),
    "add_todo": tool("add_todo", "Add a to-do item", text=("string", "The item")),
}

TASKS = [
    ("read_file", {"path": "README.md"}, "# Demo\nA tiny project.", "What is in README.md?"),
    ("read_file", {"path": "setup.cfg"}, "[metadata]\nname = demo", "Show me setup.cfg."),
    ("read_file", {"path": "notes.txt"}, "buy milk", "Read notes.txt for me."),
    ("list_dir", {"path": "src"}, "main.py\nutil.py", "Which files are in src?"),
    ("list_dir", {"path": "tests"}, "test_main.py", "List the tests folder."),
    ("list_dir", {"path": "."}, "README.md\nsrc\ntests", "What is in the current directory?"),
    ("run_shell", {"command": "python --version"}, "Python 3.11.9", "Which Python is installed?"),
    ("run_shell", {"command": "git status -s"}, " M src/main.py", "Do I have uncommitted changes?"),
    ("run_shell", {"command": "df -h /"}, "/dev/sda1 50G 20G 30G 40% /", "How full is the disk?"),
    ("run_shell", {"command": "nproc"}, "8", "How many CPU cores does this machine have?"),
    ("search_web", {"query": "tallest mountain"}, "Mount Everest, 8849 m", "Tallest mountain?"),
    ("search_web", {"query": "python release"}, "Python 3.13 is the latest", "Newest Python?"),
    ("search_web", {"query": "boiling point ethanol"}, "78.37 C", "When does ethanol boil?"),
    ("get_time", {"tz": "Europe/Paris"}, "14:05", "What time is it in Paris?"),
    ("get_time", {"tz": "Asia/Tokyo"}, "21:05", "What time is it in Tokyo?"),
    ("get_time", {"tz": "America/Lima"}, "07:05", "What is the time in Lima?"),
    ("add_todo", {"text": "call mom"}, "added #4", "Remind me to call mom."),
    ("add_todo", {"text": "water plants"}, "added #5", "Add 'water plants' to my list."),
    ("add_todo", {"text": "pay rent"}, "added #6", "Put paying rent on my to-do list."),
]


def call(name, args, call_id):
    fn = {"name": name, "arguments": json.dumps(args)}  # OpenAI style: arguments as a string
    return {"id": call_id, "type": "function", "function": fn}


def records():
    names = sorted(TOOLS)
    for i, (name, args, result, question) in enumerate(TASKS):
        # Offer the needed tool plus two others, so tool lists differ between records.
        offered = sorted({name, names[i % len(names)], names[(i + 2) % len(names)]})
        msgs = []
        if i % 3 == 0:
            msgs.append({"role": "system", "content": "You are a careful coding agent."})
        msgs += [
            {"role": "user", "content": question},
            {"role": "assistant", "content": None, "tool_calls": [call(name, args, f"c{i}")]},
            {"role": "tool", "tool_call_id": f"c{i}", "name": name, "content": result},
            {"role": "assistant", "content": f"Done: {result.splitlines()[0]}"},
        ]
        if i % 4 == 1:  # a follow-up turn without tools
            msgs += [
                {"role": "user", "content": [{"type": "text", "text": "Thanks, summarize."}]},
                {"role": "assistant", "content": "All set."},
            ]
        yield {"messages": msgs, "tools": [TOOLS[n] for n in offered]}
    # Two parallel calls in one assistant turn.
    for i, (a, b) in enumerate([("Europe/Oslo", "Asia/Dubai"), ("Africa/Lagos", "Asia/Seoul")]):
        yield {
            "messages": [
                {"role": "user", "content": f"Time in {a} and in {b}?"},
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [
                        call("get_time", {"tz": a}, f"p{i}a"),
                        call("get_time", {"tz": b}, f"p{i}b"),
                    ],
                },
                {"role": "tool", "tool_call_id": f"p{i}a", "content": "10:00"},
                {"role": "tool", "tool_call_id": f"p{i}b", "content": "13:00"},
                {"role": "assistant", "content": f"{a}: 10:00, {b}: 13:00."},
            ],
            "tools": [TOOLS["get_time"]],
        }
    # Plain chats with tools offered but not used.
    for q, a in [
        ("What does ls do?", "It lists directory contents."),
        ("Explain what a shell is.", "A program that runs your commands."),
        ("Is Python compiled?", "It compiles to bytecode, then interprets it."),
        ("What is a to-do list?", "A list of tasks you plan to do."),
        ("Say hello.", "Hello!"),
        ("What is JSON?", "A text format for structured data."),
        ("What is a time zone?", "A region that shares the same standard time."),
        ("Why use version control?", "To track and undo changes safely."),
    ]:
        yield {
            "messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}],
            "tools": [TOOLS["run_shell"], TOOLS["read_file"]],
        }
    # Planted malformed record: arguments that are not JSON (-> invalid_tool_json).
    yield {
        "messages": [
            {"role": "user", "content": "List /tmp."},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "bad",
                        "type": "function",
                        "function": {"name": "list_dir", "arguments": "{path: /tmp"},
                    }
                ],
            },
        ],
        "tools": [TOOLS["list_dir"]],
    }


def main() -> None:
    rows = list(records())
    table = pa.table(
        {
            "id": pa.array([f"agent-{i:03d}" for i in range(len(rows))]),
            "messages": pa.array([json.dumps(r["messages"]) for r in rows]),
            "tools": pa.array([json.dumps(r["tools"]) for r in rows]),
        }
    )
    pq.write_table(table, OUT, compression="zstd", store_schema=True)
    print(f"wrote {len(rows)} records to {OUT}")


if __name__ == "__main__":
    main()
