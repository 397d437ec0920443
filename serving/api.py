"""OpenAI's HTTP API over a Scheduler, as its clients use it: GET /v1/models, POST /v1/completions and
/v1/chat/completions (plain or `stream: true` as server-sent events ending in `data: [DONE]`), POST /v1/responses
(the Responses API: plain, or its stream of events), vLLM's POST /tokenize, /detokenize and GET /tokenizer_info,
POST /v1/load_weights (new weights between requests), vLLM's POST /v1/load_lora_adapter and /v1/unload_lora_adapter
(LoRA adapters served beside the model, each a model of its own name), GET /health, GET /metrics, and the chat page
at /. Every refusal is a 4xx in OpenAI's error body, the server going on; if the model's worker dies, every request
is a 500 naming why and /health a 503 (scripts/serve.py then stops the process, for its supervisor to restart)."""
import asyncio
import functools
import os
import secrets
from dataclasses import dataclass, field

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from common.checks import ConfigError
from data.tokenizers import TokenizerError, delimiter_id
from serving.errors import APIError, worker_failed
from serving.events import Events, Mailbox
from serving.metrics import Metrics
from serving.replies import Reply
from serving.requests import Asked, completion_prompts, conversation_prompt, json_body, read_request, token_ids
from serving.responses import ResponseReply, chat_body
from serving.scheduler import QueueFull, Scheduler, SchedulerFailed, Sequence
from serving.structured import Grammars

PAGE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "chat.html")
OPEN_PATHS = ("/", "/health")  # the page (it asks for the key itself) and the probe of a load balancer


@dataclass
class Served:
    """The model behind the API and what the API needs of it."""
    name: str
    block_size: int
    tokenizer: object
    meta: dict
    scheduler: Scheduler
    metrics: Metrics
    weights: object = None  # serving/weights.py's Weights: what /v1/load_weights reads and swaps in
    adapters: object = None  # serving/adapters.py's Adapters: the LoRA adapters requests may name as their model
    api_key: str | None = None
    mailbox: object = None  # the event loop's Mailbox, made on its first request
    grammars: Grammars = field(init=False)  # structured outputs over the tokenizer

    def __post_init__(self):
        self.grammars = Grammars(self.tokenizer)


