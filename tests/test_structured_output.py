"""Structured output at the engine's entry point: every finished output fits its constraint, whatever
the sampling settings, chunking, preemption or stop strings; a constraint that admits everything changes
nothing; unconstrained rows beside constrained ones are unchanged; bad constraints are refused.

Outputs are checked by independent validators (jsonschema, re.fullmatch, lark), not by llguidance."""

import json
import re
import threading
import types

import jsonschema
import lark
import llguidance
import llguidance.torch
import pytest
import torch
from conftest import random_prompts
from test_model import make_engine, run_checked

from batching.text_stream import TextStream
from config import EngineSettings
from generate.constraint_compiler import ConstraintCompiler
from generate.constraints import VOCAB_SIZE, Constraint, ConstraintError
from generate.sequence import SamplingParams, Sequence
from model.tokenizer import EOT_ID, load_tokenizer

COMPILER = ConstraintCompiler(EngineSettings())  # an engine's, without the engine
compile_constraint, compile_stats = COMPILER.compile, COMPILER.stats

TOKENIZER = load_tokenizer()

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["red", "green", 7]}, "minItems": 1, "maxItems": 3},
        "pet": {"anyOf": [{"$ref": "#/$defs/pet"}, {"type": "null"}]},
    },
    "required": ["name", "age", "tags", "pet"],
    "additionalProperties": False,
    "$defs": {
        "pet": {
            "type": "object",
            "properties": {"kind": {"enum": ["cat", "dog"]}, "legs": {"type": "integer", "enum": [3, 4]}},
            "required": ["kind", "legs"],
            "additionalProperties": False,
        }
    },
}
REGEX = r"[a-z]{2,6}@[a-z]{2,5}\.(com|org)"
CHOICES = ["positive", "negative", "neutral"]
LARK = """
start: select_statement
select_statement: "SELECT " column " FROM " table " WHERE " column "=" NUMBER
column: "col_1" | "col_2"
table: "table_1" | "table_2"
NUMBER: /[1-9][0-9]?/
"""
EBNF = 'root ::= "(" item ("," item){0,3} ")"\nitem ::= [0-9] | "x"'
EBNF_REGEX = r"\(([0-9]|x)(,([0-9]|x)){0,3}\)"
TOOL = {"trigger": " CALL", "schema": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}}}
TOOL["schema"].update(required=["city"], additionalProperties=False)


def valid_schema_output(text: str) -> bool:
    try:
        jsonschema.validate(json.loads(text), SCHEMA)
    except (json.JSONDecodeError, jsonschema.ValidationError):
        return False
    return True


def valid_lark(text: str) -> bool:
    try:
        lark.Lark(LARK, start="start").parse(text)
    except lark.exceptions.LarkError:
        return False
    return True


def valid_tool_auto(text: str) -> bool:
    """Free text without the trigger, or free text, the trigger and the call's JSON."""
    head, trigger, call = text.partition(TOOL["trigger"])
    if not trigger:
        return True
    try:
        jsonschema.validate(json.loads(call), TOOL["schema"])
    except (json.JSONDecodeError, jsonschema.ValidationError):
        return False
    return True


# (constraint, validator of the finished text, whether the grammar is bounded: it always ends within MAX_TOKENS)
CASES = {
    "json_schema": (Constraint("json_schema", json.dumps(SCHEMA)), valid_schema_output),
    "regex": (Constraint("regex", REGEX), lambda text: re.fullmatch(REGEX, text) is not None),
    "choice": (Constraint("choice", json.dumps(CHOICES)), lambda text: text in CHOICES),
    "lark": (Constraint("lark", LARK), valid_lark),
    "ebnf": (Constraint("ebnf", EBNF), lambda text: re.fullmatch(EBNF_REGEX, text) is not None),
}
MAX_TOKENS = 120  # every grammar above ends well within this many tokens

SETTINGS = {
    "greedy": dict(temperature=0),
    "temperature_1": dict(temperature=1.0),
    "top_k_top_p": dict(temperature=0.9, top_k=40, top_p=0.8),
    "penalties_and_bias": dict(
        temperature=1.0, presence_penalty=1.5, frequency_penalty=0.5, repetition_penalty=1.3, logit_bias=((90, 8.0),)
    ),
    "logprobs": dict(temperature=1.0, logprobs=3),
}


