"""OpenAI's HTTP API over a Scheduler, as its clients use it: GET /v1/models, POST /v1/completions and
/v1/chat/completions (plain or `stream: true` as server-sent events ending in `data: [DONE]`), vLLM's POST
/tokenize, GET /health, GET /metrics, and the chat page at /. Every refusal is a 4xx in OpenAI's error body, the
server going on; if the model's worker dies, every request is a 500 naming why and /health a 503 (scripts/serve.py
then stops the process, for its supervisor to restart)."""
import asyncio
import json
import os
import secrets
import time
import uuid
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from data.chat import ChatError, chat_prompt, prompt_turns
from data.tokenizers import delimiter_id
from model.generate import Sampling
from serving.metrics import Metrics
from serving.scheduler import QueueFull, Scheduler, SchedulerFailed, Sequence
from serving.text import TextStream

PAGE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "chat.html")
OPEN_PATHS = ("/", "/health")  # the page (it asks for the key itself) and the probe of a load balancer
UNSUPPORTED = {"tools": "tools", "tool_choice": "tools", "functions": "function calling",
               "function_call": "function calling", "logprobs": "logprobs", "response_format": "response formats"}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def worker_failed(failure: str) -> APIError:
    return APIError(500, f"{failure}; the server is stopping: retry once it is restarted", code="worker_failed",
                    kind="server_error")


@dataclass
class Served:
    """The model behind the API and what the API needs of it."""
    name: str
    block_size: int
    tokenizer: object
    meta: dict
    scheduler: Scheduler
    metrics: Metrics
    api_key: str | None = None


def create_app(served: Served) -> FastAPI:
    app = FastAPI(title="megalite", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(APIError)
    async def refused(request: Request, e: APIError):
        served.metrics.refused.labels(status=str(e.status)).inc()
        return e.response()

    @app.exception_handler(HTTPException)
    async def unrouted(request: Request, e: HTTPException):  # an unknown path or method: OpenAI's body, not FastAPI's
        what = "no such path" if e.status_code == 404 else e.detail
        return await refused(request, APIError(e.status_code, f"{request.method} {request.url.path}: {what} (the API "
                                                              f"is under /v1)", code="not_found"))

    @app.middleware("http")
    async def key(request: Request, call_next):
        if served.api_key and request.url.path not in OPEN_PATHS:
            given = request.headers.get("authorization", "")
            if not secrets.compare_digest(given.encode(), f"Bearer {served.api_key}".encode()):
                return await refused(request, APIError(401, "a missing or wrong API key: send it as "
                                                            "'Authorization: Bearer KEY'", code="invalid_api_key"))
        return await call_next(request)

    @app.get("/")
    async def page():
        return FileResponse(PAGE, media_type="text/html")

    @app.get("/health")
    async def health():
        failure = served.scheduler.failure
        return JSONResponse({"status": "failed", "error": failure} if failure else {"status": "ok"},
                            status_code=503 if failure else 200)

    @app.get("/metrics")
    async def metrics():
        return Response(served.metrics.text(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": served.name, "object": "model", "created": 0,
                                            "owned_by": "megalite", "max_model_len": served.block_size}]}

    def completion_prompt(body: dict) -> tuple[list[int], tuple]:
        prompt = body.get("prompt")
        if not isinstance(prompt, str) or not prompt:
            raise APIError(400, "prompt must be a non-empty string", "prompt")
        try:
            ids = served.tokenizer.encode(prompt)
        except ValueError as e:  # outside a char vocabulary
            raise APIError(400, f"the prompt cannot be encoded: {e}", "prompt") from None
        stop = delimiter_id(served.tokenizer)
        return ids, () if stop is None else (stop,)

    def conversation_prompt(body: dict) -> tuple[list[int], tuple]:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise APIError(400, "messages must be a non-empty list", "messages")
        for message in messages:
            if isinstance(message, dict) and isinstance(message.get("content"), list):
                if any(isinstance(p, dict) and p.get("type") != "text" for p in message["content"]):
                    raise APIError(400, "only text content is supported (no images or audio)", "messages")
        try:
            turns = prompt_turns(messages)
            ids, end_of_turn = chat_prompt(turns, served.meta, served.tokenizer, "the chat",
                                           "use /v1/completions")
        except ChatError as e:
            raise APIError(400, str(e), "messages") from None
        except ValueError as e:
            raise APIError(400, str(e), "messages", code="chat_not_supported") from None
        return ids, (end_of_turn,)

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await json_body(request)
        ids, stop_ids = completion_prompt(body)
        return await respond(request, body, ids, stop_ids, chat=False, default_max=16)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await json_body(request)
        ids, stop_ids = conversation_prompt(body)
        return await respond(request, body, ids, stop_ids, chat=True, default_max=None)

    @app.post("/tokenize")
    async def tokenize(request: Request):
        """vLLM's: the ids of a prompt or of a conversation's prompt, which a client fits to the context (the chat
        page keeps a conversation's newest turns that leave room for an answer)."""
        body = await json_body(request)
        check_model(body)
        ids, _ = conversation_prompt(body) if "messages" in body else completion_prompt(body)
        return {"count": len(ids), "max_model_len": served.block_size, "tokens": ids}

    def check_model(body: dict) -> None:
        if body.get("model", served.name) != served.name:
            raise APIError(404, f"the model {body['model']!r} is not served here: {served.name!r} is (GET /v1/models)",
                           "model", code="model_not_found")

    async def respond(request: Request, body: dict, ids: list[int], stop_ids: tuple, chat: bool, default_max):
        check_model(body)
        ids, sampling, seed, n, stops = settings(body, ids, stop_ids, served.block_size, default_max)
        sequences = []
        loop = asyncio.get_running_loop()
        try:
            for i in range(n):
                sequence = Sequence(ids, sampling, None if seed is None else seed + i)
                sequence.events = Events(loop)
                sequences.append(served.scheduler.submit(sequence))
        except (QueueFull, SchedulerFailed) as e:
            for sequence in sequences:
                served.scheduler.cancel(sequence)
            if isinstance(e, SchedulerFailed):
                raise worker_failed(str(e)) from None
            raise APIError(429, f"the server is busy ({e}); retry later", code="queue_full",
                           kind="rate_limit_error") from None
        reply = Reply(served, chat, len(ids), n, body.get("stream_options") or {})
        if body.get("stream"):
            # The status goes out with the first byte: a request still waiting for a slot when the worker fails is
            # answered 500, one already streaming gets OpenAI's error event.
            kind, value = await sequences[0].events.peek()
            if kind == "failed":
                raise worker_failed(value)
            return StreamingResponse(reply.stream(sequences, stops), media_type="text/event-stream")
        try:
            return JSONResponse(await reply.whole(sequences, stops, request))
        finally:
            for sequence in sequences:
                served.scheduler.cancel(sequence)

    return app


