"""Constraints on what a sequence may generate (structured output), compiled by llguidance.

A `Constraint` says what the output must be; `compile_constraint` turns it into a
`CompiledConstraint` on the request thread, before admission, so the engine loop never compiles:

    kind          spec
    json_schema   a JSON Schema, as JSON text (llguidance's JSON Schema coverage: $ref/$defs, anyOf,
                  enum/const, bounded strings and arrays, ...; an unsupported keyword is an error)
    json_object   "" (any JSON object)
    regex         the regular expression (Rust `regex` syntax; `\\d` `\\w` `\\s` mean ASCII, as in JSON
                  Schema's ECMA regexes and vLLM's clients expect); the whole output must match
    choice        a JSON list of strings: the output is exactly one of them
    lark          a grammar in llguidance's Lark syntax (vLLM's `start: ...` Lark grammars, and
                  lazy lexemes, `%json {...}` and the rest of llguidance's extensions)
    ebnf          a grammar in GBNF / xgrammar EBNF (`root ::= ...`), converted to Lark
    tool_auto     JSON {"trigger": str, "schema": {...}, "separator"?: str}: free text that may not
                  contain `trigger`; once the text writes `trigger`, the rest is a call (one JSON value
                  of `schema`), or with `separator` several, `separator` between two
                  (generate/tool_grammars.py)
    tool_calls    JSON {"schema": {...}, "separator": str}: one call or more, `separator` between two

JSON kinds take `whitespace_pattern` (a regex for the whitespace allowed between tokens of the
JSON); without it the JSON is written compactly, as `json.dumps` writes it (", " and ": "),
which keeps small models from looping on whitespace. Objects in a schema admit only their
declared properties unless the schema says otherwise (generate/closed_objects.py);
STRUCTURED_OPEN_OBJECTS restores the JSON Schema spec's open objects.

The compiled form holds a fresh llguidance matcher; every sequence takes its own copy
(`CompiledConstraint.matcher`), so n completions and forks each have their own state.
Compiles are cached (bounded LRU keyed by the constraint; concurrent requests for the same
constraint wait for one compile) and time-limited (CONSTRAINT_COMPILE_TIMEOUT_S).
"""

import json
import threading
import time
from collections import OrderedDict, deque
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from functools import cache

import llguidance
from llguidance.gbnf_to_lark import any_to_lark
from llguidance.tiktoken import lltokenizer_from_encoding

from config import EngineSettings
from generate.closed_objects import close_objects
from generate.tool_grammars import ToolGrammarError, tool_lark
from model.tokenizer import EOT_ID, load_tokenizer

KINDS = ("json_schema", "json_object", "regex", "choice", "lark", "ebnf", "tool_auto", "tool_calls")
_NAMES = dict(
    json_schema="JSON schema",
    json_object="JSON object",
    regex="regular expression",
    choice="choice",
    lark="Lark grammar",
    ebnf="EBNF grammar",
    tool_auto="tool_auto grammar",
    tool_calls="tool_calls grammar",
)
JSON_KINDS = ("json_schema", "json_object")
VOCAB_SIZE = EOT_ID + 1


@dataclass(frozen=True, slots=True)
class Constraint:
    kind: str  # one of KINDS
    spec: str  # JSON Schema as JSON text; "" for json_object; the regex; a JSON list of strings; the grammar text
    whitespace_pattern: str | None = None  # JSON kinds only


class ConstraintError(ValueError):
    """A constraint that cannot be compiled; the message says what is wrong (fit for a 400)."""


class CompiledConstraint:
    """A constraint compiled for the GPT-2 vocabulary: what the engine needs, and nothing to compile."""

    def __init__(self, constraint: Constraint, grammar: str, prototype: llguidance.LLMatcher, compile_s: float):
        self.constraint, self.grammar, self.compile_s = constraint, grammar, compile_s
        self._prototype = prototype  # never advanced: each sequence advances its own copy

    def matcher(self) -> llguidance.LLMatcher:
        """A matcher at the start of the grammar, for one sequence."""
        return self._prototype.deep_copy()

    def __repr__(self) -> str:
        return f"CompiledConstraint({self.constraint.kind}, {len(self.constraint.spec)} chars)"