def create_app(served: Served) -> FastAPI:
    app = FastAPI(title="megalite", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.served = served
    app.add_exception_handler(APIError, refused)
    app.add_exception_handler(HTTPException, unrouted)
    app.middleware("http")(require_key)
    app.include_router(routes)
    return app


def served_by(request: Request) -> Served:
    return request.app.state.served


async def refused(request: Request, e: APIError):
    served_by(request).metrics.refused.labels(status=str(e.status)).inc()
    return e.response()


async def unrouted(request: Request, e: HTTPException):
    """An unknown path or method: OpenAI's body, not FastAPI's."""
    what = "no such path" if e.status_code == 404 else e.detail
    return await refused(request, APIError(e.status_code, f"{request.method} {request.url.path}: {what} (the API is "
                                                          f"under /v1)", code="not_found"))


async def require_key(request: Request, call_next):
    api_key = served_by(request).api_key
    if api_key and request.url.path not in OPEN_PATHS:
        given = request.headers.get("authorization", "")
        if not secrets.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
            return await refused(request, APIError(401, "a missing or wrong API key: send it as 'Authorization: "
                                                        "Bearer KEY'", code="invalid_api_key"))
    return await call_next(request)


routes = APIRouter()


@routes.get("/")
async def page():
    return FileResponse(PAGE, media_type="text/html")


@routes.get("/health")
async def health(request: Request):
    failure = served_by(request).scheduler.failure
    return JSONResponse({"status": "failed", "error": failure} if failure else {"status": "ok"},
                        status_code=503 if failure else 200)


@routes.get("/metrics")
async def metrics(request: Request):
    return Response(served_by(request).metrics.text(), media_type="text/plain; version=0.0.4")


@routes.get("/v1/models")
async def models(request: Request):
    """The model, then its adapters (vLLM's entries: `parent` the model, `root` where the adapter was read)."""
    served = served_by(request)
    model = {"id": served.name, "object": "model", "created": 0, "owned_by": "megalite",
             "max_model_len": served.block_size}
    adapters = [{**model, "id": name, "root": adapter.source, "parent": served.name}
                for name, adapter in served.adapters.by_name.items()]
    return {"object": "list", "data": [model, *adapters]}


@routes.post("/v1/completions")
async def completions(request: Request):
    served, body = served_by(request), json_body(await request.body())
    adapter = requested(served, body)
    prompts, stop_ids = completion_prompts(body, served.tokenizer, served.meta)
    return await respond(served, request, body, adapter, prompts, stop_ids, chat=False)


@routes.post("/v1/chat/completions")
async def chat_completions(request: Request):
    served, body = served_by(request), json_body(await request.body())
    adapter = requested(served, body)
    ids, stop_ids, tools, think = conversation_prompt(body, served.adapters.meta_of(adapter), served.tokenizer)
    return await respond(served, request, body, adapter, [ids], stop_ids, chat=True, tools=tools, think=think)


@routes.post("/v1/responses")
async def responses(request: Request):
    """OpenAI's Responses API over the chat path (serving/responses.py)."""
    served, body = served_by(request), json_body(await request.body())
    chat = chat_body(body)
    adapter = requested(served, chat)
    ids, stop_ids, tools, think = conversation_prompt(chat, served.adapters.meta_of(adapter), served.tokenizer)
    return await respond(served, request, chat, adapter, [ids], stop_ids, chat=True,
                         shape=functools.partial(ResponseReply, body=body), tools=tools, think=think)


@routes.post("/v1/load_weights")
async def load_weights(request: Request):
    """New weights of the same architecture and shape, from an export or a run's checkpoint: the requests running
    now finish on the old ones, every later one starts on the new ones."""
    served, body = served_by(request), json_body(await request.body())
    scheduler = served.scheduler
    try:  # read on the model's thread too: a second thread doing torch work slows every step (scheduler.py)
        state, source, step = await asyncio.wrap_future(scheduler.between_steps(
            lambda: served.weights.read(body.get("path"), body.get("tag"))))
        await asyncio.wrap_future(scheduler.pause_for(lambda: served.weights.swap(state)))
    except (ConfigError, TokenizerError) as e:
        raise APIError(400, str(e), "path") from None
    except SchedulerFailed as e:
        raise worker_failed(str(e)) from None
    return {"status": "ok", "path": source, "step": step}


@routes.post("/v1/load_lora_adapter")
async def load_lora_adapter(request: Request):
    """vLLM's: `{"lora_name", "lora_path"}` (and this server's optional `tag` of a run's checkpoint) read beside the
    running requests and served from the next one on under its name."""
    served, body = served_by(request), json_body(await request.body())
    name = body.get("lora_name")
    try:
        served.adapters.check_name(name)
    except ConfigError as e:
        raise APIError(400, str(e), "lora_name") from None
    try:  # read on the model's thread, which hooks the adapter's maps between two steps
        adapter = await asyncio.wrap_future(served.scheduler.between_steps(
            lambda: served.adapters.read(name, body.get("lora_path"), body.get("tag"))))
        served.adapters.add(adapter)
    except (ConfigError, TokenizerError) as e:
        raise APIError(400, str(e), "lora_path") from None
    except SchedulerFailed as e:
        raise worker_failed(str(e)) from None
    return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")


@routes.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(request: Request):
    """vLLM's: `{"lora_name"}` no longer served; the requests already admitted with it run to their end."""
    served, body = served_by(request), json_body(await request.body())
    name = body.get("lora_name")
    try:
        served.adapters.remove(name)
    except (KeyError, TypeError):
        raise APIError(404, f"the lora adapter {name!r} cannot be found (GET /v1/models lists those served)",
                       "lora_name", code="model_not_found") from None
    return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")


@routes.post("/tokenize")
async def tokenize(request: Request):
    """vLLM's: the ids of a prompt or of a conversation's prompt, which a client fits to the context (the chat page
    keeps a conversation's newest turns that leave room for an answer)."""
    served, body = served_by(request), json_body(await request.body())
    adapter = requested(served, body)
    if "messages" in body:
        ids = conversation_prompt(body, served.adapters.meta_of(adapter), served.tokenizer)[0]
    else:
        ids = completion_prompts(body, served.tokenizer, served.meta)[0][0]
    return {"count": len(ids), "max_model_len": served.block_size, "tokens": ids}


@routes.post("/detokenize")
async def detokenize(request: Request):
    """vLLM's: the text of token ids."""
    served, body = served_by(request), json_body(await request.body())
    requested(served, body)
    return {"prompt": served.tokenizer.decode(token_ids(body.get("tokens"), served.tokenizer, "tokens"))}


@routes.get("/tokenizer_info")
async def tokenizer_info(request: Request):
    """vLLM's: what a client that tokenizes through this server needs (lm-evaluation-harness's remote tokenizer,
    which its local-completions model picks when this answers)."""
    served = served_by(request)
    eos = delimiter_id(served.tokenizer)
    text = None if eos is None else served.tokenizer.decode([eos])
    try:
        if text is not None and served.tokenizer.encode(text) != [eos]:
            text = None  # a text that does not encode back to the id would name other tokens
    except ValueError:  # a char tokenizer's end of text has no text of its own
        text = None
    return {"tokenizer_class": type(served.tokenizer).__name__, "eos_token": text, "bos_token": None,
            "pad_token": None, "chat_template": served.meta.get("chat", {}).get("chat_template"),
            "model_max_length": served.block_size}


def requested(served: Served, body: dict):
    """The adapter the body's `model` names (None: the model itself, named or not)."""
    name = body.get("model", served.name)
    if name == served.name:
        return None
    adapter = served.adapters.by_name.get(name) if isinstance(name, str) else None
    if adapter is None:
        also = "".join(f", {n!r}" for n in served.adapters.by_name)
        raise APIError(404, f"the model {name!r} is not served here: {served.name!r}{also} (GET /v1/models)",
                       "model", code="model_not_found")
    return adapter


async def respond(served: Served, request: Request, body: dict, adapter, prompts: list[list[int]], stop_ids: tuple,
                  chat: bool, shape=Reply, tools=None, think=None):
    """`shape`: the Reply class that writes the answer (chat and completions' own, or the Responses API's); `tools`
    and `think`: a chat request's (serving/tools.py, serving/answer.py)."""
    asked = read_request(body, prompts, stop_ids, served.tokenizer, served.block_size, chat, tools, think)
    sequences = submit(served, asked, adapter)
    reply = shape(served, chat, asked, sequences, body.get("stream_options") or {},
                  served.name if adapter is None else adapter.name)
    if body.get("stream"):
        # The status goes out with the first byte: a request still waiting for a slot when the worker fails is
        # answered 500, one already streaming gets OpenAI's error event.
        kind, value = await sequences[0].events.peek()
        if kind == "failed":
            raise worker_failed(value)
        return StreamingResponse(reply.stream(), media_type="text/event-stream")
    try:
        return JSONResponse(await reply.whole(request))
    finally:
        for sequence in sequences:
            served.scheduler.cancel(sequence)


def submit(served: Served, asked: Asked, adapter=None) -> list[Sequence]:
    """A sequence for each of the request's choices, all queued or none."""
    sequences = []
    if served.mailbox is None or served.mailbox.loop is not asyncio.get_running_loop():
        served.mailbox = Mailbox(asyncio.get_running_loop())
    scored = asked.logprobs if asked.echo and asked.logprobs is not None else None
    # Each choice's own matcher of the grammar, all made (or refused) before any is queued.
    constraints = [None if asked.grammar is None else
                   served.grammars.constraint(asked.grammar, asked.sampling.stop_ids, asked.thinking)
                   for _ in range(len(asked.prompts) * asked.n)]
    try:
        for p, ids in enumerate(asked.prompts):
            for i in range(asked.n):
                sequence = Sequence(ids, asked.sampling, None if asked.seed is None else asked.seed + i,
                                    asked.logprobs, scored, adapter, constraints[p * asked.n + i])
                sequence.events = Events(served.mailbox)
                sequences.append(served.scheduler.submit(sequence))
    except (QueueFull, SchedulerFailed) as e:
        for sequence in sequences:
            served.scheduler.cancel(sequence)
        if isinstance(e, SchedulerFailed):
            raise worker_failed(str(e)) from None
        raise APIError(429, f"the server is busy ({e}); retry later", code="queue_full",
                       kind="rate_limit_error") from None
    return sequences
