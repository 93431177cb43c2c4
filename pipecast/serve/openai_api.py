"""The OpenAI completions and chat completions APIs, mapped to and from the engine: request checking and
response bodies (pure).

``POST /v1/completions`` takes ``model``, ``prompt`` (a string, token ids, or a list holding one of them),
``max_tokens`` (default 16), ``temperature`` (default 1), ``top_p``, ``stop`` (a string or a list),
``seed``, ``stream`` and ``stream_options.include_usage``; ``return_token_ids`` (as vLLM) adds the
generated token ids to each choice. ``POST /v1/chat/completions`` takes ``messages`` (each a ``role`` and
its ``content``: a string, or a list of text parts; an answer's fields such as ``tool_calls`` and ``refusal``
only when null) instead of ``prompt``, and ``max_completion_tokens``
as well as ``max_tokens`` (default: as many as the model's positions leave, at most 4,096); the worker
renders the messages with the package's chat template. Parameters the engine cannot honour (``n`` > 1, ``logprobs``,
``echo``, penalties, ``logit_bias``, ``suffix``, tools) are refused with a 400 naming the field rather
than silently ignored, as are unknown fields. Every malformed value (a wrong type, a number out of range,
a body that is not strict JSON) is a 400 naming the field, never a 500.
"""

import json
import math
from dataclasses import dataclass
from typing import Any

from pipecast.core.strictjson import JSONInputError, describe
from pipecast.engine.sampling import MAX_SEED, MIN_SEED
from pipecast.serve.errors import RequestFieldError, ServeError

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for completions
MAX_TEMPERATURE = 2.0
#: Most stop strings per request (OpenAI allows 4); each is checked against the text after every token.
MAX_STOPS = 16
#: Longest stop string: the text held back while it may begin one is checked against it after every token.
MAX_STOP_CHARS = 256
SSE_DONE = b"data: [DONE]\n\n"

# Accepted only at the value that means "off" (the engine has no such feature): field -> accepted values (the
# penalties are numbers: clients typed with floats send 0.0).
_OFF_ONLY: dict[str, tuple[Any, ...]] = {
    "n": (None, 1), "best_of": (None, 1), "echo": (None, False), "logprobs": (None,), "suffix": (None, ""),
    "presence_penalty": (None, 0, 0.0), "frequency_penalty": (None, 0, 0.0), "logit_bias": (None, {}),
}
_KNOWN = {"model", "prompt", "max_tokens", "temperature", "top_p", "stop", "seed", "stream", "stream_options",
          "return_token_ids", "user", *_OFF_ONLY}
_CHAT_OFF_ONLY: dict[str, tuple[Any, ...]] = {
    **{name: accepted for name, accepted in _OFF_ONLY.items() if name not in ("best_of", "echo", "suffix", "logprobs")},
    "logprobs": (None, False), "top_logprobs": (None, 0), "tools": (None, []), "tool_choice": (None, "none"),
    "response_format": (None, {"type": "text"}),
}
_CHAT_KNOWN = {"model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "stop", "seed",
               "stream", "stream_options", "return_token_ids", "user", *_CHAT_OFF_ONLY}
# Fields of a message as OpenAI's client gives an answer back (``message.model_dump()``), accepted at the values that
# say nothing, so an answer can be sent back as a turn of the conversation: field -> accepted values.
_MESSAGE_OFF_ONLY: dict[str, tuple[Any, ...]] = {
    "annotations": (None, []), "audio": (None,), "function_call": (None,), "refusal": (None,), "tool_calls": (None, []),
}
#: Roles a chat message may have (what chat templates know).
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
#: Most messages per chat request.
MAX_MESSAGES = 1024


@dataclass(frozen=True)
class ChatMessage:
    """One message of a chat request: its role and its text."""

    role: str
    content: str