def text_of(seq: Sequence) -> str:
    ids = seq.completion_ids
    return TOKENIZER.decode(ids[:-1] if ids and ids[-1] == EOT_ID else ids)


def constrained_group(
    prompt: list[int], constraint: Constraint, n: int, seed: int, max_tokens: int = MAX_TOKENS, **sampling
) -> list[Sequence]:
    """n completions of one prompt, as the API builds them (a leader and its forks), each with its own seed."""
    compiled = compile_constraint(constraint)
    params = [
        SamplingParams(max_tokens=max_tokens, seed=seed + i, stop_at_eos=True, constraint=compiled, **sampling)
        for i in range(n)
    ]
    leader = Sequence(list(prompt), params[0])
    return [leader] + [Sequence(list(prompt), p, fork_of=leader) for p in params[1:]]


def check_outputs(groups: dict[str, list[Sequence]]) -> None:
    for name, seqs in groups.items():
        validate = CASES[name][1]
        for seq in seqs:
            assert seq.finish_reason == "stop", (name, text_of(seq))
            assert EOT_ID not in seq.completion_ids[:-1]  # end-of-text only where the grammar ends
            assert validate(text_of(seq)), (name, text_of(seq))


@pytest.mark.parametrize("setting", SETTINGS)
def test_every_output_fits_its_constraint_under_chunking(tiny_checkpoint, setting):
    engine = make_engine(tiny_checkpoint, block_size=4, max_batch_tokens=24)  # 30-token prompts are chunked
    prompts = random_prompts([30] * len(CASES), seed=5)
    groups = {
        name: constrained_group(prompt, constraint, n=2, seed=10 * k, **SETTINGS[setting])
        for k, ((name, (constraint, _)), prompt) in enumerate(zip(CASES.items(), prompts))
    }
    run_checked(engine, [s for seqs in groups.values() for s in seqs])
    check_outputs(groups)
    assert any(r.num_prefills and r.num_prefill_tokens < 30 for r in engine.step_log.since(0))  # chunked
    if setting == "logprobs":  # the model's own log-probabilities: a masked-out token can be among the top
        assert all(len(s.logprobs) == s.num_generated for seqs in groups.values() for s in seqs)


def test_outputs_fit_under_preemption_and_resume_where_they_were(tiny_checkpoint):
    """A tiny KV pool preempts sequences mid-output; recomputed, each resumes its grammar where it was,
    token for token the output it has with room to spare."""
    prompts = random_prompts([9] * len(CASES), seed=6)

    def run(num_blocks: int):
        engine = make_engine(tiny_checkpoint, num_blocks=num_blocks, block_size=4, max_batch_tokens=64)
        groups = {
            name: constrained_group(prompt, constraint, n=3, seed=100 + k, max_tokens=60, temperature=1.0)
            for k, ((name, (constraint, _)), prompt) in enumerate(zip(CASES.items(), prompts))
        }
        run_checked(engine, [s for seqs in groups.values() for s in seqs])
        return engine, groups

    tight, preempted = run(num_blocks=20)  # a sequence needs up to 18
    roomy, alone = run(num_blocks=1024)
    assert tight.scheduler.num_preemptions > 0 and roomy.scheduler.num_preemptions == 0
    check_outputs(preempted)
    assert {k: [s.completion_ids for s in v] for k, v in preempted.items()} == {
        k: [s.completion_ids for s in v] for k, v in alone.items()
    }


def test_stop_string_cuts_a_constrained_output(tiny_checkpoint):
    engine = make_engine(tiny_checkpoint)
    compiled = compile_constraint(Constraint("choice", json.dumps(["alpha beta gamma", "delta beta"])))
    seqs = [
        Sequence(
            p,
            SamplingParams(max_tokens=20, temperature=1.0, seed=i, constraint=compiled),
            TextStream(TOKENIZER, [" beta"]),
        )
        for i, p in enumerate(random_prompts([5, 6, 7, 8], seed=7))
    ]
    run_checked(engine, seqs)
    assert all(s.finish_reason == "stop" and s.stop.text in ("alpha", "delta") for s in seqs)


