"""What one API request asks for, read from its body and checked: its prompts as token ids (a completion's strings
or token ids, a conversation through the model's chat template), how to sample, and what to return beside the
text (log-probabilities, the prompt echoed, token ids). Each value out of range is a 400 that names it."""
import json
from dataclasses import dataclass

from data.chat import AFTER, ANSWER, CONTINUE, ChatError, chat_prompt, request_turns
from data.meta import answer_ends
from data.tokenizers import delimiter_id
from model.generate import Sampling, SamplingError
from serving.errors import APIError
from serving.reasoning import thinking
from serving.structured import grammar_of
from serving.tools import Tools, read_tools

MAX_LOGPROBS = 20  # the most likely tokens a request may ask for beside each token (vLLM's default bound)
MAX_N = 16
RENDERED = {"messages", "tools", "add_generation_prompt"}  # the template variables a request's fields set
# OpenAI's options this server does not implement, refused where a request sets them (0, empty or false is their
# default) rather than answered as if they were not there.
UNSUPPORTED = {"functions": "legacy function definitions (functions: send tools)",
               "function_call": "legacy function-call choices (function_call: send tool_choice)", "suffix": "suffixes"}


@dataclass
class Asked:
    prompts: list[list[int]]  # each prompt's ids; a request's choices are n for each, in order
    texts: list[str]  # each prompt's text, which echo repeats
    sampling: Sampling
    seed: int | None  # the i-th choice draws with seed + i
    n: int
    stops: list[str]
    logprobs: int | None  # the most likely tokens given beside each token's log-probability; None: none
    echo: bool  # the prompt's text (and its tokens' log-probabilities) before each answer
    token_ids: bool  # vLLM's return_token_ids: the prompt's and the answer's ids in the reply
    grammar: str | None  # the grammar every answer follows (serving/structured.py), None for free text
    tools: Tools | None = None  # the tools a chat request gives and how they may be called (serving/tools.py)
    thinking: str | None = None  # how a chat answer thinks (serving/answer.py's thinking())


def json_body(raw: bytes) -> dict:
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
    if body.get("best_of") not in (None, 1):
        raise APIError(400, "best_of is not supported by this server: ask for n answers", "best_of",
                       code="unsupported")
    return body


def completion_prompts(body: dict, tokenizer, meta: dict) -> tuple[list[list[int]], tuple]:
    """(the ids of each prompt: a string, a list of token ids, or a list of either; the stop ids)."""
    prompt = body.get("prompt")
    prompts = [prompt] if isinstance(prompt, str) or _is_ids(prompt) else prompt
    if not isinstance(prompts, list) or not prompts or not all(isinstance(p, str) or _is_ids(p) for p in prompts):
        raise APIError(400, "prompt must be a non-empty string, a list of token ids, or a list of either", "prompt")
    encoded = []
    for p in prompts:
        if not p:
            raise APIError(400, "prompt must be a non-empty string, a list of token ids, or a list of either",
                           "prompt")
        if isinstance(p, str):
            try:
                encoded.append(tokenizer.encode(p))
            except ValueError as e:  # outside a char vocabulary
                raise APIError(400, f"the prompt cannot be encoded: {e}", "prompt") from None
        else:
            encoded.append(token_ids(p, tokenizer, "prompt"))
    return encoded, answer_ends(meta, delimiter_id(tokenizer))


def token_ids(value, tokenizer, param: str) -> list[int]:
    """`value` checked to be a list of the tokenizer's ids."""
    if not _is_ids(value):
        raise APIError(400, f"{param} must be a list of token ids", param)
    outside = next((t for t in value if not 0 <= t < tokenizer.vocab_size), None)
    if outside is not None:
        raise APIError(400, f"the token id {outside} is outside the vocabulary: ids are in "
                            f"[0, {tokenizer.vocab_size})", param)
    return list(value)


