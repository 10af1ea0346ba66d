"""POST /inference: the original endpoint, prompt + num_tokens in, completion out."""

from flask import Blueprint, jsonify, request

from api.generation import to_generation
from api.protocol import InferenceBody, parse
from api.submission import run

routes = Blueprint("inference", __name__)


@routes.post("/inference")
def inference():
    body = parse(InferenceBody, request.get_json(silent=True), "/inference")
    generation = to_generation(body, body.prompt, body.num_tokens, "num_tokens")
    (completion,) = run(generation).completions
    text = generation.server.tokenizer.decode(completion.generated_ids)
    return jsonify(
        completion=body.prompt + text,
        text=text,
        token_ids=completion.generated_ids,
        prompt_tokens=len(generation.prompts[0]),
        completion_tokens=len(completion.generated_ids),
        finish_reason=completion.finish_reason,
        ttft_s=completion.ttft_s,
        latency_s=completion.latency_s,
    )