@dataclass(frozen=True)
class CompletionRequest:
    """A checked completion request; a chat request's prompt is its messages (``chat``), rendered by the
    worker with the model's chat template. ``max_tokens`` None: as many as the model's positions leave, at most
    4,096 (the worker's ``UNBOUNDED_MAX_TOKENS``)."""

    model: str
    prompt: str | tuple[int, ...] | tuple[ChatMessage, ...]
    max_tokens: int | None = DEFAULT_MAX_TOKENS
    temperature: float = 1.0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    seed: int | None = None
    stream: bool = False
    include_usage: bool = False  # streaming: a last chunk carrying usage
    return_token_ids: bool = False
    chat: bool = False
    max_tokens_field: str = "max_tokens"  # the field max_tokens came from (a chat's max_completion_tokens too)


def json_error(exc: JSONInputError) -> RequestFieldError:
    """The 400 of a body that :func:`pipecast.core.strictjson.loads` refused (duplicate keys, deep nesting,
    ``NaN`` or ``1e400`` included)."""
    return RequestFieldError(None, f"the request body is not valid JSON ({exc})")


def parse_completion_request(body: Any) -> CompletionRequest:
    """Check a decoded ``/v1/completions`` body; :class:`RequestFieldError` names the first bad field."""
    common = _common_fields(body, _KNOWN, _OFF_ONLY)
    max_tokens = _integer(body, "max_tokens", DEFAULT_MAX_TOKENS)
    if max_tokens < 1:
        raise RequestFieldError("max_tokens", f"must be at least 1, got {_short(max_tokens)}")
    return CompletionRequest(prompt=_prompt(body.get("prompt")), max_tokens=max_tokens, **common)


def parse_chat_request(body: Any) -> CompletionRequest:
    """Check a decoded ``/v1/chat/completions`` body; :class:`RequestFieldError` names the first bad field."""
    common = _common_fields(body, _CHAT_KNOWN, _CHAT_OFF_ONLY)
    limits = {name: _integer(body, name, 0) for name in ("max_completion_tokens", "max_tokens") if name in body
              and body[name] is not None}
    for name, value in limits.items():
        if value < 1:
            raise RequestFieldError(name, f"must be at least 1, got {_short(value)}")
    field = "max_completion_tokens" if "max_completion_tokens" in limits else "max_tokens"
    return CompletionRequest(prompt=_messages(body.get("messages")), max_tokens=limits.get(field), chat=True,
                             max_tokens_field=field, **common)


def _common_fields(body: Any, known: set[str], off_only: dict[str, tuple[Any, ...]]) -> dict[str, Any]:
    """The fields both APIs share, checked, as :class:`CompletionRequest` keywords."""
    if not isinstance(body, dict):
        raise RequestFieldError(None, f"the request body must be a JSON object, got {type(body).__name__}")
    unknown = sorted(set(body) - known)
    if unknown:
        raise RequestFieldError(unknown[0], f"unknown field (this worker accepts {', '.join(sorted(known))})")
    _check_off_only(body, off_only)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise RequestFieldError("model", "required: the name of the served model (see GET /v1/models)")
    stream = _boolean(body, "stream")
    stream_options = body.get("stream_options")
    if stream_options is not None:
        if not stream:
            raise RequestFieldError("stream_options", "only allowed with stream: true")
        if not isinstance(stream_options, dict) or set(stream_options) - {"include_usage"}:
            raise RequestFieldError("stream_options", 'must be an object like {"include_usage": true}')
    if body.get("user") is not None and not isinstance(body["user"], str):  # null: as for the other optional fields
        raise RequestFieldError("user", "must be a string")
    temperature = _number(body, "temperature", 1.0)
    if not 0 <= temperature <= MAX_TEMPERATURE:
        raise RequestFieldError("temperature", f"must be between 0 and {MAX_TEMPERATURE:g}, got {temperature:g}")
    top_p = _number(body, "top_p", 1.0)
    if not 0 < top_p <= 1:
        raise RequestFieldError("top_p", f"must be in (0, 1], got {top_p:g}")
    seed = body.get("seed")
    if seed is not None:
        seed = _integer(body, "seed", 0)
        if not MIN_SEED <= seed <= MAX_SEED:
            raise RequestFieldError("seed", f"must be an integer from -2^63 to 2^64-1, got {_short(seed)}")
    return {"model": model, "temperature": temperature, "top_p": top_p, "stop": _stop(body.get("stop")),
            "seed": seed, "stream": stream,
            "include_usage": bool(stream_options and _boolean(stream_options, "include_usage", "stream_options.")),
            "return_token_ids": _boolean(body, "return_token_ids")}


