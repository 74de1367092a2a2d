"""Conversations regenerated on-policy (category option `context: regenerated`): the token-id
pieces of a conversation, the prefix-exactness of a chat template, and the messages that carry
the model's own earlier answers. Used by `tokenmill tokenize` (conversation rows) and by the
generate job's turn loop (tokenmill.generate.conversations). The rule is in docs/multi-turn.md.

Turn k (formats.turn_spans) is the run of assistant messages msgs[a_k:e_k]; the model's one
answer replaces it. With P_k the prompt of turn k and O_k its output ids (ending with a stop
id), turn k+1's prompt is

  prefix-exact    P_k + O_k + S_k, where S_k (the `turn_segments`) is what the template renders
                  after turn k's answer up to turn k+1's generation prompt (the stop token's
                  trailing newline, the user/tool messages, the generation prompt), cut from the
                  dataset's own rendering at tokenize time: no text of the model is re-encoded;
  otherwise       apply_chat_template(msgs[:a_{k+1}] with every earlier turn replaced by the
                  model's answer as a message), which is what a serving engine feeds the model.

The model's answer becomes a message by a token-level split only (model_message): the trailing
stop id is dropped, the ids before the first think-close id are the reasoning and the rest the
answer; each part is decoded with tokenizer.decode (the one place where ids become text: chat
templates take text). Nothing is parsed: a turn whose dataset answer has tool calls is compared
by ids with the dataset's rendering of that answer (`tool_call_ids`); a different output ends
the conversation there (reason tool_call_diverged), an identical one keeps the dataset's
tool-call message (it renders to those very ids), so its tool results answer the model's call.
"""

from __future__ import annotations

import json

from tokenmill.prepare.formats import turn_spans

# Conversation ends (generate meta, generated rows, stats).
END_COMPLETE = "complete"  # every turn generated
END_TRUNCATED = "truncated"  # an output without a stop id (max_new_tokens): nothing to build on
END_TOO_LONG = "too_long"  # the next turn's prompt is over max_prompt_tokens
END_TOOL_DIVERGED = "tool_call_diverged"  # a tool-call turn the model answered differently
END_REJECTED = "engine_rejected"  # the engine refused a turn's prompt
END_ERROR = "engine_error"  # retries exhausted on a turn (not journaled: the next run retries)
ENDS = (END_COMPLETE, END_TRUNCATED, END_TOO_LONG, END_TOOL_DIVERGED, END_REJECTED, END_ERROR)

# The probe of template_prefix_exact: a question, an answer (with and without reasoning) and a
# follow-up question.
_PROBE_USER = [{"role": "user", "content": "What is 2 plus 2?"}]
_PROBE_NEXT = {"role": "user", "content": "And 3 plus 3?"}


def render(tokenizer, messages, tools, generation_prompt: bool, kwargs: dict) -> list[int]:
    """apply_chat_template as the tokenize stage calls it, returning a list of ints."""
    ids = tokenizer.apply_chat_template(
        messages,
        tools=tools,
        add_generation_prompt=generation_prompt,
        tokenize=True,
        return_dict=False,
        **kwargs,
    )
    return [int(x) for x in ids]


def split_output(output_ids, stop_ids, think_end_id):
    """(reasoning ids or None, answer ids): the token-level split of one answer."""
    ids = list(output_ids)
    if ids and ids[-1] in stop_ids:
        ids = ids[:-1]
    if think_end_id is not None and think_end_id in ids:
        i = ids.index(think_end_id)
        return ids[:i], ids[i + 1 :]
    return None, ids


def model_message(tokenizer, output_ids, stop_ids, think_end_id) -> dict:
    """The model's answer as an assistant message (decoded: templates take text)."""
    reasoning, answer = split_output(output_ids, stop_ids, think_end_id)
    msg = {"role": "assistant", "content": tokenizer.decode(answer, skip_special_tokens=False)}
    if reasoning is not None:
        msg["reasoning_content"] = tokenizer.decode(reasoning, skip_special_tokens=False)
    return msg