def masked_greedy(hf_model, prompt: list[int], constraint: Constraint, max_tokens: int) -> list[int]:
    """The reference: transformers' logits over the whole sequence at every token, the best token the constraint's
    mask allows, fed to the constraint; until its grammar ends or max_tokens."""
    matcher, bitmask = compile_constraint(constraint).matcher(), llguidance.torch.allocate_token_bitmask(1, VOCAB_SIZE)
    ids, out = list(prompt), []
    while len(out) < max_tokens:
        with torch.no_grad():
            logits = hf_model(torch.tensor([ids])).logits[0, -1, :VOCAB_SIZE]
        llguidance.torch.fill_next_token_bitmask(matcher, bitmask, 0)
        allowed = (bitmask[0].view(-1, 1) >> torch.arange(32)) & 1  # [V / 32, 32]: bit t of word w is token 32w + t
        token = int(torch.where(allowed.flatten()[:VOCAB_SIZE] == 1, logits, -torch.inf).argmax())
        assert matcher.consume_token(token)
        ids.append(token)
        out.append(token)
        if matcher.is_stopped():
            break
    return out


@pytest.mark.parametrize("jump_forward", [True, False])
def test_tokens_the_grammar_forces_are_those_masked_greedy_draws(tiny_checkpoint, hf_model, jump_forward):
    """JUMP_FORWARD appends the tokens a grammar forces with the token drawn before them and computes them in
    the next step: the same tokens as transformers' masked greedy, in fewer steps than tokens (one drawn a step,
    off). A length cut inside a forced run ends there."""
    engine = make_engine(tiny_checkpoint, max_batch_tokens=64, jump_forward=jump_forward)
    constraints = [CASES["json_schema"][0], CASES["regex"][0], Constraint("regex", "ab?cdefghijklmnop[0-9]")]
    lengths = [MAX_TOKENS, MAX_TOKENS, 4]
    prompts = random_prompts([9, 12, 6], seed=21)
    seqs = [
        Sequence(list(p), SamplingParams(max_tokens=n, temperature=0, constraint=compile_constraint(c)))
        for p, c, n in zip(prompts, constraints, lengths, strict=True)
    ]
    run_checked(engine, seqs)
    assert [s.completion_ids for s in seqs] == [
        masked_greedy(hf_model, p, c, n) for p, c, n in zip(prompts, constraints, lengths, strict=True)
    ]
    assert seqs[2].finish_reason == "length" and seqs[2].num_generated == 4
    longest = max(s.num_generated for s in seqs)
    assert engine.num_steps < longest if jump_forward else engine.num_steps == longest


def test_forced_tokens_keep_seeded_draws_and_their_log_probabilities(tiny_checkpoint):
    """A seeded draw is keyed by its position, so the tokens drawn after a forced run are those drawn one a step;
    a request that wants log-probabilities has each token drawn (a forced one would have none)."""

    def run(jump_forward: bool, **sampling) -> tuple[list[list[int]], int]:
        engine = make_engine(tiny_checkpoint, max_batch_tokens=64, jump_forward=jump_forward)
        groups = [
            constrained_group(p, CASES[name][0], n=2, seed=30 + k, temperature=1.0, **sampling)
            for k, (name, p) in enumerate(zip(("json_schema", "regex"), random_prompts([8, 10], seed=22)))
        ]
        run_checked(engine, [s for group in groups for s in group])
        return [s.completion_ids for group in groups for s in group], engine.num_steps

    (jumped, jumped_steps), (drawn, drawn_steps) = run(True), run(False)
    assert jumped == drawn and jumped_steps < drawn_steps
    with_logprobs, steps = run(True, logprobs=1)
    assert with_logprobs == drawn and steps == drawn_steps


def test_end_of_text_only_where_the_grammar_may_end(tiny_checkpoint):
    """A large bias on end-of-text cannot end the output before the grammar allows it; a grammar that has
    ended ends the sequence even when end-of-text does not (stop_at_eos off)."""
    engine = make_engine(tiny_checkpoint)
    word = compile_constraint(Constraint("regex", "[a-z]{5}( [a-z]{3})?"))
    eager = [
        Sequence(
            p,
            SamplingParams(
                max_tokens=30, temperature=1.0, seed=i, stop_at_eos=True, logit_bias=((EOT_ID, 50.0),), constraint=word
            ),
        )
        for i, p in enumerate(random_prompts([4, 5, 6], seed=8))
    ]
    closed = [
        Sequence(p, SamplingParams(max_tokens=30, temperature=0, constraint=compile_constraint(CASES["choice"][0])))
        for p in random_prompts([4, 5], seed=9)
    ]
    run_checked(engine, eager + closed)
    for seq in eager:
        assert seq.finish_reason == "stop" and seq.completion_ids[-1] == EOT_ID
        assert re.fullmatch("[a-z]{5}( [a-z]{3})?", text_of(seq))
    for seq in closed:
        assert seq.finish_reason == "stop" and EOT_ID not in seq.completion_ids and text_of(seq) in CHOICES