async def json_body(request: Request) -> dict:
    raw = await request.body()
    try:
        body = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise APIError(400, "the request body is not UTF-8") from None
    except json.JSONDecodeError as e:
        raise APIError(400, f"the request body is not valid JSON ({e})") from None
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    for key, what in UNSUPPORTED.items():
        if body.get(key):
            raise APIError(400, f"{what} are not supported by this server", key, code="unsupported")
    return body


def settings(body: dict, ids: list[int], stop_ids: tuple, block_size: int, default_max):
    """(prompt ids, Sampling, seed, n, stop strings) of a request body, each value checked."""
    def number(key, default, kind=(int, float)):
        value = body.get(key, default)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, kind):
            raise APIError(400, f"{key} must be a {'whole ' if kind is int else ''}number", key)
        return value

    keep = number("truncate_prompt_tokens", None, int)  # vLLM's option: keep the prompt's last tokens
    if keep is not None:
        if keep < 1:
            raise APIError(400, "truncate_prompt_tokens must be at least 1", "truncate_prompt_tokens")
        ids = ids[-keep:]
    if len(ids) >= block_size:
        raise APIError(400, f"the prompt has {len(ids)} tokens and the model's context is {block_size}: at most "
                            f"{block_size - 1} leave room for an answer (truncate_prompt_tokens keeps the last ones)",
                       "messages" if default_max is None else "prompt", code="context_length_exceeded")
    room = block_size - len(ids)
    max_tokens = number("max_completion_tokens", None, int) or number("max_tokens", default_max or room, int)
    if max_tokens < 1:
        raise APIError(400, f"max_tokens must be at least 1, not {max_tokens}", "max_tokens")
    if max_tokens > room:
        raise APIError(400, f"max_tokens={max_tokens} and the prompt's {len(ids)} tokens exceed the model's context "
                            f"of {block_size}: ask for at most {room}", "max_tokens", code="context_length_exceeded")
    temperature, top_p = number("temperature", 1.0), number("top_p", 1.0)
    if not 0 <= temperature <= 2:
        raise APIError(400, f"temperature must be in [0, 2], not {temperature}", "temperature")
    if not 0 < top_p <= 1:
        raise APIError(400, f"top_p must be in (0, 1], not {top_p}", "top_p")
    n, seed = number("n", 1, int), number("seed", None, int)
    if not 1 <= n <= 16:
        raise APIError(400, f"n must be in [1, 16], not {n}", "n")
    stops = body.get("stop") or []
    stops = [stops] if isinstance(stops, str) else stops
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops) or len(stops) > 4:
        raise APIError(400, "stop must be a string or a list of at most 4 strings", "stop")
    if body.get("ignore_eos"):  # vLLM's option: the end of turn or text does not end the answer
        stop_ids = ()
    return ids, Sampling(max_tokens, temperature, None, top_p, stop_ids), seed, n, stops