def template_prefix_exact(tokenizer, kwargs: dict, stop_ids, think_end_id) -> bool:
    """Does the template render an earlier answer exactly as generated? Probe: the ids of the
    prompt [user], then an answer the model could give (answer + stop; and, when a think-close
    token is configured, reasoning + think-close + answer + stop) put into a message by
    model_message; rendering [user, that message, user] must start with prompt + answer ids.
    Kimi-K2.5 and Qwen3 drop earlier reasoning (False); a plain ChatML template keeps it."""
    if not stop_ids:
        return False
    prompt = render(tokenizer, _PROBE_USER, None, True, kwargs)
    enc = tokenizer.encode
    outputs = [enc("4", add_special_tokens=False) + [stop_ids[0]]]
    if think_end_id is not None:
        outputs.append(
            enc("Add the numbers.", add_special_tokens=False)
            + [think_end_id]
            + enc("4", add_special_tokens=False)
            + [stop_ids[0]]
        )
    for out in outputs:
        msg = model_message(tokenizer, out, stop_ids, think_end_id)
        try:
            full = render(tokenizer, [*_PROBE_USER, msg, _PROBE_NEXT], None, True, kwargs)
        except Exception:  # noqa: BLE001 - a template that cannot render history is not exact
            return False
        if full[: len(prompt) + len(out)] != prompt + out:
            return False
    return True


def conversation_pieces(tokenizer, messages, tools, kwargs, stop_ids, template_exact: bool):
    """The token-id pieces of one conversation (raises what the template raises):

    {"prompt_ids": turn 1's prompt, "num_turns", "prefix_exact": template_exact and every
     dataset answer renders as P_k + D_k + S_k, "turn_segments": [S_1 .. S_{n-1}] or None,
     "tool_call_ids": per turn, the dataset answer's ids D_k (through its stop id) when that
     answer has tool calls ([] when they cannot be cut out), else None}
    """
    spans = turn_spans(messages)
    prompts = [render(tokenizer, messages[:a], tools, True, kwargs) for a, _ in spans]
    answers: list[list[int] | None] = []
    for (a, e), p in zip(spans, prompts, strict=True):
        if a == e:
            answers.append(None)
            continue
        rendered = render(tokenizer, messages[:e], tools, False, kwargs)
        d = None
        if rendered[: len(p)] == p:
            rest = rendered[len(p) :]
            cut = next((i for i, t in enumerate(rest) if t in stop_ids), None)
            d = rest[: cut + 1] if cut is not None else None
        answers.append(d)
    tool_ids = [
        (answers[k] or []) if any(m.get("tool_calls") for m in messages[a:e]) else None
        for k, (a, e) in enumerate(spans)
    ]
    exact = template_exact
    segments = []
    for k in range(len(spans) - 1):
        p, d, nxt = prompts[k], answers[k], prompts[k + 1]
        if d is None or nxt[: len(p) + len(d)] != p + d:
            exact = False
            break
        segments.append(nxt[len(p) + len(d) :])
    return {
        "prompt_ids": prompts[0],
        "num_turns": len(spans),
        "prefix_exact": exact,
        "turn_segments": segments if exact else None,
        "tool_call_ids": tool_ids,
    }


def messages_with_answers(messages, answers: dict[int, dict]) -> list[dict]:
    """The conversation up to (not including) turn len(answers)+1's assistant run, each earlier
    turn k's assistant run replaced by answers[k] (a message, or None: keep the dataset's run,
    which a tool-call turn does when the model's ids matched it)."""
    spans = turn_spans(messages)
    n = len(answers)
    out: list[dict] = []
    pos = 0
    for k, (a, e) in enumerate(spans[:n]):
        out += messages[pos:a]
        out += messages[a:e] if answers[k] is None else [answers[k]]
        pos = e
    end = spans[n][0] if n < len(spans) else len(messages)
    out += messages[pos:end]
    return out


def load_json(value):
    return json.loads(value) if value is not None else None