def _is_ids(value) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def conversation_prompt(body: dict, meta: dict, tokenizer) -> tuple[list[int], tuple, Tools | None, str | None]:
    """(the ids of the conversation `messages` rendered by the chat template with the request's tools, (its
    end-of-turn id,), the tools and tool_choice read (serving/tools.py), None without tools, and how the answer
    thinks: serving/answer.py's thinking())."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "messages must be a non-empty list", "messages")
    for message in messages:
        if isinstance(message, dict) and isinstance(message.get("content"), list):
            if any(isinstance(p, dict) and p.get("type") != "text" for p in message["content"]):
                raise APIError(400, "only text content is supported (no images or audio)", "messages")
    template = meta.get("chat", {}).get("chat_template", "")  # none for a model of text: chat_prompt says so
    tools = read_tools(body, template)
    variables, ending = _rendering(body)
    try:
        ids, end_of_turn = chat_prompt(request_turns(messages), meta, tokenizer, "the chat", "use /v1/completions",
                                       tools and tools.definitions, variables, ending)
    except ChatError as e:
        raise APIError(400, str(e), "messages") from None
    except ValueError as e:
        raise APIError(400, str(e), "messages", code="chat_not_supported") from None
    if tools is not None:  # the template renders them: it must write calls where auto reads them
        tools.check_format()
    return ids, answer_ends(meta, end_of_turn), tools, thinking(template, tokenizer.decode(ids))


def _rendering(body: dict) -> tuple[dict, str]:
    """vLLM's chat options: chat_template_kwargs (more of the template's variables; those it does not read are
    dropped, as vLLM drops them), and where the prompt ends (data/chat.py: add_generation_prompt, the default, or
    continue_final_message)."""
    variables = body.get("chat_template_kwargs") or {}
    if not isinstance(variables, dict):
        raise APIError(400, "chat_template_kwargs must be an object of the chat template's variables",
                       "chat_template_kwargs")
    own = sorted(RENDERED & set(variables))
    if own:
        raise APIError(400, f"chat_template_kwargs cannot set {', '.join(own)}: the request's own fields do",
                       "chat_template_kwargs")
    flags = {}
    for key in ("continue_final_message", "add_generation_prompt"):
        if not isinstance(body.get(key, False), bool):
            raise APIError(400, f"{key} must be true or false", key)
        flags[key] = body.get(key)
    if flags["continue_final_message"]:
        if flags["add_generation_prompt"]:
            raise APIError(400, "continue_final_message continues the last turn, add_generation_prompt begins a new "
                                "one: set one of them", "add_generation_prompt")
        return variables, CONTINUE
    return variables, AFTER if flags["add_generation_prompt"] is False else ANSWER


def read_request(body: dict, prompts: list[list[int]], stop_ids: tuple, tokenizer, block_size: int,
                 chat: bool, tools: Tools | None = None, think: str | None = None) -> Asked:
    """What the request asks for, each value checked against the prompts and the model's context."""
    number = _reader(body)
    keep = number("truncate_prompt_tokens", None, int)  # vLLM's option: keep the prompt's last tokens
    if keep is not None:
        if keep < 1:
            raise APIError(400, "truncate_prompt_tokens must be at least 1", "truncate_prompt_tokens")
        prompts = [ids[-keep:] for ids in prompts]
    longest = max(len(ids) for ids in prompts)
    if longest >= block_size:
        raise APIError(400, f"the prompt has {longest} tokens and the model's context is {block_size}: at most "
                            f"{block_size - 1} leave room for an answer (truncate_prompt_tokens keeps the last ones)",
                       "messages" if chat else "prompt", code="context_length_exceeded")
    room = block_size - longest
    max_tokens = number("max_completion_tokens", None, int) or number("max_tokens", room if chat else 16, int)
    if max_tokens < 1:
        raise APIError(400, f"max_tokens must be at least 1, not {max_tokens}", "max_tokens")
    if max_tokens > room:
        raise APIError(400, f"max_tokens={max_tokens} and the prompt's {longest} tokens exceed the model's context "
                            f"of {block_size}: ask for at most {room}", "max_tokens", code="context_length_exceeded")
    n, seed = number("n", 1, int), number("seed", None, int)
    if not 1 <= n <= MAX_N:
        raise APIError(400, f"n must be in [1, {MAX_N}], not {n}", "n")
    stops = body.get("stop") or []
    stops = [stops] if isinstance(stops, str) else stops
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops) or len(stops) > 4:
        raise APIError(400, "stop must be a string or a list of at most 4 strings", "stop")
    if body.get("ignore_eos"):  # vLLM's option: the end of turn or text does not end the answer
        stop_ids = ()
    echo = bool(body.get("echo"))
    if echo and chat:
        raise APIError(400, "echo is an option of /v1/completions", "echo")
    texts = [tokenizer.decode(ids) for ids in prompts]
    sampling, grammar = _sampling(body, number, tokenizer, max_tokens, stop_ids), grammar_of(body)
    calls = None if tools is None else tools.grammar()  # a named function's or required's: the answer is calls
    if calls is not None:
        if grammar is not None:
            raise APIError(400, f"tool_choice {tools.choice} sets the answer's format: a response format cannot be "
                                f"given beside it", "response_format")
        grammar = calls
    if grammar is not None and sampling.min_tokens:  # the grammar may end where min_tokens rules the end out
        raise APIError(400, "min_tokens cannot be combined with a response format", "min_tokens")
    return Asked(prompts, texts, sampling, seed, n, stops, _logprobs(body, number, chat), echo,
                 bool(body.get("return_token_ids")), grammar, tools, think)


