"""Structured outputs (serving/structured.py) through the server's scheduler, on random models: sampled answers under
a JSON schema are JSON of that schema (its keys, types, bounds and enums), for each kind of tokenizer (characters,
tiktoken's byte-level BPE, a `tokenizers` BPE), where the same model's free answers are not JSON; an answer under a
grammar draws beside free ones what it draws alone; a stop id ends an answer only where the grammar may end; a
grammar the vocabulary cannot begin, or an invalid one, is refused. And through a server, the official client's
parse() of a pydantic model, for chat completions and the Responses API."""
import json
import re
import string

import pytest

from corpora import byte_level_encoding, word_level_tokenizer
from data.tokenizers import CharTokenizer, TiktokenTokenizer, train_bpe
from model.config import ModelConfig
from model.generate import CachedDecoder, Sampling
from model_checks import decisive_model
from servers import MESSAGE, Server, chat_model_export
from serving.errors import APIError
from serving.scheduler import Scheduler, Sequence
from serving.structured import JSON_STYLE, Grammars, grammar_of
from test_scheduler import events

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer", "maximum": 150},
                         "tags": {"type": "array", "maxItems": 3, "items": {"enum": ["king", "crown"]}}}}


def tokenizers() -> dict:
    text = open_text()
    return {"char": CharTokenizer.from_text(string.printable + text[:2000], eot=True),
            "tiktoken": TiktokenTokenizer(byte_level_encoding()),
            "bpe": train_bpe(text.split("\n\n")[:1500] + [json.dumps({"name": "king", "tags": ["crown"]})] * 20, 600)}


def open_text() -> str:
    import os
    with open(os.environ["SHAKESPEARE_TXT"], encoding="utf-8") as f:
        return f.read()


def answers(tokenizer, grammar: str | None, seeds, stop_ids=(), others=0, max_new_tokens=160) -> list:
    """(the tokens, the finish reason) of each seed's sampled answer to one prompt, `others` free answers of other
    seeds running beside them."""
    cfg = ModelConfig(arch="llama", n_layer=2, n_head=4, n_kv_head=2, n_embd=32, ffn_hidden=64, block_size=256,
                      vocab_size=tokenizer.vocab_size)
    model, grammars = decisive_model(cfg, seed=5, scale=0.1), Grammars(tokenizer)
    sampling = Sampling(max_new_tokens, temperature=1.0, stop_ids=stop_ids)
    scheduler = Scheduler(CachedDecoder(model, 256, cfg.vocab_size, slots=8), slots=8, max_waiting=16)
    try:
        prompt = tokenizer.encode("KING: ")
        constrained = [Sequence(prompt, sampling, seed, constraint=None if grammar is None else
                                grammars.constraint(grammar, stop_ids)) for seed in seeds]
        free = [Sequence(prompt, sampling, 100 + i) for i in range(others)]
        for sequence in [*constrained, *free]:
            scheduler.submit(sequence)
        done = [events(s) for s in constrained]
        [events(s) for s in free]
    finally:
        scheduler.close()
    return [([v.id for kind, v in seen if kind == "token"], seen[-1][1]) for seen in done]


def schema_held(value) -> bool:
    return (set(value) == {"name", "age", "tags"} and isinstance(value["name"], str) and len(value["name"]) <= 8
            and type(value["age"]) is int and value["age"] <= 150 and len(value["tags"]) <= 3
            and set(value["tags"]) <= {"king", "crown"})


@pytest.mark.parametrize("kind", ["char", "tiktoken", "bpe"])
def test_sampled_answers_under_a_json_schema_are_json_of_the_schema(kind):
    tokenizer = tokenizers()[kind]
    grammar = grammar_of({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}}})
    got = answers(tokenizer, grammar, seeds=range(4), others=2)
    for tokens, reason in got:
        text = tokenizer.decode(tokens)
        assert reason == "stop" and schema_held(json.loads(text)), text
        assert text == json.dumps(json.loads(text), ensure_ascii=False) or "\\" in text  # json.dumps' spacing
    assert len({tuple(tokens) for tokens, _ in got}) == 4
    assert answers(tokenizer, grammar, seeds=[2])[0] == got[2]  # alone as beside the others
    for tokens, _ in answers(tokenizer, None, seeds=range(4), max_new_tokens=40):
        with pytest.raises(json.JSONDecodeError):  # the model's own answers are not JSON: the grammar made them so
            json.loads(tokenizer.decode(tokens))


