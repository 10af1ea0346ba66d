"""POST /inference: the original endpoint, prompt + num_tokens in, completion out."""

from typing import Any

from flask import Blueprint, jsonify, request

from api import tenants
from api.openai_params import check_model
from api.priority import parse_priority
from api.serving import check_fits, server, submit, wait
from api.validation import bad, boolean, integer, json_object, known_fields, number, optional_seed
from batching.inference import Inference
from generate.sequence import SamplingParams
from model.tokenizer import encode_prompt

routes = Blueprint("inference", __name__)


FIELDS = ("prompt", "num_tokens", "temperature", "top_k", "top_p", "seed", "stop_at_eos", "priority", "user", "model")


def parse_inference(body: Any, max_context: int) -> tuple[str, SamplingParams, int]:
    body = json_object(body)
    known_fields(body, FIELDS, "/inference")
    prompt = body.get("prompt")
    if not isinstance(prompt, str) or not prompt:
        raise bad(f"'prompt' must be a non-empty string, got {prompt!r}", "prompt")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise bad(f"'user' must be a string, got {user!r}", "user")
    tenants.note_user(user)
    params = SamplingParams(
        max_tokens=integer(body, "num_tokens", None, 1, max_context),
        temperature=number(body, "temperature", 1.0, 0.0, 100.0),
        top_k=integer(body, "top_k", 0, 0, 50257),
        top_p=number(body, "top_p", 1.0, 1e-9, 1.0),
        seed=optional_seed(body),
        stop_at_eos=boolean(body, "stop_at_eos", False),
    )
    return prompt, params, parse_priority(body)


@routes.post("/inference")
def inference():
    srv = server()
    body = request.get_json(silent=True)
    prompt, params, priority = parse_inference(body, srv.engine.max_context)
    model = body.get("model")  # a LoRA adapter's name, or the base model's (or absent)
    if model is not None and not isinstance(model, str):
        raise bad(f"'model' must be a string, got {model!r}", "model")
    lora = check_model(model, srv)
    prompt_ids = encode_prompt(srv.tokenizer, prompt)
    check_fits(srv, len(prompt_ids), params.max_tokens, "num_tokens")
    inf = wait(srv, submit(srv, Inference(prompt_ids, params, priority=priority, tenant=tenants.current(), lora=lora)))
    text = srv.tokenizer.decode(inf.generated_ids)
    return jsonify(
        completion=prompt + text,
        text=text,
        token_ids=inf.generated_ids,
        prompt_tokens=len(prompt_ids),
        completion_tokens=len(inf.generated_ids),
        finish_reason=inf.finish_reason,
        ttft_s=inf.ttft_s,
        latency_s=inf.latency_s,
    )
