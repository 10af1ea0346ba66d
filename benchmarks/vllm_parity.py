"""Send the same structured-output and tool-call requests to this server and to vLLM; list what a client sees differ.

    python -m benchmarks.vllm_parity --ours http://127.0.0.1:8000 --vllm http://127.0.0.1:8001 [--json out.json]

Each case is one request (vLLM's `guided_*` fields and its current `structured_outputs`, both
`response_format` kinds, tools under every `tool_choice`, bad schemas). For each the script compares
what a client can see: the status, the error's shape (its keys, `type`, `param`), the answer's keys,
each choice's `finish_reason`, whether `content` and `tool_calls` are there, how many calls, and whether
the output fits the constraint asked for. Texts themselves are not compared: the two servers sample
differently. vLLM is not a dependency of this project: run it from its own virtual environment
(docs/tool-calls-and-parity.md says how).
"""

import argparse
import json
import re
import sys
from typing import Any

import requests

SCHEMA = {
    "type": "object",
    "properties": {"city": {"enum": ["Oslo", "Rome"]}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"],
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}},
]
MESSAGES = [{"role": "user", "content": "Weather in Oslo?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
BASE = {"max_tokens": 60, "temperature": 0, "seed": 1}

# (name, endpoint, body, check of the output text or None)
CASES: list[tuple[str, str, dict, Any]] = [
    ("guided_json", "completions", {"prompt": "JSON:", "guided_json": SCHEMA}, "schema"),
    ("guided_regex", "completions", {"prompt": "Code:", "guided_regex": "[a-z]{3}[0-9]{2}"}, "regex"),
    ("guided_choice", "completions", {"prompt": "Mood:", "guided_choice": ["yes", "no"]}, "choice"),
    ("guided_grammar (lark)", "completions", {"prompt": "Q:", "guided_grammar": 'start: "a" | "b"'}, "ab"),
    ("structured_outputs.json", "completions", {"prompt": "JSON:", "structured_outputs": {"json": SCHEMA}}, "schema"),
    ("structured_outputs.regex", "chat", {"structured_outputs": {"regex": "[a-z]{3}[0-9]{2}"}}, "regex"),
    ("structured_outputs.choice", "chat", {"structured_outputs": {"choice": ["yes", "no"]}}, "choice"),
    ("response_format json_object", "chat", {"response_format": {"type": "json_object"}, "max_tokens": 8}, None),
    (
        "response_format json_schema",
        "chat",
        {"response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA}}},
        "schema",
    ),  # noqa: E501
    ("response_format text", "chat", {"response_format": {"type": "text"}, "max_tokens": 5}, None),
    ("tool_choice none", "chat", {"tools": TOOLS, "tool_choice": "none", "max_tokens": 5}, None),
    ("tool_choice auto", "chat", {"tools": TOOLS, "tool_choice": "auto", "max_tokens": 10}, None),
    ("tool_choice required", "chat", {"tools": TOOLS, "tool_choice": "required", "max_tokens": 200}, None),
    (
        "tool_choice required, parallel false",
        "chat",
        {"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False},
        None,
    ),  # noqa: E501
    ("tool_choice named", "chat", {"tools": TOOLS, "tool_choice": NAMED}, None),
    ("tool_choice named, cut by max_tokens", "chat", {"tools": TOOLS, "tool_choice": NAMED, "max_tokens": 3}, None),
    (
        "tool_choice required, cut by max_tokens",
        "chat",
        {"tools": TOOLS, "tool_choice": "required", "max_tokens": 3},
        None,
    ),  # noqa: E501
    ("tool_choice named, streamed", "chat", {"tools": TOOLS, "tool_choice": NAMED, "stream": True}, None),
    ("bad: guided_json not JSON", "completions", {"prompt": "x", "guided_json": "{not json"}, None),
    ("bad: guided_regex broken", "completions", {"prompt": "x", "guided_regex": "[a-"}, None),
    ("bad: guided_choice empty", "completions", {"prompt": "x", "guided_choice": []}, None),
    ("bad: two constraints", "completions", {"prompt": "x", "guided_regex": "a", "guided_choice": ["a"]}, None),
    ("bad: structured_outputs two", "chat", {"structured_outputs": {"regex": "a", "choice": ["a"]}}, None),
    (
        "bad: response_format schema type",
        "chat",
        {"response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": {"type": "objekt"}}}},
        None,
    ),  # noqa: E501
    ("bad: json_schema without schema", "chat", {"response_format": {"type": "json_schema"}}, None),
    (
        "bad: tool_choice names no tool",
        "chat",
        {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
        None,
    ),  # noqa: E501
    ("bad: tool_choice without tools", "chat", {"tool_choice": "required"}, None),
    (
        "bad: tool parameters not a schema",
        "chat",
        {
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}],
            "tool_choice": "required",
        },
        None,
    ),  # noqa: E501
]


def fits(check: str | None, text: str | None) -> bool | None:
    if check is None or text is None:
        return None
    if check == "schema":
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            return False
        return isinstance(value, dict) and set(value) == {"city", "days"} and value["city"] in ("Oslo", "Rome")
    if check == "regex":
        return re.fullmatch("[a-z]{3}[0-9]{2}", text) is not None
    return text in {"choice": ("yes", "no"), "ab": ("a", "b")}[check]


def send(base: str, model: str, endpoint: str, body: dict) -> requests.Response:
    path = "/v1/completions" if endpoint == "completions" else "/v1/chat/completions"
    full = {**BASE, "model": model, **({} if endpoint == "completions" else {"messages": MESSAGES}), **body}
    return requests.post(base + path, json=full, timeout=300, stream=bool(body.get("stream")))


def observe(resp: requests.Response, check: str | None) -> dict:
    """What a client sees of one answer, in comparable form."""
    seen: dict[str, Any] = {"status": resp.status_code}
    if resp.headers.get("content-type", "").startswith("text/event-stream"):
        return seen | _streamed(resp)
    body = resp.json()
    if resp.status_code != 200:
        error = body.get("error", body)
        return seen | {"error keys": sorted(error), "error type": error.get("type"), "param": error.get("param")}
    (choice,) = body["choices"]
    message = choice.get("message", {})
    text = choice["text"] if "text" in choice else message.get("content")
    calls = message.get("tool_calls") or []
    return seen | {
        "keys": set(body),
        "finish_reason": choice["finish_reason"],
        "content": "null" if text is None else "empty" if text == "" else "text",
        "tool_calls": len(calls) if "tool_calls" in message else "absent",
        "calls parse": all(_parses(c["function"]["arguments"]) for c in calls) if calls else None,
        "fits": fits(check, text),
    }


def _streamed(resp: requests.Response) -> dict:
    first_delta, finish, pieces = None, None, 0
    for line in resp.iter_lines():
        if not line.startswith(b"data: ") or line == b"data: [DONE]":
            continue
        for choice in json.loads(line[6:]).get("choices", []):
            first_delta = first_delta or sorted(choice["delta"])
            finish = choice.get("finish_reason") or finish
            pieces += len(choice["delta"].get("tool_calls") or [])
    return {"first delta keys": first_delta, "finish_reason": finish, "tool_call pieces > 0": pieces > 0}


def _parses(arguments: str) -> bool:
    try:
        json.loads(arguments)
    except json.JSONDecodeError:
        return False
    return True


def model_of(base: str) -> str:
    return requests.get(base + "/v1/models", timeout=30).json()["data"][0]["id"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ours", required=True)
    parser.add_argument("--vllm", required=True)
    parser.add_argument("--json", help="write every observation here")
    args = parser.parse_args()
    models = {"ours": model_of(args.ours), "vllm": model_of(args.vllm)}
    rows, differ, extra = [], 0, {"ours": set(), "vllm": set()}
    for name, endpoint, body, check in CASES:
        seen = {side: observe(send(getattr(args, side), models[side], endpoint, body), check) for side in models}
        keys = {side: seen[side].pop("keys", None) for side in seen}
        if None not in keys.values():  # answer fields one side adds in every case are listed once, below
            extra["ours"] |= keys["ours"] - keys["vllm"]
            extra["vllm"] |= keys["vllm"] - keys["ours"]
        diff = {k: (seen["ours"].get(k), seen["vllm"].get(k)) for k in seen["ours"].keys() | seen["vllm"].keys()}
        diff = {k: v for k, v in sorted(diff.items()) if v[0] != v[1]}
        differ += bool(diff)
        rows.append({"case": name, **seen, "differences": diff})
        print(f"{'DIFF' if diff else 'same'}  {name}")
        for key, (ours, theirs) in diff.items():
            print(f"        {key}: ours {ours!r}  vllm {theirs!r}")
    print(f"{differ} of {len(CASES)} cases differ")
    print(f"answer fields only this server sends: {sorted(extra['ours']) or 'none'}")
    print(f"answer fields only vLLM sends: {sorted(extra['vllm']) or 'none'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
