"""POST /tokenize and POST /detokenize, in vLLM's shapes: the server's own tokenizer, for clients that count
or build token-id prompts (lm-evaluation-harness among them)."""

from flask import Blueprint, jsonify, request

from api.chat import render
from api.chat_protocol import TokenizeBody
from api.errors import bad
from api.generation import check_model, server
from api.protocol import DetokenizeBody, parse
from model.tokenizer import encode_prompt

routes = Blueprint("tokenize", __name__)


@routes.post("/tokenize")
def tokenize():
    """{"prompt": text} or {"messages": [...]} (through the chat template) -> the tokens, their count, the context."""
    body = parse(TokenizeBody, request.get_json(silent=True), "/tokenize")
    served = server()
    check_model(body.model, served)
    if (body.prompt is None) == (body.messages is None):
        raise bad("give either 'prompt' (a string) or 'messages' (a chat)", "prompt")
    if body.messages is not None:
        if not body.messages:
            raise bad("'messages' must be a non-empty list of messages", "messages")
        if not body.add_generation_prompt:
            raise bad(
                "'add_generation_prompt' false is not supported: the template always opens the reply",
                "add_generation_prompt",
            )
        # message content is text, as /v1/chat/completions reads it
        tokens = served.tokenizer.encode(render(body.messages, served.chat_template), disallowed_special=())
    else:
        tokens = encode_prompt(served.tokenizer, body.prompt)
    return jsonify(tokens=tokens, count=len(tokens), max_model_len=served.engine.max_context)


@routes.post("/detokenize")
def detokenize():
    """{"tokens": [ids]} -> {"prompt": their text}."""
    body = parse(DetokenizeBody, request.get_json(silent=True), "/detokenize")
    served = server()
    check_model(body.model, served)
    vocab = served.tokenizer.n_vocab
    if not all(0 <= t < vocab for t in body.tokens):
        raise bad(f"'tokens' must be a list of token ids below {vocab}", "tokens")
    return jsonify(prompt=served.tokenizer.decode(body.tokens))
