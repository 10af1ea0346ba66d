"""The chat template: a plain file that says how chat messages become one prompt, and where a reply ends.

Tool calls are text in the transcript: `tool_call` says how one call is written ("{call}" is
{"name": ..., "arguments": ...} as JSON), `tools` lists the functions offered before the messages,
and `tool` is the line of a tool's result. The part of `tool_call` before "{call}" is the opener a
reply writes to start a call (the trigger of tool_choice "auto"); after it, the closer.
"""

import tomllib
from dataclasses import dataclass
from pathlib import Path

DEFAULT_TEMPLATE = Path(__file__).with_name("chat_template.toml")
ROLES = ("system", "user", "assistant")
ROLE_ALIASES = {"developer": "system"}  # OpenAI's newer name for system messages
# Optional keys (a template without them gets these), each with its one placeholder.
TOOL_KEYS = {
    "tools": ("{tools}", "Functions you can call, one JSON per line:\n{tools}\n\n"),
    "tool": ("{content}", "Tool: {content}\n"),
    "tool_call": ("{call}", "<tool_call>{call}</tool_call>"),
}


@dataclass(frozen=True, slots=True)
class ChatTemplate:
    turns: dict[str, str]  # role (ROLES and "tool") -> its line, with "{content}" where the message goes
    reply: str  # opens the assistant's turn, after the messages
    stop: tuple[str, ...]  # where the model has begun another turn: the reply ends there
    tools: str = TOOL_KEYS["tools"][1]  # "{tools}": the offered functions' JSON, one a line
    tool_call: str = TOOL_KEYS["tool_call"][1]  # "{call}": {"name": ..., "arguments": ...}

    @classmethod
    def load(cls, path: str = "") -> "ChatTemplate":
        """The template at `path` (CHAT_TEMPLATE), or the built-in one; ValueError names what is wrong."""
        source = Path(path) if path else DEFAULT_TEMPLATE
        try:
            fields = tomllib.loads(source.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as err:
            raise ValueError(f"CHAT_TEMPLATE {source}: {err}") from None
        required = {*ROLES, "reply", "stop"}
        if not required <= set(fields) <= required | set(TOOL_KEYS):
            raise ValueError(
                f"CHAT_TEMPLATE {source}: needs exactly the keys {sorted(required)}, and may have "
                f"{sorted(TOOL_KEYS)}; has {sorted(fields)}"
            )
        fields = {**{key: default for key, (_, default) in TOOL_KEYS.items()}, **fields}
        placeholders = {**dict.fromkeys(ROLES, "{content}"), **{key: p for key, (p, _) in TOOL_KEYS.items()}}
        for key, placeholder in placeholders.items():
            if not isinstance(fields[key], str) or fields[key].count(placeholder) != 1:
                raise ValueError(f"CHAT_TEMPLATE {source}: {key} must be a string with one '{placeholder}'")
        stop = fields["stop"]
        if (
            not isinstance(fields["reply"], str)
            or not isinstance(stop, list)
            or not all(s and isinstance(s, str) for s in stop)
        ):
            raise ValueError(f"CHAT_TEMPLATE {source}: 'reply' must be a string and 'stop' a list of non-empty strings")
        if fields["tool_call"].startswith("{call}"):
            raise ValueError(f"CHAT_TEMPLATE {source}: 'tool_call' must open with text before '{{call}}'")
        turns = {role: fields[role] for role in (*ROLES, "tool")}
        return cls(turns, fields["reply"], tuple(stop), fields["tools"], fields["tool_call"])

    def render(self, messages: list[tuple[str, str]], tools: list[str] | None = None) -> str:
        """The prompt for (role, content) messages (roles of ROLES, ROLE_ALIASES or "tool"), after the
        offered functions' JSON (`tools`) if any."""
        lines = (self.turns[ROLE_ALIASES.get(role, role)].replace("{content}", content) for role, content in messages)
        offered = self.tools.replace("{tools}", "\n".join(tools)) if tools else ""
        return offered + "".join(lines) + self.reply

    def call(self, call_json: str) -> str:
        """One tool call as an assistant turn writes it."""
        return self.tool_call.replace("{call}", call_json)

    @property
    def call_opener(self) -> str:
        """What a reply writes to start a call (tool_choice "auto" watches for it)."""
        return self.tool_call.split("{call}")[0]

    @property
    def call_closer(self) -> str:
        return self.tool_call.split("{call}")[1]

    @property
    def forced_call_prefix(self) -> str:
        """What follows `reply` in a prompt whose reply must be a call: the call's opener, after the
        separator an assistant turn puts between the reply's opening and its content, so a forced call
        continues the prompt as an earlier call appears in the transcript."""
        turn = self.turns["assistant"]
        separator = turn[len(self.reply) : turn.index("{content}")] if turn.startswith(self.reply) else ""
        return separator + self.call_opener