def test_a_stop_id_ends_an_answer_only_where_the_grammar_may_end_and_nothing_ends_it_where_it_must():
    tokenizer = tokenizers()["char"]
    grammar = grammar_of({"structured_outputs": {"regex": "(king|crown)( (king|crown)){0,5}"}})
    eot = tokenizer.eot_id
    got = answers(tokenizer, grammar, seeds=range(6), stop_ids=(eot,))
    for tokens, reason in got:
        assert reason == "stop"
        text = tokenizer.decode(tokens[:-1] if tokens[-1] == eot else tokens)
        assert re.fullmatch("(king|crown)( (king|crown)){0,5}", text) and eot not in tokens[:-1], tokens
    assert {tokens[-1] == eot for tokens, _ in got} == {True}  # the model ended each where it might
    choice = grammar_of({"structured_outputs": {"choice": ["king crown"]}})
    # Nothing may follow the one choice: the answer ends with it, no stop id drawn.
    assert answers(tokenizer, choice, seeds=[0], stop_ids=(eot,)) == [(tokenizer.encode("king crown"), "stop")]


def test_vllms_choice_json_and_lark_forms_and_json_object_give_their_grammars():
    from llguidance import LLMatcher
    assert grammar_of({}) is None and grammar_of({"response_format": {"type": "text"}}) is None
    assert grammar_of({"structured_outputs": {"json": json.dumps(SCHEMA)}}) == \
        LLMatcher.grammar_from_json_schema(SCHEMA, JSON_STYLE)
    assert grammar_of({"response_format": {"type": "json_object"}}) == \
        LLMatcher.grammar_from_json_schema({"type": "object"}, JSON_STYLE)
    tokenizer = tokenizers()["char"]
    choices = ["king crown", "crown. king?"]
    grammar = grammar_of({"structured_outputs": {"choice": choices}})
    for tokens, reason in answers(tokenizer, grammar, seeds=range(6)):
        assert tokenizer.decode(tokens) in choices and reason == "stop"
    lark = grammar_of({"structured_outputs": {"grammar": 'start: WORD ("; " WORD){2}\nWORD: "king" | "crown"'}})
    for tokens, reason in answers(tokenizer, lark, seeds=range(6)):
        assert re.fullmatch("(king|crown); (king|crown); (king|crown)", tokenizer.decode(tokens)) and reason == "stop"


@pytest.mark.parametrize("body,message", [
    ({"response_format": {"type": "xml"}}, "response_format must be"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema.schema must be a JSON schema"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
     "response_format and structured_outputs both ask for a format"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs must give exactly one of"),
    ({"structured_outputs": {"grammar": ["start: a"]}}, "structured_outputs.grammar must be a string"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice must be a non-empty list of strings"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json must be a JSON schema")])
def test_a_malformed_format_is_a_400_naming_it(body, message):
    with pytest.raises(APIError) as e:
        grammar_of(body)
    assert e.value.status == 400 and str(e.value).startswith(message), str(e.value)


def test_a_tokenizer_llguidance_cannot_read_refuses_every_format():
    grammars = Grammars(word_level_tokenizer(open_text().split("\n\n")[:200]))
    assert grammars.unavailable == "ValueError: can't determine decoder type: None"
    with pytest.raises(APIError, match=r"structured outputs are not available for this model's tokenizer \(llguidance "
                                       r"cannot read it: ValueError: can't determine decoder type: None\)"):
        grammars.constraint(grammar_of({"structured_outputs": {"choice": ["the king"]}}), ())


def test_a_format_the_vocabulary_cannot_begin_or_an_invalid_grammar_is_refused():
    grammars = Grammars(CharTokenizer.from_text("king crown"))
    with pytest.raises(APIError, match="cannot be written with this model's vocabulary"):
        grammars.constraint(grammar_of({"response_format": {"type": "json_object"}}), ())
    with pytest.raises(APIError, match="not a grammar this server can follow"):
        grammars.constraint(grammar_of({"structured_outputs": {"regex": "(king"}}), ())
    with pytest.raises(APIError, match="not a grammar this server can follow: .*Expected token"):
        grammars.constraint(grammar_of({"structured_outputs": {"grammar": "start: ("}}), ())


@pytest.mark.launch
def test_the_official_clients_parse_of_a_pydantic_model_gets_one(tmp_path):
    """openai's `parse` sends the model's schema as a strict json_schema and reads the answer into the model: a random
    model over a byte-level BPE answers with one, through chat completions and the Responses API."""
    from pydantic import BaseModel, Field

    class Word(BaseModel):
        word: str = Field(max_length=6)
        count: int = Field(ge=0, le=9)
        sure: bool

    server = Server(chat_model_export(tmp_path, block_size=256, tokenizer="bpe:300"))
    try:
        client = server.client()
        messages = [{"role": "user", "content": MESSAGE}]
        for seed in (1, 2):
            chat = client.chat.completions.parse(model="export", messages=messages, response_format=Word, seed=seed,
                                                 max_tokens=100)
            assert isinstance(chat.choices[0].message.parsed, Word), chat.choices[0].message.content
            answer = client.responses.parse(model="export", input=MESSAGE, text_format=Word, max_output_tokens=100,
                                            extra_body={"seed": seed})
            assert isinstance(answer.output_parsed, Word), answer.output_text
    finally:
        code, output = server.stop()
    assert code == 0 and "Traceback" not in output, output