def _check_off_only(body: dict, off_only: dict[str, tuple[Any, ...]], where: str = "") -> None:
    """Refuse a field of ``off_only`` at a value other than those it accepts (``where`` prefixes its name)."""
    for name, accepted in off_only.items():
        value = body.get(name)
        # Compared with their types: 1 == True in Python, but "n": true is not "n": 1.
        if not any(type(value) is type(a) and value == a for a in accepted):
            raise RequestFieldError(f"{where}{name}", f"{_shown(value)} is not supported (accepted: "
                                                      f"{' or '.join(json.dumps(a) for a in accepted)})")


def _messages(value: Any) -> tuple[ChatMessage, ...]:
    if not isinstance(value, list) or not value:
        raise RequestFieldError("messages", "required: a non-empty list of {role, content} objects")
    if len(value) > MAX_MESSAGES:
        raise RequestFieldError("messages", f"at most {MAX_MESSAGES} messages, got {len(value)}")
    messages = []
    for i, item in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(item, dict) or item.get("role") not in CHAT_ROLES:
            raise RequestFieldError(where, f"must be an object whose role is one of {', '.join(CHAT_ROLES)}")
        unknown = sorted(set(item) - {"role", "content", "name", *_MESSAGE_OFF_ONLY})
        if unknown:
            raise RequestFieldError(f"{where}.{unknown[0]}", "is not supported (a message has role, content, name)")
        _check_off_only(item, _MESSAGE_OFF_ONLY, f"{where}.")
        if item.get("name") is not None and not isinstance(item["name"], str):  # as OpenAI's API has it (null:
            # none); the chat template drops it
            raise RequestFieldError(f"{where}.name", f"must be a string, got {describe(item['name'])}")
        messages.append(ChatMessage(item["role"], _content(item.get("content"), f"{where}.content")))
    return tuple(messages)


def _content(value: Any, where: str) -> str:
    """A message's text: a string, or a list of ``{"type": "text", "text": ...}`` parts joined by newlines (as
    vLLM joins them)."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                       and isinstance(p.get("text"), str) and set(p) == {"type", "text"}
                                       for p in value):
        return "\n".join(p["text"] for p in value)
    raise RequestFieldError(where, 'must be a string or a list of {"type": "text", "text": ...} parts (this model '
                                   "reads text only)")


def _prompt(value: Any) -> str | tuple[int, ...]:
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
        value = value[0]  # a batch of one prompt
    if isinstance(value, str):
        if not value:
            raise RequestFieldError("prompt", "is empty")
        return value
    if isinstance(value, list) and value and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        return tuple(value)
    if isinstance(value, list) and len(value) > 1 and all(isinstance(p, (str, list)) for p in value):
        raise RequestFieldError("prompt", f"one prompt per request, got a batch of {len(value)}")
    raise RequestFieldError("prompt", "required: a non-empty string or a non-empty list of token ids")


def _stop(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise RequestFieldError("stop", "must be a non-empty string or a list of non-empty strings")
    if len(stops) > MAX_STOPS:
        raise RequestFieldError("stop", f"at most {MAX_STOPS} stop strings, got {len(stops)}")
    if any(len(s) > MAX_STOP_CHARS for s in stops):
        raise RequestFieldError("stop", f"a stop string has at most {MAX_STOP_CHARS} characters")
    return tuple(dict.fromkeys(stops))


def _boolean(body: dict, name: str, where: str = "") -> bool:
    """``body[name]`` (absent or null: false); ``where``: the object holding it, for the error's field name."""
    value = body.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise RequestFieldError(f"{where}{name}", f"must be true or false, got {describe(value)}")
    return value