@cache
def tokenizer() -> llguidance.LLTokenizer:
    """llguidance's view of the GPT-2 vocabulary (built once, ~0.2 s): end-of-text is its end of sequence."""
    return lltokenizer_from_encoding(load_tokenizer(), n_vocab=VOCAB_SIZE, eos_token=EOT_ID)


def to_grammar(c: Constraint) -> str:
    """The llguidance grammar of a constraint (not yet checked: building a matcher checks it)."""
    if c.kind not in KINDS:
        raise ConstraintError(f"unknown constraint kind {c.kind!r}; one of {', '.join(KINDS)}")
    if c.whitespace_pattern is not None and c.kind not in JSON_KINDS:
        raise ConstraintError("a whitespace pattern applies to JSON constraints only")
    if c.kind in JSON_KINDS:
        return _json_grammar(c.spec if c.kind == "json_schema" else '{"type": "object"}', c.whitespace_pattern)
    if c.kind == "regex":
        return llguidance.LLMatcher.grammar_from_lark(f"start: /{_lark_regex(c.spec)}/")
    if c.kind == "choice":
        return llguidance.LLMatcher.grammar_from_lark(_choice_lark(c.spec))
    if c.kind in ("tool_auto", "tool_calls"):
        try:
            return llguidance.LLMatcher.grammar_from_lark(tool_lark(c.kind, c.spec, _close))
        except ToolGrammarError as e:
            raise ConstraintError(str(e)) from None
    text = c.spec
    if c.kind == "ebnf":
        try:
            text = any_to_lark(c.spec)
        except Exception as e:  # noqa: BLE001 - the converter raises bare Exception (e.g. an unknown rule)
            raise ConstraintError(f"invalid EBNF grammar: {e}") from None
    if not text.strip():
        raise ConstraintError("the grammar is empty")
    return llguidance.LLMatcher.grammar_from_lark(text)


def _json_grammar(schema_text: str, whitespace_pattern: str | None) -> str:
    try:
        schema = json.loads(schema_text)
    except json.JSONDecodeError as e:
        raise ConstraintError(f"the JSON schema is not valid JSON: {e}") from None
    if not isinstance(schema, dict | bool):
        raise ConstraintError("a JSON schema must be an object (or true/false)")
    schema = _close(schema)
    if whitespace_pattern is None:
        options = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
    else:
        options = {"whitespace_flexible": True, "whitespace_pattern": whitespace_pattern}
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=options)
    except ValueError as e:
        raise ConstraintError(f"invalid JSON schema: {e}") from None


def _close(schema: dict | bool) -> dict | bool:
    """The schema as the grammar holds output to it: objects closed unless STRUCTURED_OPEN_OBJECTS."""
    return schema if _settings.structured_open_objects else close_objects(schema)


def _lark_regex(regex: str) -> str:
    if not regex:
        raise ConstraintError("the regular expression is empty")
    try:
        return llguidance.regex_to_lark(regex, "dws")  # ASCII classes, as JSON Schema and Python clients mean
    except ValueError as e:
        raise ConstraintError(f"invalid regular expression: {e}") from None


def _choice_lark(spec: str) -> str:
    try:
        choices = json.loads(spec)
    except json.JSONDecodeError:
        choices = None
    if not isinstance(choices, list) or not all(isinstance(x, str) for x in choices):
        raise ConstraintError("a choice constraint is a JSON list of strings")
    if not choices or not all(choices):
        raise ConstraintError("the choice list must hold at least one non-empty string")
    return "start: " + " | ".join(json.dumps(x) for x in choices)


