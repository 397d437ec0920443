"""Structured outputs: OpenAI's `response_format` (json_object, json_schema) and vLLM's `structured_outputs` (json,
regex, choice, grammar: a Lark grammar, as vLLM's guidance backend takes it) as a grammar each answer follows,
through llguidance (one of vLLM's structured-output backends). Before each token is drawn, the tokens that cannot
continue the grammar are ruled out; the answer ends with a stop id where the grammar may end, and at once where
nothing may follow. JSON is written as Python's json.dumps writes it (", " and ": ", no other whitespace): where any
whitespace may come, a small model spends its tokens on it."""
import json
import re

import numpy as np
import torch

from data.tokenizers import HFTokenizer, TiktokenTokenizer
from serving.errors import APIError
from serving.reasoning import thought_marks

VLLM_FORMS = ("json", "regex", "choice", "grammar")
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# A special token past the vocabulary that llguidance reads as the end of the text: where the grammar allows it, the
# request's stop ids (an end of turn or of text) may come.
END = "<|end of the answer|>"


def grammar_of(body: dict) -> str | None:
    """The grammar a request's body asks its answers to follow (None: free text); a 400 names what is malformed."""
    response_format, vllm = body.get("response_format") or {"type": "text"}, body.get("structured_outputs")
    if response_format == {"type": "text"} and vllm is None:  # llguidance imported only where a format is asked
        return None
    from llguidance import LLMatcher

    if not isinstance(response_format, dict) or response_format.get("type") not in ("text", "json_object",
                                                                                    "json_schema"):
        raise APIError(400, "response_format must be {\"type\": \"text\"}, {\"type\": \"json_object\"} or "
                            "{\"type\": \"json_schema\", \"json_schema\": {\"name\": ..., \"schema\": {...}}}",
                       "response_format")
    kind = response_format["type"]
    if vllm is not None and kind != "text":
        raise APIError(400, "response_format and structured_outputs both ask for a format: give one",
                       "structured_outputs")
    if kind == "json_object":
        return LLMatcher.grammar_from_json_schema({"type": "object"}, JSON_STYLE)
    if kind == "json_schema":
        schema = (response_format.get("json_schema") or {}).get("schema")
        if not isinstance(schema, dict):
            raise APIError(400, "response_format.json_schema.schema must be a JSON schema (an object)",
                           "response_format")
        return LLMatcher.grammar_from_json_schema(schema, JSON_STYLE)
    return None if vllm is None else _vllm_grammar(vllm)


def _vllm_grammar(asked) -> str:
    """vLLM's structured_outputs: exactly one of json (a schema), regex, choice (a list of strings), grammar (Lark)."""
    from llguidance import LLMatcher

    given = [k for k in VLLM_FORMS if isinstance(asked, dict) and asked.get(k) is not None]
    if len(given) != 1 or set(asked) - set(VLLM_FORMS):
        raise APIError(400, "structured_outputs must give exactly one of json (a schema), regex, choice (a list of "
                            "strings) or grammar (Lark)", "structured_outputs")
    form, value = given[0], asked[given[0]]
    if form == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError:
                value = None
        if not isinstance(value, dict):
            raise APIError(400, "structured_outputs.json must be a JSON schema", "structured_outputs")
        return LLMatcher.grammar_from_json_schema(value, JSON_STYLE)
    if form == "choice" and isinstance(value, list) and value and all(isinstance(c, str) for c in value):
        return LLMatcher.grammar_from_regex("|".join(re.escape(c) for c in value))
    if form in ("regex", "grammar") and isinstance(value, str):
        return (LLMatcher.grammar_from_regex if form == "regex" else LLMatcher.grammar_from_lark)(value)
    wanted = "a non-empty list of strings" if form == "choice" else "a string"
    raise APIError(400, f"structured_outputs.{form} must be {wanted}", "structured_outputs")


