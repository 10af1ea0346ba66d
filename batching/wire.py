"""The messages between the HTTP front end and the engine process (ENGINE_PROCESS=on), declared once.

msgpack through msgspec, as vLLM's engine core speaks: plain numbers, strings and lists, each message a tagged
array, so nothing a client sent is ever unpickled and a step's message stays a few bytes a row. Each front end
(a gunicorn worker; API_SERVER_COUNT of them) says Hello with its process id, its name in every message after;
then it sends Submit, Cancel and Call. The engine answers Hello with Ready, then sends each front end batches
(lists) of Ack, Tokens, Ended, Reply and Status, each what one of its threads had for that front end at once: a
step's tokens leave together, as one Tokens of ids, with the Ended of what the step ended; the front end makes
their text. Each batch is one message on the front end's connection (batching/channel.py). A completion that is
not streamed has only its first token sent with its step (its time to first token), the rest with its Ended:
nobody reads them sooner, and a step then costs the front ends nothing for it.
"""

import msgspec


class Params(msgspec.Struct, array_like=True):
    """generate.sequence.SamplingParams, its constraint as the Constraint it was compiled from (kind, spec,
    whitespace pattern): the engine compiles it again, from its own cache."""

    max_tokens: int
    temperature: float
    top_k: int
    top_p: float
    seed: int | None
    stop_at_eos: bool
    logprobs: int | None
    prompt_logprobs: int | None
    min_tokens: int
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    logit_bias: list[tuple[int, float]]
    constraint: tuple[str, str, str | None] | None


class Completion(msgspec.Struct, array_like=True):
    prompt_ids: list[int]
    params: Params
    forks: bool  # forks from the last completion before it that does not (n completions of one prompt)
    faulty: bool  # FAULT_FAIL_MARKER: its text stream fails in its first step (tests)


class Hello(msgspec.Struct, tag="hello", array_like=True):
    """A front end, by its process id, its connection's first message: the engine answers Ready on it, sends it
    everything meant for that front end, and cancels its requests when it closes."""

    client: int


class Submit(msgspec.Struct, tag="submit", array_like=True):
    client: int
    rid: int
    completions: list[Completion]
    stop: list[str]
    priority: int
    tenant: str
    lora: str | None
    streamed: bool  # its completions' tokens each go with their step; else only the first (the rest with Ended)


class Cancel(msgspec.Struct, tag="cancel", array_like=True):
    client: int
    rid: int
    indices: list[int]


class Call(msgspec.Struct, tag="call", array_like=True):
    """A report the engine's process computes (batching/telemetry/reports.py), or a LoRA adapter to load or unload
    ("load_lora", "unload_lora"), answered by a Reply with the same id."""

    client: int
    cid: int
    name: str
    args: list


class Stop(msgspec.Struct, tag="stop", array_like=True):
    """From the front end that started the engine (API_SERVER_COUNT=1), on SIGTERM: drain, then exit."""

    grace_s: float


ToEngine = Hello | Submit | Cancel | Call | Stop

Logprobs = list[tuple[float, list[tuple[int, float]]]]  # generate.sequence.TokenLogprobs, one per token


Adapter = tuple[str, str, int, int]  # a LoRA adapter's (name, path, id, rank)


class Ready(msgspec.Struct, tag="ready", array_like=True):
    """The answer to Hello: what the front end checks and reports without asking (the served model, the cache's
    size), and the engine's process (watched for its end) and how many engines died before it."""

    pid: int
    restarts: int
    model_name: str
    is_random: bool
    max_context: int
    cache_tokens: int  # every KV block's tokens: no request longer than this can ever run
    loras: list[Adapter]


class Ack(msgspec.Struct, tag="ack", array_like=True):
    rid: int
    # None: queued; else (kind, status, message, retry after s, reason), kind "refused" (admission) or "closed"
    refusal: tuple[str, int, str, int, str] | None


class Tokens(msgspec.Struct, tag="tokens", array_like=True):
    """A step's new tokens for one front end's completions, as columns: row i is token ids[i] of completion
    indices[i] of request rids[i]. Numbers only, a few bytes a row; the rare extras by row: the token's
    log-probabilities for a completion that asked, its prompt's with a completion's first token."""

    rids: list[int]
    indices: list[int]
    ids: list[int]
    logprobs: list[tuple[int, Logprobs]]
    prompt_logprobs: list[tuple[int, Logprobs]]


class Ended(msgspec.Struct, tag="ended", array_like=True):
    """How a completion ended (after the Tokens that carried its last token sent): its answer follows."""

    rid: int
    index: int
    finish_reason: str | None
    error: str | None
    num_cached_prompt_tokens: int | None
    prompt_logprobs: Logprobs  # its prompt's, if asked and no token carried them (none was generated)
    ids: list[int]  # a completion not streamed: its tokens after the first (no Tokens carried them)
    logprobs: Logprobs  # and theirs, if asked


class Reply(msgspec.Struct, tag="reply", array_like=True):
    cid: int
    value: object
    error: tuple[str, str] | None = None  # the exception's class name and message


class Status(msgspec.Struct, tag="status", array_like=True):
    """Sent every STATUS_S: what /health and /ready read, and admission's count of waiting requests."""

    problem: str | None
    ready: bool
    num_waiting: int
    num_running: int
    loras: list[Adapter]  # every adapter loaded now: one loaded through another front end shows here too


FromEngine = Ready | Ack | Tokens | Ended | Reply | Status
STATUS_S = 0.25
