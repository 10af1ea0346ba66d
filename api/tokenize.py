"""POST /tokenize and POST /detokenize, in vLLM's shapes: the server's own tokenizer, for clients that count
or build token-id prompts (lm-evaluation-harness among them)."""

from flask import Blueprint, jsonify, request

from api.chat import parse_messages
from api.openai_params import check_model
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
    check_model(body.get("model"), srv)
    boolean(body, "add_special_tokens", True)  # GPT-2 adds none either way
    if ("prompt" in body) == ("messages" in body):
        raise bad("give either 'prompt' (a string) or 'messages' (a chat)", "prompt")
    if "messages" in body:
        if not boolean(body, "add_generation_prompt", True):
            raise bad(
                "'add_generation_prompt' false is not supported: the template always opens the reply",
                "add_generation_prompt",
            )
        text = parse_messages(body["messages"], srv.chat_template)
        # message content is text, as /v1/chat/completions reads it
        tokens = srv.tokenizer.encode(text, disallowed_special=())
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
    check_model(body.get("model"), srv)
    tokens, vocab = body.get("tokens"), srv.tokenizer.n_vocab
    if not isinstance(tokens, list) or not all(type(t) is int and 0 <= t < vocab for t in tokens):
        raise bad(f"'tokens' must be a list of token ids below {vocab}", "tokens")
    return jsonify(prompt=srv.tokenizer.decode(tokens))
