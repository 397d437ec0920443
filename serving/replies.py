"""The body, or the stream of chunks, that answers one API request: a choice for each of its sequences (n for each
prompt, in order), its text as TextStream cuts it, and where the request asked, the prompt echoed before it, each
token's log-probability with the most likely tokens beside it in OpenAI's shapes (chat: `logprobs.content`;
completions: `tokens`, `token_logprobs`, `top_logprobs`, `text_offset`), and the token ids (vLLM's
`prompt_token_ids` and `token_ids`). Every token drawn counts, a stop id too: `token_ids` has as many ids as
`usage.completion_tokens` counts."""
import asyncio
import json
import time
import uuid
from dataclasses import dataclass, field

from serving.answer import Answer, Sent
from serving.errors import APIError, worker_failed
from serving.requests import Asked
from serving.scheduler import Drawn


@dataclass
class Delta:
    """What a choice adds at once: text, the echoed prompt's tokens (the first unscored), the tokens drawn since the
    last delta, whether it ended and why."""
    index: int
    text: str = ""
    tokens: list = field(default_factory=list)
    reason: str | None = None
    prompt: list = field(default_factory=list)
    calls: list = field(default_factory=list)  # the tool calls read from the answer (serving/tools.py), at its end
    pieces: list = field(default_factory=list)  # what a stream sends of the calls since the last delta
    reasoning: str = ""  # a thinking model's (serving/answer.py)

    def add(self, later: "Delta") -> None:
        self.text += later.text
        self.reasoning += later.reasoning
        self.prompt += later.prompt
        self.tokens += later.tokens
        self.calls += later.calls
        self.reason = later.reason


