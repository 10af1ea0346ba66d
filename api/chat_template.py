"""The chat template: a plain file that says how chat messages become one prompt, and where a reply ends."""

import tomllib
from dataclasses import dataclass
from pathlib import Path

DEFAULT_TEMPLATE = Path(__file__).with_name("chat_template.toml")
ROLES = ("system", "user", "assistant")
ROLE_ALIASES = {"developer": "system"}  # OpenAI's newer name for system messages


@dataclass(frozen=True, slots=True)
class ChatTemplate:
    turns: dict[str, str]  # role -> its line, with "{content}" where the message goes
    reply: str  # opens the assistant's turn, after the messages
    stop: tuple[str, ...]  # where the model has begun another turn: the reply ends there

    @classmethod
    def load(cls, path: str = "") -> "ChatTemplate":
        """The template at `path` (CHAT_TEMPLATE), or the built-in one; ValueError names what is wrong."""
        source = Path(path) if path else DEFAULT_TEMPLATE
        try:
            fields = tomllib.loads(source.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as err:
            raise ValueError(f"CHAT_TEMPLATE {source}: {err}") from None
        expected = {*ROLES, "reply", "stop"}
        if set(fields) != expected:
            raise ValueError(f"CHAT_TEMPLATE {source}: needs exactly the keys {sorted(expected)}, has {sorted(fields)}")
        turns = {role: fields[role] for role in ROLES}
        if not all(isinstance(t, str) and t.count("{content}") == 1 for t in turns.values()):
            raise ValueError(f"CHAT_TEMPLATE {source}: {', '.join(ROLES)} must be strings with one '{{content}}'")
        stop = fields["stop"]
        if (
            not isinstance(fields["reply"], str)
            or not isinstance(stop, list)
            or not all(s and isinstance(s, str) for s in stop)
        ):
            raise ValueError(f"CHAT_TEMPLATE {source}: 'reply' must be a string and 'stop' a list of non-empty strings")
        return cls(turns, fields["reply"], tuple(stop))

    def render(self, messages: list[tuple[str, str]]) -> str:
        """The prompt for (role, content) messages; roles are those of ROLES or ROLE_ALIASES."""
        lines = (self.turns[ROLE_ALIASES.get(role, role)].replace("{content}", content) for role, content in messages)
        return "".join(lines) + self.reply