class Events:
    """A sequence's events, put by the scheduler's thread, awaited on the server's event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop, self.queue, self.next = loop, asyncio.Queue(), None

    def put(self, event) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, event)

    async def peek(self):
        """The next event, left for get()."""
        if self.next is None:
            self.next = await self.queue.get()
        return self.next

    async def get(self):
        event, self.next = self.next or await self.queue.get(), None
        return event


class Reply:
    """The body (or the stream of chunks) of one API request's n sequences."""

    def __init__(self, served: Served, chat: bool, prompt_tokens: int, n: int, stream_options: dict):
        self.served, self.chat, self.prompt_tokens, self.n = served, chat, prompt_tokens, n
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created, self.completion_tokens = int(time.time()), 0
        self.include_usage = bool(stream_options.get("include_usage"))

    async def pieces(self, sequence: Sequence, index: int, stops: list[str]):
        """(index, text, finish reason or None) as the sequence's tokens arrive."""
        text = TextStream(self.served.tokenizer, stops)
        while True:
            kind, value = await sequence.events.get()
            if kind == "admitted":
                continue
            if kind == "failed":
                raise worker_failed(value)
            if kind == "done":
                yield index, text.rest(), value
                return
            self.completion_tokens += 1
            if value in sequence.sampling.stop_ids:
                continue
            piece, stopped = text.add(value)
            if stopped:
                self.served.scheduler.cancel(sequence, "stop")
                yield index, piece, "stop"
                return
            if piece:
                yield index, piece, None

    async def whole(self, sequences: list, stops: list[str], request: Request) -> dict:
        texts, reasons = [""] * self.n, [None] * self.n
        for index, sequence in enumerate(sequences):
            async for _, piece, reason in self.pieces(sequence, index, stops):
                texts[index] += piece
                reasons[index] = reason
                if await request.is_disconnected():
                    return {}
        choices = [{"index": i, "finish_reason": reason,
                    **({"message": {"role": "assistant", "content": text}} if self.chat else
                       {"text": text, "logprobs": None})} for i, (text, reason) in enumerate(zip(texts, reasons))]
        return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.served.name, "choices": choices, "usage": self.usage()}

    async def stream(self, sequences: list, stops: list[str]):
        tasks = []
        try:
            if self.chat:
                for index in range(self.n):
                    yield self.chunk(index, {"role": "assistant", "content": ""}, None)
            merged = asyncio.Queue()

            async def drain(index, sequence):
                try:
                    async for item in self.pieces(sequence, index, stops):
                        await merged.put(item)
                    await merged.put(None)
                except APIError as e:
                    await merged.put(e)

            tasks += [asyncio.create_task(drain(i, s)) for i, s in enumerate(sequences)]
            finished = 0
            while finished < self.n:
                item = await merged.get()
                if item is None:
                    finished += 1
                    continue
                if isinstance(item, APIError):
                    raise item
                index, piece, reason = item
                if piece or reason:
                    yield self.chunk(index, {"content": piece} if self.chat else piece, reason)
            if self.include_usage:
                yield f"data: {json.dumps({**self.head(), 'choices': [], 'usage': self.usage()})}\n\n"
            yield "data: [DONE]\n\n"
        except APIError as e:  # the worker died mid-stream: OpenAI's error event, which its clients raise
            yield f"data: {json.dumps(e.body())}\n\n"
        finally:  # the client went away, or all is sent
            for sequence in sequences:
                self.served.scheduler.cancel(sequence)
            for task in tasks:
                task.cancel()

    def head(self) -> dict:
        return {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.served.name}

    def chunk(self, index: int, delta, reason) -> str:
        choice = {"index": index, "finish_reason": reason,
                  **({"delta": delta} if self.chat else {"text": delta, "logprobs": None})}
        return f"data: {json.dumps({**self.head(), 'choices': [choice]})}\n\n"

    def usage(self) -> dict:
        prompt = self.prompt_tokens * self.n
        return {"prompt_tokens": prompt, "completion_tokens": self.completion_tokens,
                "total_tokens": prompt + self.completion_tokens}
