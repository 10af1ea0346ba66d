"""POST /tokenize and POST /detokenize, in vLLM's shapes: the server's own tokenizer, for clients that count
or build token-id prompts (lm-evaluation-harness among them)."""

from typing import Any

from flask import Blueprint, jsonify, request

from api.chat import parse_messages
from api.serving import server
from api.validation import bad, boolean, json_object, known_fields
from model.tokenizer import encode_prompt

routes = Blueprint("tokenize", __name__)


@routes.post("/tokenize")
def tokenize():
    """{"prompt": text} or {"messages": [...]} (through the chat template) -> the tokens, their count, the context."""
    srv = server()
    body = json_object(request.get_json(silent=True))
    known_fields(body, ("model", "prompt", "messages", "add_special_tokens", "add_generation_prompt"), "/tokenize")
    _check_model(body, srv.engine.model_name)
    boolean(body, "add_special_tokens", True)  # GPT-2 adds none either way
    if ("prompt" in body) == ("messages" in body):
        raise bad("give either 'prompt' (a string) or 'messages' (a chat)", "prompt")
    if "messages" in body:
        if not boolean(body, "add_generation_prompt", True):
            raise bad(
                "'add_generation_prompt' false is not supported: the template always opens the reply",
                "add_generation_prompt",
            )
        # message content is text, as /v1/chat/completions reads it
        tokens = srv.tokenizer.encode(srv.chat_template.render(parse_messages(body["messages"])), disallowed_special=())
    elif isinstance(body["prompt"], str):
        tokens = encode_prompt(srv.tokenizer, body["prompt"])
    else:
        raise bad("'prompt' must be a string", "prompt")
    return jsonify(tokens=tokens, count=len(tokens), max_model_len=srv.engine.max_context)


@routes.post("/detokenize")
def detokenize():
    """{"tokens": [ids]} -> {"prompt": their text}."""
    srv = server()
    body = json_object(request.get_json(silent=True))
    known_fields(body, ("model", "tokens"), "/detokenize")
    _check_model(body, srv.engine.model_name)
    tokens, vocab = body.get("tokens"), srv.tokenizer.n_vocab
    if not isinstance(tokens, list) or not all(type(t) is int and 0 <= t < vocab for t in tokens):
        raise bad(f"'tokens' must be a list of token ids below {vocab}", "tokens")
    return jsonify(prompt=srv.tokenizer.decode(tokens))


def _check_model(body: dict, served: str) -> None:
    model: Any = body.get("model")
    if model is not None and model != served:
        raise bad(f"'model' must be {served!r} (the served model) or omitted, got {model!r}", "model")