class Grammars:
    """The served tokenizer as llguidance reads it, built once at the start (a quarter of a second for a vocabulary of
    21,527 ids); where llguidance cannot read it (a word-level tokenizer has no byte decoder), `unavailable` says why
    and every format is refused. A Constraint for each answer that follows a grammar."""

    def __init__(self, tokenizer):
        self.vocab_size, self.unavailable = tokenizer.vocab_size, None
        self.marks = thought_marks(tokenizer)
        try:
            self.lltokenizer = _lltokenizer(tokenizer, self.vocab_size)
        except (ImportError, ValueError, RuntimeError) as e:
            self.lltokenizer, self.unavailable = None, f"{type(e).__name__}: {e}"

    def constraint(self, grammar: str, stop_ids: tuple, think: str | None = None) -> "Constraint | Thinking":
        """A fresh matcher of `grammar`, after the answer's thought where it thinks (`think`: serving/answer.py's
        thinking()) and the tokenizer marks thoughts with a token each; a 400 where the grammar is invalid or this
        vocabulary cannot begin it."""
        from llguidance import LLMatcher

        if self.unavailable:
            raise APIError(400, f"structured outputs are not available for this model's tokenizer (llguidance "
                                f"cannot read it: {self.unavailable})", "response_format", code="unsupported")

        matcher = LLMatcher(self.lltokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise APIError(400, f"the requested format is not a grammar this server can follow: "
                                f"{matcher.get_error()}", "response_format")
        constraint = Constraint(matcher, self.vocab_size, stop_ids)
        if not constraint.allowed[:self.vocab_size].any():
            raise APIError(400, "the requested format cannot be written with this model's vocabulary (its first "
                                "character is not among its tokens)", "response_format")
        return constraint if think is None or self.marks is None else Thinking(constraint, self.marks, think)


class Constraint:
    """One answer's grammar: which tokens may come next (`allowed`, a byte a token, the last the end), and whether
    the answer is complete."""

    def __init__(self, matcher, vocab_size: int, stop_ids: tuple):
        self.matcher, self.vocab_size, self.stop_ids = matcher, vocab_size, stop_ids
        self.allowed = self._allowed()

    def masked(self, logits: torch.Tensor) -> torch.Tensor:
        """The logits (vocab,) with every token the grammar rules out at -inf; the stop ids kept where it may end."""
        allowed = torch.from_numpy(self.allowed[:self.vocab_size] > 0)
        if self.allowed[self.vocab_size]:
            allowed[list(self.stop_ids)] = True
        return logits.masked_fill(~allowed.to(logits.device), float("-inf"))

    def advance(self, token: int) -> bool:
        """The drawn token taken into the grammar; whether the answer is complete (nothing may follow it)."""
        self.matcher.consume_token(token)
        self.allowed = self._allowed()
        may_end = self.allowed[self.vocab_size] and self.stop_ids
        return self.matcher.is_stopped() or not (self.allowed[:self.vocab_size].any() or may_end)

    def _allowed(self) -> np.ndarray:
        return np.frombuffer(self.matcher.compute_logit_bias(), dtype=np.uint8)


def _lltokenizer(tokenizer, vocab_size: int):
    """llguidance's view of this repo's tokenizer (data/tokenizers.py), with END at id vocab_size."""
    from llguidance import LLTokenizer, TokenizerWrapper

    if isinstance(tokenizer, TiktokenTokenizer):
        encoding = tokenizer.encoding
        return LLTokenizer.from_tiktoken(encoder=encoding._mergeable_ranks, pattern=encoding._pat_str,
                                         special_tokens={**encoding._special_tokens, END: vocab_size},
                                         eos_token=vocab_size, n_vocab=vocab_size + 1)
    if isinstance(tokenizer, HFTokenizer):
        from tokenizers import Tokenizer

        extended = Tokenizer.from_str(tokenizer.tokenizer.to_str())
        extended.add_special_tokens([END])
        return LLTokenizer(extended.to_str(), eos_token=vocab_size)
    return LLTokenizer(TokenizerWrapper(_CharTokens(tokenizer)), n_vocab=vocab_size + 1)


class _CharTokens:
    """A char tokenizer as llguidance's TokenizerWrapper reads one: each id's bytes, its end of text (if any) and END
    special (a 0xFF byte starts a special token's bytes, which no text has)."""

    def __init__(self, tokenizer):
        self.ids = tokenizer.stoi
        self.tokens = [c.encode() for c in tokenizer.chars]
        self.special_token_ids = list(range(len(self.tokens), tokenizer.vocab_size + 1))
        self.tokens += [b"\xff" + f"<|special {i}|>".encode() for i in self.special_token_ids]
        self.eos_token_id, self.bos_token_id = tokenizer.vocab_size, None

    def __call__(self, text) -> list[int]:
        """The ids of the text's characters (llguidance tokenizes text it forces; none is outside the vocabulary)."""
        return [self.ids[c] for c in (text.decode() if isinstance(text, bytes) else text) if c in self.ids]


class Thinking:
    """A grammar that begins after the answer's thought, as vLLM's structured outputs under a reasoning parser: while
    the answer thinks any token may come, and the grammar's Constraint rules from the token after </think> on. An
    answer that may think (Qwen 3's, "may") begins with <think> or with the grammar's first token; one whose prompt
    opened the thought (DeepSeek-R1's, "open") thinks first."""

    def __init__(self, constraint: Constraint, marks: tuple[int, int], think: str):
        self.constraint, (self.think_id, self.thought_id) = constraint, marks
        self.state = "thinking" if think == "open" else "first"

    def masked(self, logits: torch.Tensor) -> torch.Tensor:
        if self.state == "thinking":
            return logits
        masked = self.constraint.masked(logits)
        if self.state == "first":  # the grammar's first token, or a thought
            masked[self.think_id] = logits[self.think_id]
        return masked

    def advance(self, token: int) -> bool:
        """As Constraint.advance: whether the answer is complete (never while it thinks)."""
        if self.state == "thinking":
            self.state = "answer" if token == self.thought_id else "thinking"
            return False
        if self.state == "first" and token == self.think_id:
            self.state = "thinking"
            return False
        self.state = "answer"
        return self.constraint.advance(token)
