"""What every generation endpoint does: hand an inference to the manager, wait for it."""

from dataclasses import dataclass

import tiktoken
from flask import current_app

from api.chat_template import ChatTemplate
from api.validation import ApiError
from batching.admission import Refused
from batching.inference import Inference
from batching.manager import BatchingManager, NotServing
from config import Settings
from generate.engine import Engine


@dataclass(frozen=True, slots=True)
class Server:
    settings: Settings
    engine: Engine
    manager: BatchingManager
    tokenizer: tiktoken.Encoding
    chat_template: ChatTemplate


def server() -> Server:
    return current_app.extensions["server"]


def check_fits(srv: Server, num_prompt_tokens: int, max_tokens: int, param: str, where: str = "") -> None:
    problem = srv.engine.check_fits(num_prompt_tokens, max_tokens)
    if problem:
        raise ApiError(400, where + problem, param=param)


def submit(srv: Server, *infs: Inference) -> Inference:
    """Queue one request's inferences (they enter the engine together); the first of them."""
    try:
        return srv.manager.enqueue(*infs)[0]
    except Refused as err:
        raise ApiError(err.status, str(err), "overloaded", headers={"Retry-After": str(err.retry_after)}) from None
    except NotServing as err:
        raise ApiError(503, str(err), "unavailable") from None


def wait(srv: Server, inf: Inference) -> Inference:
    """The finished inference; past REQUEST_TIMEOUT_S it is aborted (blocks freed) and 504 answered."""
    timeout = srv.settings.request_timeout_s
    if not inf.done.wait(timeout):
        srv.manager.cancel(inf)
        inf.done.wait()
    if inf.error == "cancelled":
        raise ApiError(504, f"no answer within {timeout} s", "timeout")
    if inf.error:
        raise ApiError(500, inf.error, "server_error")
    return inf