PERMISSIVE = Constraint("lark", "start: <[0-50255]>*")  # any tokens; end-of-text wherever it comes


@pytest.mark.parametrize("setting", ["greedy", "top_k_top_p", "penalties_and_bias"])
def test_a_constraint_that_admits_everything_changes_nothing(tiny_checkpoint, setting):
    prompts = random_prompts([5, 17, 30], seed=11)

    def run(constraint):
        engine = make_engine(tiny_checkpoint, max_batch_tokens=16)
        compiled = constraint and compile_constraint(constraint)
        params = [
            SamplingParams(max_tokens=40, seed=i, stop_at_eos=True, constraint=compiled, **SETTINGS[setting])
            for i in range(len(prompts))
        ]
        seqs = [Sequence(list(p), sp) for p, sp in zip(prompts, params)]
        run_checked(engine, seqs)
        return [(s.completion_ids, s.finish_reason) for s in seqs]

    assert run(PERMISSIVE) == run(None)


def test_unconstrained_greedy_output_is_unchanged_beside_constrained_rows(tiny_checkpoint, hf_greedy):
    engine = make_engine(tiny_checkpoint, max_batch_tokens=32)
    free_prompts = random_prompts([7, 20, 33], seed=12)
    free = [Sequence(list(p), SamplingParams(max_tokens=25, temperature=0)) for p in free_prompts]
    constrained = [
        s
        for k, (constraint, _) in enumerate(c for c in CASES.values())
        for s in constrained_group(random_prompts([11], seed=k)[0], constraint, n=1, seed=k, temperature=1.0)
    ]
    run_checked(engine, [x for pair in zip(free, constrained) for x in pair] + constrained[len(free) :])
    assert [s.completion_ids for s in free] == [hf_greedy(p, 25) for p in free_prompts]
    masked = [r for r in engine.step_log.since(0) if "mask" in r.stages]
    assert masked and engine.grammar.stats.steps == len(masked) and engine.grammar.stats.constrained_requests == 5


def test_no_mask_work_without_constrained_rows(tiny_checkpoint):
    engine = make_engine(tiny_checkpoint)
    run_checked(engine, [Sequence(p, SamplingParams(max_tokens=5)) for p in random_prompts([3, 4], seed=13)])
    assert engine.grammar.stats.steps == 0 and engine.grammar._worker is None
    assert not any("mask" in r.stages for r in engine.step_log.since(0))


def test_tool_auto_is_free_text_until_the_trigger_then_the_call(tiny_checkpoint):
    """Biased towards the trigger (one token here), the model writes it; what follows is the call's JSON,
    and the grammar ends after it. Without the bias the text runs free and never holds the trigger."""
    (trigger,) = TOKENIZER.encode(TOOL["trigger"])
    compiled = compile_constraint(Constraint("tool_auto", json.dumps(TOOL)))
    prompts = random_prompts([5] * 6, seed=14)
    called, free = (
        [
            Sequence(
                list(p), SamplingParams(max_tokens=40, temperature=1.0, seed=i, logit_bias=bias, constraint=compiled)
            )
            for i, p in enumerate(prompts)
        ]
        for bias in (((trigger, 15.0),), ())
    )
    run_checked(make_engine(tiny_checkpoint), called + free)
    for seq in called:
        head, _, call = text_of(seq).partition(TOOL["trigger"])
        assert seq.finish_reason == "stop" and json.loads(call)["city"] in ("Paris", "Oslo"), text_of(seq)
    assert all(valid_tool_auto(text_of(s)) for s in called + free)


def test_same_constraint_compiles_once():
    constraint = Constraint("regex", "[0-9]{4}-once")
    before = compile_stats()
    first, second = compile_constraint(constraint), compile_constraint(constraint)
    after = compile_stats()
    assert first is second and after.cache_hits == before.cache_hits + 1 and after.compiles == before.compiles + 1


