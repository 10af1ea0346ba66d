"""A request's one output constraint: which field asked for it, as the grammar engine takes it, compiled.

CONSTRAINT_FIELDS names the body fields that ask for one: api/generation.py comes here only when a
request sets one of them (or the endpoint asks, as chat's response_format and tools do).

The fields are vLLM's `guided_*` (both endpoints) and, on chat, OpenAI's `response_format` and
forced tool calls (api/tool_calls.py). Compiling happens here, on the request's thread, before
the request is admitted: a constraint the engine refuses is a 400 naming the field, and the
engine's loop never waits for a compile.

Nothing here takes more than linear time in what the client sent (the request thread shares the
interpreter with the loop and /health): a constraint's text is capped (MAX_CONSTRAINT_CHARS by kind,
a 400 naming the field) before it is compiled, and a grammar's syntax is told in one pass over it.
"""

import json
import re
from collections.abc import Callable
from typing import NamedTuple

from api.errors import ApiError, bad
from api.protocol import SamplingRequest
from generate.constraint_compiler import CompilerBusy
from generate.constraints import KIND_NAMES, CompiledConstraint, Constraint, ConstraintError

CONSTRAINT_FIELDS = frozenset(
    {
        "guided_json",
        "guided_regex",
        "guided_choice",
        "guided_grammar",
        "guided_whitespace_pattern",
        "structured_outputs",
    }
)
# GBNF / xgrammar's EBNF defines rules with "::="; Lark (vLLM's tests, llguidance) with ":".
_RULE_NAME = re.compile(r"[A-Za-z_][\w.-]*")
# The longest constraint text compiled, by kind: a grammar or a regex (64 KiB), a JSON schema, choice list or
# tools (256 KiB, within MAX_BODY_BYTES). llguidance compiles the largest in about a second.
MAX_CONSTRAINT_CHARS = {"lark": 65_536, "ebnf": 65_536, "regex": 65_536}
MAX_SCHEMA_CHARS = 262_144


class Asked(NamedTuple):
    field: str  # the request field that asked for it, named by a 400
    constraint: Constraint


def guided(body: SamplingRequest) -> list[Asked]:
    """The constraints the guided_* fields ask for (more than one is refused by `one_constraint`)."""
    asked = []
    ws = body.guided_whitespace_pattern
    if body.guided_json is not None:
        # JSON text is passed on as it is: the engine judges it (not JSON, not a schema: a 400 naming the field)
        spec = body.guided_json if isinstance(body.guided_json, str) else json.dumps(body.guided_json)
        asked.append(Asked("guided_json", Constraint("json_schema", spec, ws)))
    if body.guided_regex is not None:
        asked.append(Asked("guided_regex", Constraint("regex", body.guided_regex)))
    if body.guided_choice is not None:
        asked.append(Asked("guided_choice", Constraint("choice", json.dumps(body.guided_choice))))
    if body.guided_grammar is not None:
        asked.append(Asked("guided_grammar", Constraint(grammar_kind(body.guided_grammar), body.guided_grammar)))
    if ws is not None and [a.constraint.kind for a in asked] != ["json_schema"]:
        field = "guided_whitespace_pattern"
        raise bad(f"'{field}' applies to a JSON constraint ('guided_json') only", field)
    return asked + structured_outputs(body)


def structured_outputs(body: SamplingRequest) -> list[Asked]:
    """The constraint vLLM's `structured_outputs` asks for: exactly one of its kinds, as vLLM requires."""
    so = body.structured_outputs
    if so is None:
        return []
    field, ws = "structured_outputs", so.whitespace_pattern
    kinds = {
        "json": lambda v: Constraint("json_schema", v if isinstance(v, str) else json.dumps(v), ws),
        "regex": lambda v: Constraint("regex", v),
        "choice": lambda v: Constraint("choice", json.dumps(v)),
        "grammar": lambda v: Constraint(grammar_kind(v), v),
        "json_object": lambda v: Constraint("json_object", "", ws),
    }
    values = {"json": so.json_, **so.model_dump(include={"regex", "choice", "grammar", "json_object"})}
    given = [k for k in kinds if values[k] not in (None, False)]
    if len(given) != 1:
        raise bad(f"'{field}' must give exactly one of {', '.join(kinds)}; it gives {len(given)}", field)
    (kind,) = given
    if ws is not None and kind not in ("json", "json_object"):
        raise bad(f"'{field}.whitespace_pattern' applies to a JSON constraint only", field)
    return [Asked(field, kinds[kind](values[kind]))]


def grammar_kind(grammar: str) -> str:
    """ "ebnf" for a grammar with a rule written `name ::= ...` at a line's start (GBNF, as xgrammar takes it),
    else "lark". Each line is read once: a regex anchored at every line's start with a leading `\\s*` (which
    crosses newlines) takes time quadratic in the newlines, holding the interpreter all along."""
    for line in grammar.splitlines():
        head, rule, _ = line.partition("::=")
        if rule and _RULE_NAME.fullmatch(head.strip()):
            return "ebnf"
    return "lark"


def json_schema(schema: dict, whitespace: str | None = None) -> Constraint:
    return Constraint("json_schema", json.dumps(schema), whitespace)


Compile = Callable[[Constraint], CompiledConstraint]  # the serving engine's compiler (cached)


def constraint(body: SamplingRequest, more: list[Asked], compiler: Compile) -> CompiledConstraint | None:
    """The one constraint the body's guided_* or structured_outputs fields, or the endpoint's `more`, ask for,
    compiled; more than one is a 400 naming the second."""
    return compiled(one_constraint(guided(body) + more), compiler)


def one_constraint(asked: list[Asked]) -> Asked | None:
    if len(asked) > 1:
        names = " and ".join(f"'{a.field}'" for a in asked)
        raise bad(f"give one constraint per request, not {names}", asked[1].field)
    return asked[0] if asked else None


def compiled(asked: Asked | None, compiler: Compile) -> CompiledConstraint | None:
    """The constraint compiled (cached by the engine's compiler); a refusal is a 400 naming its field."""
    if asked is None:
        return None
    kind, limit = asked.constraint.kind, MAX_CONSTRAINT_CHARS.get(asked.constraint.kind, MAX_SCHEMA_CHARS)
    if len(asked.constraint.spec) > limit:
        raise bad(f"'{asked.field}': the {KIND_NAMES[kind]} is longer than {limit} characters", asked.field)
    try:
        return compiler(asked.constraint)
    except CompilerBusy as err:
        raise ApiError(503, str(err), "overloaded", asked.field, {"Retry-After": "1"}) from None
    except ConstraintError as err:
        raise bad(f"'{asked.field}': {err}", asked.field) from None
