"""The request path stays straight: one non-streamed /v1/completions, traced on its thread, passes through at
most MAX_FILES files of the project and enters none of them twice (docs/architecture.md walks the same path).

A step is a call of a function or method in another file. Constructing a record (`__init__`,
`__post_init__`) and reading one of its properties are not steps, and what a lower layer (batching/,
generate/, model/) does beneath the call the API layer makes into it is that layer's own business.
"""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
API_LAYER = ("api/", "app.py")
MAX_FILES = 9
CONSTRUCTION = frozenset({"__init__", "__post_init__", "__new__"})


def _project_file(frame) -> str | None:
    """The project's own source file the frame runs in; None for the tests and for libraries, also those of a
    virtual environment inside the checkout (.venv/, as CI makes it)."""
    path = Path(frame.f_code.co_filename)
    if not path.is_relative_to(ROOT):
        return None
    parts = path.relative_to(ROOT).parts
    if parts[0] == "tests" or any(p.startswith(".") or p == "site-packages" for p in parts):
        return None
    return "/".join(parts)


def _is_property(frame) -> bool:
    owner = frame.f_locals.get("self")
    return owner is not None and isinstance(getattr(type(owner), frame.f_code.co_name, None), property)


def traced_files(view) -> tuple[list[str], object]:
    """The files `view()` enters, in order (a file entered twice appears twice), and what it returned."""
    entered: list[str] = []

    def tracer(frame, event, arg):
        name = _project_file(frame)
        if event != "call" or name is None:
            return None
        caller = frame.f_back
        while caller is not None and _project_file(caller) is None:
            caller = caller.f_back
        caller_name = _project_file(caller) if caller is not None else None
        if caller_name is not None and not caller_name.startswith(API_LAYER):
            return None  # beneath a lower layer's entry point
        if caller_name != name and frame.f_code.co_name not in CONSTRUCTION and not _is_property(frame):
            entered.append(name)
        return None

    sys.settrace(tracer)
    try:
        result = view()
    finally:
        sys.settrace(None)
    return entered, result


def test_a_completion_crosses_few_files_and_none_twice(make_app):
    app, manager = make_app()
    view = app.view_functions["openai.completions"]
    path: list[str] = []

    def traced_view(**kwargs):
        files, result = traced_files(lambda: view(**kwargs))
        path.extend(files)
        return result

    app.view_functions["openai.completions"] = traced_view
    client = app.test_client()
    body = {"prompt": "The lighthouse keeper", "max_tokens": 4, "temperature": 0}
    try:
        assert client.post("/v1/completions", json=body).status_code == 200  # warm: first-call work is not the path
        path.clear()
        response = client.post("/v1/completions", json=body)
    finally:
        manager.shut_down(0)
    assert response.status_code == 200 and response.get_json()["usage"]["completion_tokens"] == 4
    assert path[0] == "api/openai.py" and "batching/manager.py" in path, path
    assert len(path) == len(set(path)), f"a file entered twice: {path}"
    assert len(path) <= MAX_FILES, path