def _integer(body: dict, name: str, default: int) -> int:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestFieldError(name, f"must be an integer, got {describe(value)}")
    return value


def _number(body: dict, name: str, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise RequestFieldError(name, f"must be a number, got {describe(value)}")
    try:
        number = float(value)
    except OverflowError:  # an integer of hundreds of digits
        number = math.inf
    if not math.isfinite(number):
        raise RequestFieldError(name, f"must be a finite number, got {_short(value)}")
    return number


def _shown(value: Any) -> str:
    """A value as JSON for a message, cut short (a nested one never in full: it may nest hundreds deep)."""
    text = describe(value) if isinstance(value, list | dict) else json.dumps(value)
    return text if len(text) <= 60 else f"{text[:57]}..."


def _short(value: Any) -> str:
    """A value for a message: an integer of thousands of digits is cut short."""
    text = str(value) if isinstance(value, int) and not isinstance(value, bool) else describe(value)
    return text if len(text) <= 40 else f"{text[:20]}...({len(text)} digits)"


# --- responses ---------------------------------------------------------------------------------------


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    """The ``usage`` object of a response."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _choice(text: str, finish_reason: str | None, token_ids: list[int] | None) -> dict:
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return choice


def completion_body(request_id: str, created: int, model: str, text: str, finish_reason: str,
                    token_ids: list[int] | None, prompt_tokens: int, completion_tokens: int) -> dict:
    """The whole answer of a non-streaming request."""
    return {"id": request_id, "object": "text_completion", "created": created, "model": model,
            "choices": [_choice(text, finish_reason, token_ids)], "usage": usage(prompt_tokens, completion_tokens)}


def chunk_body(request_id: str, created: int, model: str, text: str, finish_reason: str | None,
               token_ids: list[int] | None) -> dict:
    """One streamed chunk: new text (and token ids), and the finish reason on the last one."""
    return {"id": request_id, "object": "text_completion", "created": created, "model": model,
            "choices": [_choice(text, finish_reason, token_ids)]}


def usage_chunk_body(request_id: str, created: int, model: str, prompt_tokens: int, completion_tokens: int,
                     chat: bool = False) -> dict:
    """The streamed chunk after the last one when ``stream_options.include_usage`` is set (of a chat
    request's stream with ``chat``)."""
    return {"id": request_id, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
            "model": model, "choices": [], "usage": usage(prompt_tokens, completion_tokens)}


def chat_completion_body(request_id: str, created: int, model: str, text: str, finish_reason: str,
                         token_ids: list[int] | None, prompt_tokens: int, completion_tokens: int) -> dict:
    """The whole answer of a non-streaming chat request."""
    choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
              "finish_reason": finish_reason}
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return {"id": request_id, "object": "chat.completion", "created": created, "model": model,
            "choices": [choice], "usage": usage(prompt_tokens, completion_tokens)}


def chat_chunk_body(request_id: str, created: int, model: str, text: str, finish_reason: str | None,
                    token_ids: list[int] | None, first: bool = False) -> dict:
    """One streamed chat chunk: the new text as the delta (the first also says the role), and the finish
    reason on the last one."""
    delta = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
    choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [choice]}


def error_body(error: ServeError) -> dict:
    """The OpenAI error object of ``error``."""
    return {"error": {"message": str(error), "type": error.kind, "param": error.param, "code": error.code}}


def models_body(models: list[tuple[str, str]], created: int) -> dict:
    """``GET /v1/models``: each served model as (name, package id)."""
    return {"object": "list", "data": [{"id": name, "object": "model", "created": created, "owned_by": "pipecast",
                                        "root": package_id} for name, package_id in models]}


def sse(payload: dict) -> bytes:
    """One Server-Sent Event carrying ``payload`` as JSON."""
    return b"data: " + json.dumps(payload).encode() + b"\n\n"