class _Cache:
    """Compiled constraints by constraint, least recently used first out; one compile per constraint
    at a time (later requests wait on the first one's future). Records compile times and hits."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.entries: OrderedDict[Constraint, Future] = OrderedDict()
        self.hits = self.misses = self.failures = 0
        self.compile_times: deque[float] = deque(maxlen=1000)  # seconds, the most recent compiles

    def get_or_start(self, c: Constraint, capacity: int) -> tuple[Future, bool]:
        """The constraint's future, and whether this caller must compile it."""
        with self.lock:
            future = self.entries.get(c)
            if future is not None:
                self.entries.move_to_end(c)
                self.hits += 1
                return future, False
            self.misses += 1
            future = self.entries[c] = Future()
            while len(self.entries) > capacity:
                self.entries.popitem(last=False)
            return future, True

    def clear(self) -> None:
        with self.lock:
            self.entries.clear()

    def forget(self, c: Constraint, future: Future) -> None:
        with self.lock:
            self.failures += 1
            if self.entries.get(c) is future:
                del self.entries[c]

    def record(self, seconds: float) -> None:
        with self.lock:
            self.compile_times.append(seconds)


_cache = _Cache()
_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="constraint-compile")
_settings = EngineSettings()


def configure(settings: EngineSettings) -> None:
    """Take the compile time limit and cache size from the server's settings, and build the vocabulary's
    tables now rather than in the first constrained request (the engine calls this)."""
    global _settings
    if settings.structured_open_objects != _settings.structured_open_objects:
        _cache.clear()  # the cache is keyed by the constraint alone: its entries hold the other closing
    _settings = settings
    tokenizer()


def compile_constraint(c: Constraint) -> CompiledConstraint:
    """Compile (or take from a bounded LRU cache keyed by the constraint), with a time limit from
    config.EngineSettings; raises ConstraintError. Thread-safe. Called on the request thread before
    admission, so the engine loop never compiles."""
    future, mine = _cache.get_or_start(c, _settings.constraint_cache_size)
    if mine:
        try:
            future.set_result(_compile_within(c, _settings.constraint_compile_timeout_s))
        except BaseException as e:  # noqa: BLE001 - handed to the future: this caller and its waiters raise it
            _cache.forget(c, future)
            future.set_exception(e)
    return future.result()  # a waiter's compile finishes or fails within the same limit


def _compile_within(c: Constraint, timeout_s: float) -> CompiledConstraint:
    start = time.perf_counter()
    grammar = to_grammar(c)
    # llguidance releases the GIL while it builds a matcher; a pathological grammar runs on in the
    # pool's thread past the limit, but the request is refused at the limit
    building = _pool.submit(llguidance.LLMatcher, tokenizer(), grammar, log_level=0)
    try:
        matcher = building.result(timeout=timeout_s)
    except FutureTimeout:
        raise ConstraintError(f"compiling the constraint took longer than {timeout_s:g} s") from None
    if matcher.is_error():
        raise ConstraintError(f"invalid {_NAMES[c.kind]}: {matcher.get_error()}")
    seconds = time.perf_counter() - start
    _cache.record(seconds)
    return CompiledConstraint(c, grammar, matcher, seconds)


@dataclass(frozen=True, slots=True)
class CompileStats:
    compiles: int  # constraints compiled (cache misses that succeeded)
    failures: int  # constraints refused (invalid, or over the time limit)
    cache_hits: int
    mean_s: float  # over the most recent compiles (up to 1000)
    p99_s: float


def compile_stats() -> CompileStats:
    with _cache.lock:
        times = sorted(_cache.compile_times)
        hits, misses, failures = _cache.hits, _cache.misses, _cache.failures
    p99 = times[min(len(times) - 1, int(0.99 * len(times)))] if times else 0.0
    mean = sum(times) / len(times) if times else 0.0
    return CompileStats(misses - failures, failures, hits, mean, p99)
