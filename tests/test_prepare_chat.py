"""`python -m data.prepare --format chat`: conversations into tokens and loss masks (data/prepare_chat.py). The
masks written are transformers' assistant masks; the three record formats give one dataset; overlong
conversations are cut or left out and counted; bad records, templates and tokenizer files end the preparation in
one line naming the file (and line), with the earlier dataset kept."""
import json
import shutil
import sys

import pytest

import data.prepare
from chats import CHATML, CONVERSATIONS, chatml_folder, documents, reverse_tasks, write_jsonl
from data.prepare_chat import prepare_chat
from data.readers import InputError
from data.tokenizers import HFTokenizer
from harness import run
from refusals import assert_refused, command

# Short conversations enough for both splits at val_fraction 0.3.
FILLER = [[{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"answer {i}"}] for i in range(12)]


def all_documents(out_dir) -> list:
    return sorted(documents(out_dir, "train") + documents(out_dir, "val"))


@pytest.fixture(scope="module")
def chatml_tokenizer(tmp_path_factory, shakespeare_path):
    return chatml_folder(tmp_path_factory.mktemp("chatml"), shakespeare_path)


def test_the_written_masks_are_transformers_assistant_masks(tmp_path, chatml_tokenizer):
    from transformers import PreTrainedTokenizerFast

    inputs = write_jsonl(tmp_path / "chats.jsonl", [{"messages": turns} for turns in CONVERSATIONS * 4])
    meta = prepare_chat([inputs], str(tmp_path / "out"), str(chatml_tokenizer / "tokenizer.json"),
                        val_fraction=0.3)
    reference = PreTrainedTokenizerFast(tokenizer_file=str(chatml_tokenizer / "tokenizer.json"))
    reference.chat_template = CHATML
    expected = sorted(
        (out["input_ids"], out["assistant_masks"]) for out in
        (reference.apply_chat_template(turns, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
         for turns in CONVERSATIONS * 4))
    assert all_documents(tmp_path / "out") == expected
    assert meta["chat"]["template"].endswith("tokenizer_config.json")
    assert meta["chat"]["formats"] == {inputs: "messages"}
    assert meta["chat"]["train_supervised_tokens"] + meta["chat"]["val_supervised_tokens"] == \
        sum(sum(mask[1:]) for _, mask in expected)


def test_tool_use_records_are_written_as_transformers_renders_and_masks_them(tmp_path, chatml_tokenizer):
    """Records with tools, through --chat_template hermes: the written tokens and masks are transformers' for the same
    template given the same tools."""
    from transformers import PreTrainedTokenizerFast

    from data.chat import BUILTIN_TEMPLATES
    from test_chat import TOOL_USE, WEATHER, as_transformers

    records = [{"messages": TOOL_USE, "tools": [WEATHER]}, *({"messages": turns} for turns in CONVERSATIONS)] * 3
    inputs = write_jsonl(tmp_path / "tools.jsonl", records)
    prepare_chat([inputs], str(tmp_path / "out"), str(chatml_tokenizer / "tokenizer.json"), "hermes",
                 context=1024, val_fraction=0.3)
    reference = PreTrainedTokenizerFast(tokenizer_file=str(chatml_tokenizer / "tokenizer.json"))
    reference.chat_template = BUILTIN_TEMPLATES["hermes"]
    expected = sorted((out["input_ids"], out["assistant_masks"]) for out in (
        reference.apply_chat_template(as_transformers(r["messages"]), tools=r.get("tools"), tokenize=True,
                                      return_dict=True, return_assistant_tokens_mask=True) for r in records))
    assert all_documents(tmp_path / "out") == expected
    assert sum(reference.decode(ids).startswith("System: you may call these tools") for ids, _ in expected) == 3


# Llama's and Mistral's layout: the tokenizer's special tokens written by the template, a BOS first and the end of
# each answer the EOS (Mistral's </s>; stand-ins here from ChatML's tokens)
SPECIAL = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}"
           "{{ eos_token }}{% endgeneration %}{% else %}[INST] {{ m['content'] }} [/INST]{% endif %}{% endfor %}")