def test_deep_grammars_compile_or_are_refused_never_crash():
    # 3,000 chained rules (46 KB): llguidance's recursion overflowed a default 8 MiB thread stack (a
    # segfault: the whole server gone); on the compiler's deep stacks it builds
    chain = "\n".join(f'a{i}:a{i + 1}|"x"' for i in range(3000)) + '\na3000:"b"\nstart:a0'
    assert compile_constraint(Constraint("lark", chain)).constraint.spec == chain
    nested = '{"type":"array","items":' * 2000 + '{"type":"string"}' + "}" * 2000  # past Python's recursion
    with pytest.raises(ConstraintError, match="nested too deeply"):
        compile_constraint(Constraint("json_schema", nested))


def test_a_compile_over_the_time_limit_is_refused_not_cached_and_its_thread_replaced(monkeypatch):
    # Compiles of "held" grammars wait until the test lets them go: over any limit on any machine, however
    # fast the grammar compiles. Each one past its limit keeps its thread, and a fresh one takes its place
    # (up to MAX_OVERDUE): the compiler goes on compiling for everyone else.
    from generate import constraint_compiler

    release, matcher = threading.Event(), constraint_compiler.llguidance.LLMatcher

    def held_or_built(tokenizer, grammar, **kwargs):
        if "held" in grammar:
            release.wait(60)
        return matcher(tokenizer, grammar, **kwargs)

    monkeypatch.setattr(constraint_compiler, "llguidance", types.SimpleNamespace(LLMatcher=held_or_built))
    compiler = ConstraintCompiler(EngineSettings(constraint_compile_timeout_s=0.2))
    assert constraint_compiler.THREADS == constraint_compiler.MAX_OVERDUE == 2
    try:
        for i in range(3):  # the first two are replaced; the third keeps a replacement, the cap reached
            with pytest.raises(ConstraintError, match="longer than"):
                compiler.compile(Constraint("regex", f"held-{i}"))
            assert compiler.compile(Constraint("regex", f"[0-9]{{{i + 1}}}")).constraint.spec  # a thread is free
        with pytest.raises(ConstraintError, match="longer than"):
            compiler.compile(Constraint("regex", "held-3"))  # the last free thread
        with pytest.raises(constraint_compiler.CompilerBusy, match="no constraint compiler was free"):
            compiler.compile(Constraint("regex", "[a-z]+-waits"))
    finally:
        release.set()
    stats = compiler.stats()
    assert stats.failures == 5 and stats.compiles == 3
    assert compiler.compile(Constraint("regex", "held-0")).constraint.spec == "held-0"  # not cached as failed


@pytest.mark.parametrize(
    ("constraint", "words"),
    [
        (Constraint("json_schema", "{not json"), "not valid JSON"),
        (Constraint("json_schema", '{"type": "objekt"}'), "objekt"),
        (Constraint("json_schema", "[1, 2]"), "must be an object"),
        (Constraint("json_schema", '{"type": "string", "format": "no-such-format"}'), "format"),
        (Constraint("regex", "[a-"), "regular expression"),
        (Constraint("regex", ""), "empty"),
        (Constraint("choice", "[]"), "at least one"),
        (Constraint("choice", '["a", 3]'), "list of strings"),
        (Constraint("lark", "start: missing_rule"), "missing_rule"),
        (Constraint("lark", 'start: ("a"'), "Lark"),
        (Constraint("ebnf", "root ::= ((("), "EBNF"),
        (Constraint("tool_auto", '{"trigger": ""}'), "tool_auto"),
        (Constraint("xml", "<a/>"), "unknown constraint kind"),
        (Constraint("regex", "a+", whitespace_pattern=" "), "JSON constraints only"),
    ],
)
def test_bad_constraints_are_refused(constraint, words):
    with pytest.raises(ConstraintError, match=re.escape(words)):
        compile_constraint(constraint)


def test_the_simulated_engine_keeps_to_constraints_too():
    from sim.engine import simulated_engine

    engine = simulated_engine(EngineSettings(engine="sim", sim_model="gpt2", sim_gpu="h100-sxm"), announce=False)
    groups = {
        name: constrained_group(prompt, constraint, n=2, seed=k)
        for k, ((name, (constraint, _)), prompt) in enumerate(zip(CASES.items(), random_prompts([6] * 5, seed=15)))
    }
    run_checked(engine, [s for seqs in groups.values() for s in seqs])
    check_outputs(groups)