def _sampling(body: dict, number, tokenizer, max_tokens: int, stop_ids: tuple) -> Sampling:
    """OpenAI's sampling options and vLLM's (top_k, min_p, repetition_penalty, min_tokens), each checked."""
    temperature = number("temperature", 1.0)
    if not 0 <= temperature <= 2:
        raise APIError(400, f"temperature must be in [0, 2], not {temperature}", "temperature")
    top_k = number("top_k", -1, int)  # -1 (or 0) draws from the whole vocabulary
    if top_k < -1:
        raise APIError(400, f"top_k must be -1 or 0 (off) or at least 1, not {top_k}", "top_k")
    try:
        return Sampling(max_tokens, temperature, top_k if top_k > 0 else None, number("top_p", 1.0), stop_ids,
                        number("min_p", 0.0), number("repetition_penalty", 1.0), number("frequency_penalty", 0.0),
                        number("presence_penalty", 0.0), _logit_bias(body, tokenizer), number("min_tokens", 0, int))
    except SamplingError as e:
        raise APIError(400, str(e), e.setting) from None


def _logit_bias(body: dict, tokenizer) -> tuple:
    """OpenAI's logit_bias, {"token id": bias}, as (id, bias) pairs."""
    bias = body.get("logit_bias") or {}
    if not isinstance(bias, dict):
        raise APIError(400, "logit_bias must map token ids to biases", "logit_bias")
    pairs = []
    for key, value in bias.items():
        if not key.isdigit() or isinstance(value, bool) or not isinstance(value, (int, float)):
            raise APIError(400, f"logit_bias must map token ids to biases, not {key!r}: {value!r}", "logit_bias")
        pairs.append((int(key), value))
    token_ids([i for i, _ in pairs], tokenizer, "logit_bias")
    return tuple(pairs)


def _logprobs(body: dict, number, chat: bool) -> int | None:
    """Chat: logprobs true, and top_logprobs of the most likely tokens beside each; completions: logprobs N."""
    if chat:
        wanted, top = body.get("logprobs"), number("top_logprobs", None, int)
        if wanted is not None and not isinstance(wanted, bool):
            raise APIError(400, "logprobs must be true or false", "logprobs")
        if top is not None and not wanted:
            raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        top, key = (top or 0) if wanted else None, "top_logprobs"
    else:
        top, key = number("logprobs", None, int), "logprobs"
    if top is not None and not 0 <= top <= MAX_LOGPROBS:
        raise APIError(400, f"{key} must be in [0, {MAX_LOGPROBS}], not {top}", key)
    return top


def _reader(body: dict):
    def number(key, default, kind=(int, float)):
        value = body.get(key, default)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, kind):
            raise APIError(400, f"{key} must be a {'whole ' if kind is int else ''}number", key)
        return value
    return number