def test_a_template_writes_the_tokenizers_special_tokens_as_transformers_gives_them(tmp_path, chatml_tokenizer):
    """The special tokens of the tokenizer's tokenizer_config.json (bos_token, eos_token, ...) reach the template,
    whichever template renders (its own or --chat_template FILE): transformers' ids and masks; recorded, so serving
    renders prompts with them, and written into the export's tokenizer_config.json."""
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    from data.chat import chat_prompt
    from training.checkpoints.export import chat_tokenizer_config

    folder = tmp_path / "tokenizer"
    shutil.copytree(chatml_tokenizer, folder)
    added = {"__type": "AddedToken", "content": "<|im_end|>", "lstrip": False, "normalized": False, "rstrip": False,
             "single_word": False, "special": True}  # as older tokenizer_config.json files write one
    config = {"chat_template": SPECIAL, "bos_token": "<|im_start|>", "eos_token": added}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    inputs = write_jsonl(tmp_path / "chats.jsonl", [{"messages": turns} for turns in CONVERSATIONS * 4])
    meta = prepare_chat([inputs], str(tmp_path / "out"), str(folder), val_fraction=0.5)
    reference = AutoTokenizer.from_pretrained(str(folder))
    expected = sorted((out["input_ids"], out["assistant_masks"]) for out in (
        reference.apply_chat_template(turns, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        for turns in CONVERSATIONS * 4))
    assert all_documents(tmp_path / "out") == expected
    bos, eos = reference.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    assert expected[0][0][0] == bos and meta["chat"]["end_of_turn_id"] == eos
    assert meta["chat"]["special_tokens"] == {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"}
    (tmp_path / "template.jinja").write_text(SPECIAL)
    prepare_chat([inputs], str(tmp_path / "file"), str(folder), str(tmp_path / "template.jinja"), val_fraction=0.5)
    assert all_documents(tmp_path / "file") == expected
    tokenizer = HFTokenizer(Tokenizer.from_file(str(folder / "tokenizer.json")), "tokenizer.json")
    ids, _ = chat_prompt([{"role": "user", "content": "Speak."}], meta, tokenizer, "", "")
    asked = [{"role": "user", "content": "Speak."}]
    assert ids == reference.apply_chat_template(asked, tokenize=True, return_dict=True)["input_ids"] and ids[0] == bos
    assert chat_tokenizer_config(meta)["bos_token"] == "<|im_start|>"
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "bos_token": "<|im_end|>"}))
    with pytest.raises(InputError, match="already holds a dataset, of other inputs or options"):  # not "done"
        prepare_chat([inputs], str(tmp_path / "out"), str(folder), val_fraction=0.5)


def test_the_builtin_chatml_prepares_what_the_same_template_in_tokenizer_config_does(tmp_path, chatml_tokenizer):
    """--chat_template chatml with a tokenizer.json that holds ChatML's tokens (its folder's tokenizer_config.json
    holds the same template): the same documents, and <|im_end|> the end of turn."""
    inputs = write_jsonl(tmp_path / "chats.jsonl", [{"messages": turns} for turns in CONVERSATIONS * 4])
    tokenizer = str(chatml_tokenizer / "tokenizer.json")
    meta = prepare_chat([inputs], str(tmp_path / "builtin"), tokenizer, "chatml", val_fraction=0.3)
    prepare_chat([inputs], str(tmp_path / "config"), tokenizer, val_fraction=0.3)
    assert all_documents(tmp_path / "builtin") == all_documents(tmp_path / "config")
    assert (meta["chat"]["template"], meta["chat"]["end_of_turn"]) == ("chatml", "<|im_end|>")


