"""HTTP front of the batching server: Flask routes over one BatchingManager per process."""

import logging
import math
from typing import Any

from flask import Flask, jsonify, request
from werkzeug.exceptions import HTTPException

from batching.manager import BatchingManager, NotServing, QueueFull
from config import Settings
from generate.engine import Engine
from generate.sequence import SamplingParams
from model.tokenizer import load_tokenizer

log = logging.getLogger(__name__)

MAX_SEED = 2**63 - 1


class BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def error(status: int, message: str, kind: str, param: str | None = None, headers: dict | None = None):
    body = {"error": {"message": message, "type": kind, "param": param, "code": status}}
    return jsonify(body), status, headers or {}


# --- validation ------------------------------------------------------------------------
def _integer(body: dict, name: str, default: Any, low: int, high: int) -> int:
    value = body.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequest(f"'{name}' must be an integer, got {value!r}", name)
    if not low <= value <= high:
        raise BadRequest(f"'{name}' must be between {low} and {high}, got {value}", name)
    return value


def _number(body: dict, name: str, default: float, low: float, high: float) -> float:
    value = body.get(name, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise BadRequest(f"'{name}' must be a finite number, got {value!r}", name)
    if not low <= value <= high:
        raise BadRequest(f"'{name}' must be between {low} and {high}, got {value}", name)
    return float(value)


def parse_inference(body: Any, max_context: int) -> tuple[str, SamplingParams]:
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    prompt = body.get("prompt")
    if not isinstance(prompt, str) or not prompt:
        raise BadRequest(f"'prompt' must be a non-empty string, got {prompt!r}", "prompt")
    stop_at_eos = body.get("stop_at_eos", False)
    if not isinstance(stop_at_eos, bool):
        raise BadRequest(f"'stop_at_eos' must be true or false, got {stop_at_eos!r}", "stop_at_eos")
    seed = body.get("seed")
    params = SamplingParams(
        max_tokens=_integer(body, "num_tokens", None, 1, max_context),
        temperature=_number(body, "temperature", 1.0, 0.0, 100.0),
        top_k=_integer(body, "top_k", 0, 0, 50257),
        top_p=_number(body, "top_p", 1.0, 1e-9, 1.0),
        seed=None if seed is None else _integer(body, "seed", None, 0, MAX_SEED),
        stop_at_eos=stop_at_eos,
    )
    return prompt, params


# --- the app ---------------------------------------------------------------------------
def create_app(settings: Settings | None = None) -> Flask:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings = settings or Settings.from_env()
    log.info("settings: %s", settings)
    engine = Engine.from_settings(settings)
    manager = BatchingManager(engine, settings)
    manager.start()
    tokenizer = load_tokenizer()

    app = Flask(__name__)
    app.config["MAX_CONTENT_LENGTH"] = settings.max_body_bytes
    app.extensions["manager"] = manager

    @app.errorhandler(HTTPException)
    def http_error(err: HTTPException):
        return error(err.code or 500, err.description or err.name, type(err).__name__)

    @app.errorhandler(BadRequest)
    def bad_request(err: BadRequest):
        return error(400, str(err), "invalid_request_error", err.param)

    @app.post("/inference")
    def inference():
        prompt, params = parse_inference(request.get_json(silent=True), engine.max_context)
        prompt_ids = tokenizer.encode(prompt, disallowed_special=())
        problem = engine.check_fits(len(prompt_ids), params.max_tokens)
        if problem:
            raise BadRequest(problem, "num_tokens")
        try:
            inf = manager.enqueue(prompt_ids, params)
        except QueueFull as err:
            return error(503, str(err), "overloaded", headers={"Retry-After": "1"})
        except NotServing as err:
            return error(503, str(err), "unavailable")
        if not inf.done.wait(settings.request_timeout_s):
            manager.cancel(inf)
            inf.done.wait()
            if inf.error == "cancelled":
                return error(504, f"no answer within {settings.request_timeout_s} s", "timeout")
        if inf.error:
            return error(500, inf.error, "server_error")
        text = tokenizer.decode(inf.generated_ids)
        return jsonify(
            completion=prompt + text,
            text=text,
            token_ids=inf.generated_ids,
            prompt_tokens=len(prompt_ids),
            completion_tokens=len(inf.generated_ids),
            finish_reason=inf.seq.finish_reason,
            ttft_s=inf.ttft_s,
            latency_s=inf.latency_s,
        )

    @app.get("/stats")
    def stats():
        blocks, scheduler = engine.blocks, engine.scheduler
        admitted = scheduler.prompt_tokens_admitted
        return jsonify(
            mode=settings.mode,
            model=engine.model_name,
            requests_running=manager.num_running(),
            requests_waiting=manager.num_waiting(),
            kv_blocks_used=blocks.num_used_blocks,
            kv_blocks_total=blocks.num_blocks,
            kv_blocks_cached=blocks.num_cached_blocks,
            kv_blocks_evictable=blocks.num_evictable_blocks,
            prefix_cache=settings.prefix_cache,
            prefix_cache_hit_rate=scheduler.prompt_tokens_cached / admitted if admitted else 0.0,
            evictions=blocks.evictions,
            preemptions=scheduler.num_preemptions,
            steps=engine.num_steps,
            **manager.stats.snapshot(),
        )

    @app.get("/health")
    def health():
        body = {"model": engine.model_name, "random_weights": engine.is_random, "mode": settings.mode}
        if not manager.ready:
            return jsonify(status="unavailable", reason=manager.failure, **body), 503
        return jsonify(status="ok", **body)

    return app