class Reply:
    def __init__(self, served, chat: bool, asked: Asked, sequences: list, stream_options: dict, model: str):
        """model: the name the request gave (the served model's, or an adapter's)."""
        self.served, self.chat, self.asked, self.sequences, self.model = served, chat, asked, sequences, model
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created, self.completion_tokens, self.reasoning_tokens = int(time.time()), 0, 0
        self.include_usage = bool(stream_options.get("include_usage"))
        self.offsets = [0] * len(sequences)  # each choice's text so far, in characters (completions' text_offset)

    def prompt(self, index: int) -> list[int]:
        return self.asked.prompts[index // self.asked.n]

    async def deltas(self, index: int):
        """The choice's deltas as its sequence's events arrive (serving/answer.py cuts its text into reasoning,
        content and calls); the echoed prompt first where asked."""
        sequence, asked = self.sequences[index], self.asked
        answer = Answer(self.served.tokenizer, asked, sequence.sampling.min_tokens, asked.thinking)
        held = []  # tokens not yet in a delta
        while True:
            kind, value = await sequence.events.get()
            if kind == "failed":
                raise worker_failed(value)
            if kind == "admitted" and asked.echo and asked.logprobs is None:
                yield Delta(index, asked.texts[index // asked.n])
            elif kind == "prompt":  # the echoed prompt's scores: the first token has none
                ids = self.prompt(index)
                yield Delta(index, asked.texts[index // asked.n],
                            prompt=[Drawn(ids[0], None, None)] + [Drawn(t, *s) for t, s in zip(ids[1:], value)])
            elif kind == "done":
                last = answer.last(value)
                self.reasoning_tokens += answer.reasoning_tokens
                yield self.delta(index, last, held)
                return
            elif kind == "token":
                self.completion_tokens += 1
                held.append(value)
                if value.id in sequence.sampling.stop_ids:
                    continue
                sent, stopped = answer.add(value.id)
                if stopped:  # by a stop string
                    self.served.scheduler.cancel(sequence, "stop")
                    self.reasoning_tokens += answer.reasoning_tokens
                    yield self.delta(index, sent, held)
                    return
                if sent.reasoning or sent.content or sent.pieces:
                    yield self.delta(index, sent, held)
                    held = []

    @staticmethod
    def delta(index: int, sent: Sent, tokens: list) -> Delta:
        return Delta(index, sent.content, tokens, sent.reason, calls=sent.calls, pieces=sent.pieces,
                     reasoning=sent.reasoning)

    async def whole(self, request) -> dict:
        answers = [Delta(index) for index in range(len(self.sequences))]
        for answer in answers:
            async for delta in self.deltas(answer.index):
                answer.add(delta)
                if await request.is_disconnected():
                    return {}
        return {**self.head(), "choices": [self.choice(answer) for answer in answers], "usage": self.usage(),
                **self.prompt_ids()}

    async def stream(self):
        tasks = []
        try:
            if self.chat:
                for index in range(len(self.sequences)):
                    yield self.chunk({"index": index, "delta": {"role": "assistant", "content": ""},
                                      "finish_reason": None}, **self.prompt_ids())
            merged = asyncio.Queue()

            async def drain(index):
                try:
                    async for delta in self.deltas(index):
                        await merged.put(delta)
                    await merged.put(None)
                except APIError as e:
                    await merged.put(e)

            tasks += [asyncio.create_task(drain(i)) for i in range(len(self.sequences))]
            finished = 0
            while finished < len(self.sequences):
                item = await merged.get()
                if item is None:
                    finished += 1
                elif isinstance(item, APIError):
                    raise item
                elif item.text or item.reason or item.tokens or item.pieces or item.reasoning:
                    yield self.chunk(self.choice(item, streamed=True))
            if self.include_usage:
                yield f"data: {json.dumps({**self.head(streamed=True), 'choices': [], 'usage': self.usage()})}\n\n"
            yield "data: [DONE]\n\n"
        except APIError as e:  # the worker died mid-stream: OpenAI's error event, which its clients raise
            yield f"data: {json.dumps(e.body())}\n\n"
        finally:  # the client went away, or all is sent
            for sequence in self.sequences:
                self.served.scheduler.cancel(sequence)
            for task in tasks:
                task.cancel()

    def choice(self, delta: Delta, streamed: bool = False) -> dict:
        asked, out = self.asked, {"index": delta.index}
        if self.chat:
            out["delta" if streamed else "message"] = {"content": delta.text} if streamed else \
                {"role": "assistant", "content": delta.text or (None if delta.calls or delta.reasoning else "")}
            if asked.thinking is not None and (delta.reasoning or not streamed):  # vLLM's names, newer and older
                out["delta" if streamed else "message"].update(dict.fromkeys(("reasoning", "reasoning_content"),
                                                                             delta.reasoning or None))
            if streamed and delta.pieces:
                out["delta"]["tool_calls"] = delta.pieces
            elif not streamed and delta.calls:
                out["message"]["tool_calls"] = delta.calls
        else:
            out["text"] = delta.text
        if asked.logprobs is not None:
            out["logprobs"] = self.chat_logprobs(delta.tokens) if self.chat else self.logprobs(delta)
        elif not self.chat:
            out["logprobs"] = None
        out["finish_reason"] = delta.reason
        if asked.token_ids:
            out["token_ids"] = [t.id for t in delta.tokens]
            if not self.chat and not streamed:
                out["prompt_token_ids"] = self.prompt(delta.index)
        return out

    def logprobs(self, delta: Delta) -> dict:
        """Completions' shape: the tokens' strings, log-probabilities, most likely tokens with theirs (the token's
        own among them) and where each begins in the choice's text."""
        tokens = delta.prompt + delta.tokens
        strings = [self.decode(t.id) for t in tokens]
        offsets = []
        for s in strings:
            offsets.append(self.offsets[delta.index])
            self.offsets[delta.index] += len(s)
        return {"tokens": strings, "token_logprobs": [t.logprob for t in tokens],
                "top_logprobs": [None if t.top is None else
                                 {self.decode(i): v for i, v in [*t.top, (t.id, t.logprob)]} for t in tokens],
                "text_offset": offsets}

    def chat_logprobs(self, tokens: list[Drawn]) -> dict:
        def entry(token_id, logprob):
            text = self.decode(token_id)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}
        return {"content": [{**entry(t.id, t.logprob), "top_logprobs": [entry(i, v) for i, v in t.top]}
                            for t in tokens]}

    def decode(self, token_id: int) -> str:
        return self.served.tokenizer.decode([token_id])

    def prompt_ids(self) -> dict:
        """Chat's prompt ids, beside its choices (vLLM's shape)."""
        return {"prompt_token_ids": self.asked.prompts[0]} if self.asked.token_ids and self.chat else {}

    def head(self, streamed: bool = False) -> dict:
        kind = ("chat.completion.chunk" if streamed else "chat.completion") if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def chunk(self, choice: dict, **extra) -> str:
        return f"data: {json.dumps({**self.head(streamed=True), 'choices': [choice], **extra})}\n\n"

    def usage(self) -> dict:
        prompt = sum(len(ids) for ids in self.asked.prompts)
        thinks = {"completion_tokens_details": {"reasoning_tokens": self.reasoning_tokens}} \
            if self.asked.thinking is not None else {}  # OpenAI's count of a reasoning model's
        return {"prompt_tokens": prompt, "completion_tokens": self.completion_tokens,
                "total_tokens": prompt + self.completion_tokens, **thinks}