def test_the_three_formats_prepare_one_dataset(tmp_path):
    pairs = [("Sort: 3 1 2", "1 2 3"), ("Reverse: a b", "b a"), ("Echo: hi", "hi")]
    records = {
        "messages": [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}
                     for q, a in pairs],
        "sharegpt": [{"conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": a}]} for q, a in pairs],
        "alpaca": [{"instruction": q, "input": "", "output": a} for q, a in pairs],
    }
    prepared = {}
    for kind, rows in records.items():
        meta = prepare_chat([write_jsonl(tmp_path / f"{kind}.jsonl", rows)], str(tmp_path / kind), "char",
                            val_fraction=0.3)
        assert list(meta["chat"]["formats"].values()) == [kind]
        prepared[kind] = all_documents(tmp_path / kind)
    assert prepared["messages"] == prepared["sharegpt"] == prepared["alpaca"]


@pytest.mark.parametrize("overlong, kept, counts", [("truncate", 13, {"truncated": 1, "dropped_overlong": 0}),
                                                    ("drop", 12, {"truncated": 0, "dropped_overlong": 1})])
def test_overlong_conversations_are_cut_or_left_out_and_counted(tmp_path, overlong, kept, counts):
    turns = [*FILLER, [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a very long answer " * 5}]]
    inputs = write_jsonl(tmp_path / "c.jsonl", [{"messages": t} for t in turns])
    meta = prepare_chat([inputs], str(tmp_path / "out"), "char", context=40, overlong=overlong, val_fraction=0.3)
    assert {k: meta["chat"][k] for k in counts} == counts
    lengths = [len(tokens) for tokens, _ in all_documents(tmp_path / "out")]
    assert len(lengths) == kept and max(lengths) <= 41


def test_a_conversation_cut_before_its_answer_is_left_out(tmp_path):
    turns = [[{"role": "user", "content": "a long question " * 5}, {"role": "assistant", "content": "yes"}], *FILLER]
    inputs = write_jsonl(tmp_path / "c.jsonl", [{"messages": t} for t in turns])
    meta = prepare_chat([inputs], str(tmp_path / "out"), "char", context=30, val_fraction=0.3)
    assert meta["chat"]["dropped_unsupervised"] == 1 and len(all_documents(tmp_path / "out")) == 12


def test_a_bad_record_ends_the_preparation_with_its_file_and_line(tmp_path):
    inputs = write_jsonl(tmp_path / "c.jsonl", [{"messages": CONVERSATIONS[0]}, {"messages": [
        {"role": "user", "content": "hi"}]}])
    proc = run([sys.executable, "-m", "data.prepare", "--format", "chat", "--input", inputs, "--out_dir",
                str(tmp_path / "out")], check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert f"error: {inputs}:2: the conversation has no assistant turn" in proc.stderr
    assert not (tmp_path / "out" / "meta.json").exists()


def test_mixed_formats_in_one_file_are_refused(tmp_path):
    mixed = write_jsonl(tmp_path / "mixed.jsonl", [{"messages": CONVERSATIONS[0]},
                                                   {"instruction": "q", "output": "a"}])
    with pytest.raises(InputError, match=r"mixed.jsonl:2: a alpaca record in a file of messages records"):
        prepare_chat([mixed], str(tmp_path / "a"), "char")


# Qwen 3's way: the last answer rendered after an empty thought, earlier ones without it
THINKING_LAST = ("{% for m in messages %}{% if m['role'] == 'assistant' and loop.last %}<|im_start|>assistant\n"
                 "<think>\n\n</think>\n\n{{ m['content'] }}<|im_end|>\n{% else %}<|im_start|>{{ m['role'] }}\n"
                 "{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


# Qwen 2.5's layout: a newline after each <|im_end|>, outside the assistant's part
QWEN = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['role'] == 'assistant' %}{% generation %}"
        "{{ m['content'] }}<|im_end|>{% endgeneration %}{% else %}{{ m['content'] }}<|im_end|>{% endif %}{{ '\\n' }}"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.mark.parametrize("train_on", ["all", "last"])
@pytest.mark.parametrize("template", [CHATML, QWEN], ids=["chatml", "newline_after_each_turn"])
def test_a_template_without_marks_trains_what_its_marked_twin_does(tmp_path, chatml_tokenizer, template, train_on):
    """A Hub model's template marks no {% generation %}: each answer is what its turn adds after the prompt that asks
    for it, less the trailing newline; a template without its marks prepares the marked one's ids and masks, byte
    for byte, and records the same end of turn."""
    (tmp_path / "marked.jinja").write_text(template)
    unmarked = tmp_path / "unmarked.jinja"
    unmarked.write_text(template.replace("{% generation %}", "").replace("{% endgeneration %}", ""))
    inputs = write_jsonl(tmp_path / "chats.jsonl", [{"messages": turns} for turns in CONVERSATIONS] + reverse_tasks(20))
    tokenizer = str(chatml_tokenizer / "tokenizer.json")
    marked = prepare_chat([inputs], str(tmp_path / "marked"), tokenizer, str(tmp_path / "marked.jinja"), train_on,
                          val_fraction=0.5)
    found = prepare_chat([inputs], str(tmp_path / "found"), tokenizer, str(unmarked), train_on, val_fraction=0.5)
    assert all_documents(tmp_path / "found") == all_documents(tmp_path / "marked")
    assert found["chat"]["end_of_turn"] == marked["chat"]["end_of_turn"] == "<|im_end|>"


def test_answers_a_template_renders_otherwise_once_later_turns_follow_are_found_last_only(tmp_path, chatml_tokenizer):
    """Qwen 3's template drops an answer's thought once a later turn follows: its earlier answers cannot be found
    without marks (refused, naming the fix), its last one can (--train_on last)."""
    from tokenizers import Tokenizer

    template = tmp_path / "thinking.jinja"
    template.write_text(THINKING_LAST)
    inputs = write_jsonl(tmp_path / "chats.jsonl", [{"messages": turns} for turns in CONVERSATIONS * 4])
    tokenizer = str(chatml_tokenizer / "tokenizer.json")
    with pytest.raises(InputError) as refused:
        prepare_chat([inputs], str(tmp_path / "all"), tokenizer, str(template), val_fraction=0.3)
    assert str(refused.value) == (
        f"the chat template {template} fails on the conversation {inputs}:2 (it renders turn 3, an answer, otherwise "
        f"once its prompt or later turns follow, so its answers are not found without {{% generation %}} marks); fix: "
        f"pass --train_on last (the last answer is found whatever comes before it), or a --chat_template FILE that "
        f"marks each answer with {{% generation %}}")
    prepare_chat([inputs], str(tmp_path / "last"), tokenizer, str(template), "last", val_fraction=0.5)
    decode = Tokenizer.from_file(tokenizer).decode
    answers = {decode([i for i, m in zip(ids, mask) if m], skip_special_tokens=False)
               for ids, mask in all_documents(tmp_path / "last")}
    assert answers == {f"<think>\n\n</think>\n\n{last}<|im_end|>" for last in ("A man, sir.", "Anon.",
                                                                                 " leading and trailing spaces  ")}


def bad_chat_inputs(folder, tokenizer_json) -> None:
    """The files CHAT_ROWS hand data.prepare: records of each format, templates and tokenizer folders that are not
    what they should be, and a good JSONL."""
    write_jsonl(folder / "good.jsonl", [{"messages": t} for t in FILLER])
    user, answer = {"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}
    records = {
        "number.jsonl": {"messages": [{"role": "user", "content": 42}, answer]},
        "null.jsonl": {"messages": [user, {"role": "assistant", "content": None}]},
        "tool_calls.jsonl": {"messages": [user, {"role": "assistant", "content": None, "tool_calls": [
            {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]},
        "image.jsonl": {"messages": [{"role": "user", "content": [{"type": "text", "text": "What is it?"}, {
            "type": "image_url", "image_url": {"url": "https://example.com/a.png"}}]}, answer]},
        "sharegpt.jsonl": {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": 7.5}]},
        "alpaca.jsonl": {"instruction": "q", "input": ["x"], "output": "a"},
    }
    for name, record in records.items():
        write_jsonl(folder / name, [{"messages": FILLER[0]} if "messages" in record else record, record])
    (folder / "latin1.jsonl").write_bytes('{"instruction": "caf\u00e9", "output": "a"}\n'.encode("latin-1"))
    loop = "{% for m in messages %}\n{% generation %}{{ m.content }}{% endgeneration %}\n"
    templates = {
        "syntax.jinja": "{% for m in messages %}\n\n{{ m.content }\n{% endfor %}",
        "no_filter.jinja": "{% for m in messages %}\n{{ m.content | shout }}{% endfor %}",
        "call.jinja": loop + "{{ bos() }}{% endfor %}",
        "attribute.jinja": loop + "\n{{ settings.bos }}{% endfor %}",
        "filter.jinja": loop + "{{ m.content | format(1) }}{% endfor %}",
        "raise.jinja": loop + "{% if m.role == 'system' %}{{ raise_exception('System role not supported') }}"
                              "{% endif %}{% endfor %}",
        "unmarked_first.jinja": "{% for m in messages %}{% if m.role == 'bot' %}{% generation %}{% endgeneration %}"
                                "{% endif %}{{ m.content }}\n{% endfor %}",
    }
    for name, source in templates.items():
        (folder / name).write_text(source)
    (folder / "latin1.jinja").write_bytes("{{ 'caf\u00e9' }}".encode("latin-1"))
    # The characters of a one-document text (the quickstart's: no end-of-text), as a dataset's folder holds them:
    # all those good.jsonl needs through the template lines, or all but q.
    chars = sorted(set("".join(f"User: {q['content']}\nAssistant: {a['content']}\n" for q, a in FILLER)))
    for name, kept in (("one_document", chars), ("without_q", [c for c in chars if c != "q"])):
        (folder / name).mkdir()
        (folder / name / "meta.json").write_text(json.dumps({"format": 2, "tokenizer": "char", "chars": kept,
                                                             "vocab_size": len(kept), "eot_id": None}))
    write_jsonl(folder / "system.jsonl", [{"messages": FILLER[0]}, {"messages": CONVERSATIONS[1]}])
    configs = {
        "config_not_json": '{"chat_template": "x",}',
        "config_number": json.dumps({"chat_template": 3}),
        "config_named": json.dumps({"chat_template": [{"name": "default", "template": CHATML}]}),
        "config_list": json.dumps([CHATML]),
        "config_raise": json.dumps({"chat_template": templates["raise.jinja"]}),
        "bad_tokenizer": json.dumps({"chat_template": CHATML}),
    }
    for name, config in configs.items():
        (folder / name).mkdir()
        shutil.copyfile(tokenizer_json, folder / name / "tokenizer.json")
        (folder / name / "tokenizer_config.json").write_text(config)
    (folder / "bad_tokenizer" / "tokenizer.json").write_text('{"version": "1.0", "model": ')


PART = '{{"type": "text", "text": "..."}}'  # braces doubled: a row's message is formatted with the paths
TEMPLATE_FIX = "fix: correct the template at that line, or pass another --chat_template FILE$"
CONFIG_FIX = "pass --chat_template FILE (a Jinja chat template), or --chat_template plain$"
# (flags, the one error line after "error: "; "$": it ends there)
CHAT_ROWS = [
    ({"--input": "{inputs}/number.jsonl"}, "{inputs}/number.jsonl:2: messages[0].content must be a string or a list "
     f"of text parts {PART}, not a number (42); fix the record or leave it out$"),
    ({"--input": "{inputs}/null.jsonl"}, "{inputs}/null.jsonl:2: messages[1].content is null: a turn's content must "
     f"be a string or a list of text parts {PART}; fix the record or leave it out$"),
    ({"--input": "{inputs}/tool_calls.jsonl"}, "{inputs}/tool_calls.jsonl:2: a conversation that uses tools, which the "
     "built-in template plain does not render (it reads no `tools`); fix: pass --chat_template hermes, or the "
     "model's own template that renders them$"),
    ({"--input": "{inputs}/image.jsonl"}, "{inputs}/image.jsonl:2: messages[0].content[1] is a part of type "
     f"'image_url': only text parts {PART} are trained on; fix the record or leave it out$"),
    ({"--input": "{inputs}/sharegpt.jsonl"}, "{inputs}/sharegpt.jsonl:1: conversations[1].value must be a string or a "
     f"list of text parts {PART}, not a number (7.5); fix the record or leave it out$"),
    ({"--input": "{inputs}/alpaca.jsonl"}, '{inputs}/alpaca.jsonl:1: "input" must be a string, not a list (["x"]); '
     "fix the record or leave it out$"),
    ({"--input": "{inputs}/latin1.jsonl"}, "{inputs}/latin1.jsonl:1: not UTF-8 text (byte 0xe9 at column 21); fix the "
     "record or leave it out$"),
    ({"--chat_template": "{inputs}/syntax.jinja"}, "the chat template {inputs}/syntax.jinja is not valid Jinja at line "
     "3 (unexpected '}}'); " + TEMPLATE_FIX),
    ({"--chat_template": "{inputs}/no_filter.jinja"}, "the chat template {inputs}/no_filter.jinja is not valid Jinja "
     f"at line 2 (No filter named 'shout'.); {TEMPLATE_FIX}"),
    ({"--chat_template": "{inputs}/call.jinja"}, "the chat template {inputs}/call.jinja fails at line 3 on the "
     f"conversation {{inputs}}/good.jsonl:1 (UndefinedError: 'bos' is undefined); {TEMPLATE_FIX}"),
    ({"--chat_template": "{inputs}/attribute.jinja"}, "the chat template {inputs}/attribute.jinja fails at line 4 on "
     f"the conversation {{inputs}}/good.jsonl:1 (UndefinedError: 'settings' is undefined); {TEMPLATE_FIX}"),
    ({"--chat_template": "{inputs}/filter.jinja"}, "the chat template {inputs}/filter.jinja fails at line 3 on the "
     "conversation {inputs}/good.jsonl:1 (TypeError: not all arguments converted during string formatting); "
     f"{TEMPLATE_FIX}"),
    ({"--chat_template": "{inputs}/raise.jinja", "--input": "{inputs}/system.jsonl"}, "the chat template "
     "{inputs}/raise.jinja fails at line 3 on the conversation {inputs}/system.jsonl:2 (raise_exception: System role "
     "not supported); fix: leave the record out, or correct the template at that line$"),
    ({"--chat_template": "{inputs}/unmarked_first.jinja"}, "the chat template {inputs}/unmarked_first.jinja renders "
     "no token of the last answer of the first conversation of {inputs}/good.jsonl (its {{% generation %}} blocks, "
     "or the text the answer adds to its prompt); fix: correct the template, or pass another --chat_template FILE$"),
    ({"--chat_template": "{inputs}/latin1.jinja"}, "{inputs}/latin1.jinja is not UTF-8 text (byte 0xe9 at offset 7); "
     "fix: pass a Jinja chat template file$"),
    ({"--tokenizer": "{inputs}/config_not_json/tokenizer.json"}, "{inputs}/config_not_json/tokenizer_config.json is "
     f"not JSON (Expecting property name enclosed in double quotes at line 1, column 23); fix: correct it, or "
     f"{CONFIG_FIX}"),
    ({"--tokenizer": "{inputs}/config_number/tokenizer.json"}, "the chat_template of {inputs}/config_number/"
     f"tokenizer_config.json is a number (3), not a string (a Jinja template); fix: {CONFIG_FIX}"),
    ({"--tokenizer": "{inputs}/config_named/tokenizer.json"}, "the chat_template of {inputs}/config_named/"
     'tokenizer_config.json is a list ([{{"name": "default", "template": "{{% for), not a string (a Jinja '
     "template); fix: " + CONFIG_FIX),
    ({"--tokenizer": "{inputs}/config_list/tokenizer.json"}, "{inputs}/config_list/tokenizer_config.json is a list "
     '(["{{% for message in messages %}}<|im_star), not a JSON object; fix: correct it, or ' + CONFIG_FIX),
    ({"--tokenizer": "{inputs}/config_raise/tokenizer.json", "--input": "{inputs}/system.jsonl"}, "the chat_template "
     "of {inputs}/config_raise/tokenizer_config.json fails at line 3 on the conversation {inputs}/system.jsonl:2 "
     "(raise_exception: System role not supported); fix: leave the record out, or correct the template at that line$"),
    ({"--tokenizer": "{inputs}/bad_tokenizer/tokenizer.json"}, "could not read the tokenizer file "
     "{inputs}/bad_tokenizer/tokenizer.json (Exception: EOF while parsing a value at line 1 column 28): pass a Hugging "
     "Face tokenizer.json, e.g. --tokenizer path/to/Meta-Llama-3-8B/tokenizer.json$"),
    ({"--val_fraction": "1.5"}, "--val_fraction 1.5: must be above 0 and below 1; fix: pass the share of the "
     "documents held out, e.g. --val_fraction 0.01$"),
    ({"--val_fraction": "0"}, "--val_fraction 0.0: must be above 0 and below 1"),
    ({"--context": "1"}, "none of the 12 conversations keeps an assistant token within --context 1; fix: pass the "
     "model's block_size as --context$"),
    ({"--chat_template": "chatml"}, "the built-in template chatml needs <|im_start|> and <|im_end|> as tokens of their "
     "own, which --tokenizer char does not hold; fix: pass a tokenizer that has them (Qwen's), or --chat_template "
     "plain$"),
    ({"--chat_template": "plain", "--tokenizer": "{inputs}/one_document"}, "the built-in template plain ends each "
     "answer with <|endoftext|>, which the tokenizer of --tokenizer {inputs}/one_document (24 characters, no "
     "end-of-text token) does not hold; fix: pass --chat_template lines (each answer ends with a newline), or leave "
     "--chat_template out$"),
    ({"--tokenizer": "{inputs}/no_export"}, "--tokenizer {inputs}/no_export not found: pass a Hugging Face "
     "tokenizer.json, or a folder that holds a tokenizer (an export of python -m scripts.export, a prepared "
     "dataset)$"),
    ({"--tokenizer": "{inputs}/without_q"}, "{inputs}/good.jsonl:1: the conversation does not encode with "
     "--tokenizer {inputs}/without_q (character 'q' is not in this dataset's vocabulary); fix: leave the record out, "
     "or write it in the tokenizer's characters$"),
]


@pytest.fixture(scope="module")
def chat_inputs(tmp_path_factory, chatml_tokenizer):
    folder = tmp_path_factory.mktemp("bad_chats")
    bad_chat_inputs(folder, chatml_tokenizer / "tokenizer.json")
    return folder


@pytest.fixture(scope="module")
def earlier(tmp_path_factory, chat_inputs):
    """A conversation dataset that each refused preparation, with --force, would have replaced."""
    out = tmp_path_factory.mktemp("earlier") / "data"
    prepare_chat([str(chat_inputs / "good.jsonl")], str(out), "char", val_fraction=0.3)
    return out


@pytest.mark.parametrize("flags,message", CHAT_ROWS, ids=[next(iter(f)) + "=" + list(f.values())[0].split("/")[-2 if
                                                          f.get("--tokenizer", "").endswith(".json") else -1]
                                                          for f, _ in CHAT_ROWS])
def test_prepare_chat_refuses(chat_inputs, earlier, tmp_path, capsys, flags, message):
    out = tmp_path / "out"
    shutil.copytree(earlier, out)
    paths = {"inputs": chat_inputs}
    base = {"--format": "chat", "--input": "{inputs}/good.jsonl", "--out_dir": str(out), "--force": True,
            "--val_fraction": "0.3"}
    assert_refused(data.prepare.main, command(base, flags, paths), message, paths, capsys, [chat_inputs, out])

