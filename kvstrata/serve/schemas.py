"""Request bodies of /v1/completions and /v1/chat/completions, validated strictly at the edge.

Types are strict (`"5"` is not a number, `1` is not a boolean, NaN is not a temperature); fields
this server does not know are ignored, as OpenAI-compatible servers do; fields it knows but
cannot honour (tools, logprobs, n > 1, ...) are refused by name rather than silently dropped.
Every string field is `Text`: text that encodes as UTF-8. JSON can carry a lone UTF-16 surrogate
(`"\ud800"`) that no tokenizer, store key or log line can encode; it is refused here (400, naming the
field), never deeper in as a 500. A NUL is a character like any other (it encodes, tokenizes and
hashes), so it is not refused.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    ValidationError,
    field_validator,
)

from kvstrata.serve.errors import APIError


def _encodable(v: str) -> str:
    try:
        v.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"not valid Unicode text: a lone surrogate {ascii(v[e.start])} at character "
                         f"{e.start}") from None
    return v


#: every string a request carries: strict (no coercion) and encodable as UTF-8
Text = Annotated[StrictStr, AfterValidator(_encodable)]

MAX_STOPS = 4  # as OpenAI
UNSUPPORTED = ("tools", "tool_choice", "functions", "function_call", "response_format", "logit_bias",
               "top_logprobs", "suffix")


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    include_usage: StrictBool = False


class _Sampling(BaseModel):
    """Fields both endpoints share."""

    model_config = ConfigDict(strict=True, extra="ignore")

    model: Text
    max_tokens: StrictInt | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0, le=1, allow_inf_nan=False)
    seed: StrictInt | None = Field(None, ge=-(2**63), lt=2**64)
    stop: Text | list[Text] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    user: Text | None = Field(None, max_length=256)
    cache_salt: Text | None = Field(None, min_length=1, max_length=1024)
    prompt_cache_key: Text | None = Field(None, max_length=1024)
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    n: StrictInt = Field(1, ge=1, le=1)
    presence_penalty: float = Field(0.0, ge=0, le=0)
    frequency_penalty: float = Field(0.0, ge=0, le=0)
    logprobs: Any = None
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    response_format: Any = None
    logit_bias: Any = None
    top_logprobs: Any = None
    suffix: Any = None

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        stops = [v] if isinstance(v, str) else v or []
        if len(stops) > MAX_STOPS:
            raise ValueError(f"at most {MAX_STOPS} stop sequences, got {len(stops)}")
        if any(not s for s in stops):
            raise ValueError("stop sequences must be non-empty strings")
        return stops

    @field_validator(*UNSUPPORTED, "logprobs")
    @classmethod
    def _unsupported(cls, v, info):
        if v not in (None, False, {}, []):
            raise ValueError(f"{info.field_name} is not supported by this server")
        return None

    @property
    def stops(self) -> tuple[str, ...]:
        return tuple(self.stop or ())

    @property
    def greedy(self) -> bool:
        return not self.temperature


class CompletionRequest(_Sampling):
    prompt: Text | list[StrictInt] | list[Text] = Field(...)
    echo: StrictBool = False
    best_of: StrictInt | None = Field(None, ge=1, le=1)

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, v):
        if v:
            raise ValueError("echo is not supported by this server")
        return v

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v):
        if isinstance(v, list) and (not v or isinstance(v[0], str)):
            if len(v) != 1:
                raise ValueError("exactly one prompt per request (a string, a list of one string, or token "
                                 "ids)")
            return v[0]
        return v


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    type: Text = Field(max_length=64)
    text: Text = ""

    @field_validator("type")
    @classmethod
    def _text_only(cls, v):
        if v != "text":
            raise ValueError(f"only text content parts are supported, got type {v!r}")
        return v


class Message(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[TextPart] | None = None
    name: Text | None = Field(None, max_length=256)

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class ChatRequest(_Sampling):
    messages: list[Message] = Field(..., min_length=1)
    max_completion_tokens: StrictInt | None = Field(None, ge=1)

    @property
    def limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


def parse(raw: bytes, schema: type[_Sampling]) -> _Sampling:
    """The request body as `schema`, or a 400 naming the first field that is wrong."""
    twice: list[str] = []
    try:
        body = json.loads(raw, object_pairs_hook=lambda pairs: _object(pairs, twice))
    except (ValueError, RecursionError) as e:  # bad UTF-8 / JSON, integers past Python's digit limit
        raise APIError(400, f"the request body is not valid JSON: {e}") from None
    if twice:
        param, key = _first_twice(body)
        raise APIError(400, f"{param}: the key {key!r} is given twice in one JSON object", param=param)
    if not isinstance(body, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    try:
        return schema.model_validate(body)
    except ValidationError as e:
        # of a union's alternatives, the one that got furthest names the field best
        err = max(e.errors(include_url=False), key=lambda x: len(_path(x["loc"])))
        param = ".".join(_path(err["loc"])) or None
        message = err["msg"].removeprefix("Value error, ")
        raise APIError(400, f"{param}: {message}" if param else message, param=param) from None
    except RecursionError:
        raise APIError(400, "the request body is nested too deeply") from None


class _Twice(dict):
    """A JSON object that gave the key `twice` more than once (the first value kept, for the search)."""

    twice = ""


def _object(pairs: list[tuple[str, Any]], twice: list[str]) -> dict:
    """`json.loads`' object hook: the object, marked (and noted in `twice`) when a key repeats -- a
    duplicate is refused, not silently resolved last-wins as JSON parsers do."""
    obj: dict = {}
    for key, value in pairs:
        if key in obj:
            marked = _Twice(obj)
            marked.twice = key
            twice.append(key)
            return marked
        obj[key] = value
    return obj


def _first_twice(body: Any) -> tuple[str, str]:
    """(dotted path such as `messages.0.role`, key) of the first repeated key in `body`, searched
    without recursion (a body may nest deeply)."""
    stack: list[tuple[Any, str]] = [(body, "")]
    while stack:
        node, where = stack.pop()
        if isinstance(node, _Twice):
            return f"{where}{node.twice}", node.twice
        items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
        stack.extend((v, f"{where}{k}.") for k, v in reversed(list(items)))
    raise AssertionError("a repeated key was noted but is not in the body")


def _path(loc: tuple) -> list[str]:
    """A pydantic error location without the tags of union alternatives (`str`, `list[int]`)."""
    internal = ("str", "int", "float", "bool")
    return [str(x) for x in loc if not (isinstance(x, str) and ("[" in x or x in internal))]
