"""Multiple-choice tasks in-process: HellaSwag's JSONL read and refused line by line, hellaswag fetched once, the
scoring rule (rows, acc, acc_norm) against hand-computed examples, each data-parallel rank's share, and the
lm-evaluation-harness model interface against the model's own log-probabilities."""
import json
import string
import urllib.request

import pytest
import torch

import data.tasks
from common.checks import ConfigError
from data.tasks import Example, Task, harness_task, pair_ids, read_task, task_file
from data.token_data import IGNORE
from data.tokenizers import CharTokenizer
from model import build_model
from model.config import ModelConfig
from training.evaluation.lm_eval_model import CheckpointLM, RequestError
from training.evaluation.multiple_choice import ChoiceScorer, batches, choice_row, choose, open_tasks, right_answers

CHARS = CharTokenizer(list(string.ascii_letters + string.punctuation + " \n"), eot=True)


def write_task(path, records) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return str(path)


def test_a_task_is_read_and_tokenized_as_the_harness_reads_it(tmp_path):
    """Each ending is " " + ending after ctx; the Hugging Face copy's string labels are read; `limit` takes the
    first examples; a context ending in spaces moves them to the choices, as the harness's adapters do."""
    path = write_task(tmp_path / "toy.jsonl", [{"ctx": "ab", "endings": ["c", "de"], "label": "1"},
                                               {"ctx": "x ", "endings": ["y", "z"], "label": 0}, ""])
    task = read_task(path, CHARS)
    assert task.name == "toy" and [e.label for e in task.examples] == [1, 0]
    assert task.examples[0].context_ids == CHARS.encode("ab")
    assert task.examples[0].ending_ids == [CHARS.encode(" c"), CHARS.encode(" de")]
    assert task.examples[1].context_ids == CHARS.encode("x")
    assert task.examples[1].ending_ids == [CHARS.encode("  y"), CHARS.encode("  z")]
    assert pair_ids(CHARS, "x ", " y") == (CHARS.encode("x"), CHARS.encode("  y"))
    assert len(read_task(path, CHARS, limit=1).examples) == 1


BAD_LINES = [
    ("{not json", "line 2: Expecting property name"),
    ('["a"]', "line 2: an example is a JSON object, not list"),
    ('{"ctx": "a", "endings": ["b", "c"]}', "line 2: the example lacks label"),
    ('{"ctx": "", "endings": ["b", "c"], "label": 0}', "line 2: ctx must be a non-empty string"),
    ('{"ctx": "a", "endings": ["b"], "label": 0}', "line 2: endings must be a list of two or more non-empty strings"),
    ('{"ctx": "a", "endings": ["b", "c"], "label": 2}', "line 2: label must be the index of the right ending, 0 to 1, "
                                                         "not 2"),
    ('{"ctx": "a", "endings": ["b", "c"], "label": true}', "line 2: label must be the index"),
    ('{"ctx": "café", "endings": ["b", "c"], "label": 0}', "line 2: character 'é' is not in this dataset's "
                                                           "vocabulary; fix: write one example a line in HellaSwag's "
                                                           "format"),
    ('{"endings": ["b", "c"]}', "line 2: the example lacks ctx, label; fix:"),
    ('{"ctx": 3, "endings": ["b", "c"], "label": 0}', "line 2: ctx must be a non-empty string; fix:"),
    ('{"ctx": "a", "endings": "b c", "label": 0}', "line 2: endings must be a list of two or more non-empty strings; "
                                                   "fix:"),
    ('{"ctx": "a", "endings": ["b", 2], "label": 0}', "line 2: endings must be a list of two or more non-empty "
                                                      "strings; fix:"),
    ('{"ctx": "a", "endings": ["b", "c"], "label": -1}', "line 2: label must be the index of the right ending, 0 to "
                                                         "1, not -1; fix:"),
    ('{"ctx": "a", "endings": ["b", "c"], "label": 1.0}', "line 2: label must be the index of the right ending, 0 to "
                                                          "1, not 1.0; fix:"),
    ('{"ctx": "a", "endings": ["b", "c"], "label": "one"}', 'line 2: label must be the index of the right ending, 0 '
                                                            'to 1, not "one"; fix:'),
    ('{"ctx": "a", "endings": ["b", "c"], "label": null}', "line 2: label must be the index of the right ending, 0 "
                                                           "to 1, not null; fix:"),
    ('{"ctx": "a", "endings": ["b", "c"], "label": 0} {}', "line 2: Extra data: line 1 column 49 (char 48); fix:"),
    ("[" * 100_000, "line 2: maximum recursion depth exceeded while decoding a JSON array from a unicode string; "
                    "fix:"),
]


@pytest.mark.parametrize("line,message", BAD_LINES, ids=["json", "list", "label", "ctx", "endings", "range", "bool",
                                                         "vocabulary", "missing", "ctx-number", "endings-string",
                                                         "endings-number", "negative", "float", "label-word", "null",
                                                         "two-objects", "deep"])
def test_a_line_that_is_not_an_example_is_refused_with_its_file_and_line(tmp_path, line, message):
    path = write_task(tmp_path / "bad.jsonl", [{"ctx": "a", "endings": ["b", "c"], "label": 0}, line])
    with pytest.raises(ConfigError) as caught:
        read_task(path, CHARS)
    assert f"{path}, {message}" in str(caught.value)


FIX = ('fix: write one example a line in HellaSwag\'s format: {"ctx": "...", "endings": ["...", "..."], "label": 0}')


@pytest.mark.parametrize("content, message", [
    (b"", "{path} holds no examples; " + FIX),
    (b"\n  \n", "{path} holds no examples; " + FIX),
    ('{"ctx": "café"}\n'.encode("latin-1"), "{path}, line 1: 'utf-8' codec can't decode byte 0xe9 in position 12: "
     "invalid continuation byte; " + FIX + ", in text the run's char tokenizer encodes"),
], ids=["empty", "blank", "latin-1"])
def test_a_file_without_examples_is_refused_in_one_line(tmp_path, content, message):
    (tmp_path / "bad.jsonl").write_bytes(content)
    with pytest.raises(ConfigError) as caught:
        read_task(str(tmp_path / "bad.jsonl"), CHARS)
    assert str(caught.value) == message.replace("{path}", str(tmp_path / "bad.jsonl"))


def test_an_ending_longer_than_the_context_is_refused_at_start(tmp_path):
    path = write_task(tmp_path / "long.jsonl", [{"ctx": "a", "endings": ["b" * 9, "c"], "label": 0}])
    with pytest.raises(ConfigError, match=r"an ending of 10 tokens is longer than model.block_size=8"):
        open_tasks([path], str(tmp_path), None, CHARS, block_size=8)


def test_hellaswag_is_fetched_once_into_the_data_folder(tmp_path, monkeypatch):
    """Downloaded on first use (here from a file: URL), then read from the folder without asking again; a
    download that fails says where to place the file by hand."""
    source = write_task(tmp_path / "source.jsonl", [{"ctx": "a", "endings": ["b", "c"], "label": 0}])
    monkeypatch.setattr(data.tasks, "HELLASWAG_URL", f"file://{source}")
    folder = tmp_path / "eval"
    path = task_file("hellaswag", str(folder))
    assert path == str(folder / "hellaswag_val.jsonl") and open(path).read() == open(source).read()
    monkeypatch.setattr(urllib.request, "urlopen", lambda *a, **k: pytest.fail("fetched again"))
    assert task_file("hellaswag", str(folder)) == path
    monkeypatch.undo()
    monkeypatch.setattr(data.tasks, "HELLASWAG_URL", f"file://{tmp_path}/nowhere.jsonl")
    with pytest.raises(ConfigError) as caught:
        task_file("hellaswag", str(tmp_path / "offline"))
    assert str(caught.value).startswith(f"could not download file://{tmp_path}/nowhere.jsonl to ")
    assert str(caught.value).endswith(f"fix: place hellaswag_val.jsonl from there in eval.data_dir={tmp_path}/offline")
    assert list((tmp_path / "offline").iterdir()) == []  # no half file left


def test_a_row_keeps_the_last_block_size_plus_one_tokens_and_scores_the_choice():
    row = choice_row(list(range(10, 20)), [1, 2, 3], block_size=8)
    assert row.ids == [14, 15, 16, 17, 18, 19, 1, 2, 3] and row.scored == 3
    short = choice_row([7], [8, 9], block_size=8)
    [(inputs, targets)] = batches([row, short], size=2)
    assert inputs.tolist() == [[14, 15, 16, 17, 18, 19, 1, 2], [7, 8, 0, 0, 0, 0, 0, 0]]
    assert targets.tolist() == [[IGNORE] * 5 + [1, 2, 3], [8, 9] + [IGNORE] * 6]
    [(inputs, targets)] = batches([short], size=2, length=4)  # a pipeline's fixed shape
    assert inputs.tolist() == [[7, 8, 0, 0]] and targets.tolist() == [[8, 9, IGNORE, IGNORE]]
    with pytest.raises(ValueError, match="a choice of 9 tokens is longer than the model's context of 8"):
        choice_row([1], list(range(9)), block_size=8)


def test_acc_and_acc_norm_of_a_hand_computed_example():
    """acc: the least summed loss; acc_norm: the least loss per token; the first of equals."""
    assert choose([2.0, 3.0, 2.2], [1, 3, 2]) == (0, 1)  # per token: 2.0, 1.0, 1.1
    assert choose([1.0, 1.5, 0.9], [1, 3, 2]) == (2, 2)  # per token: 1.0, 0.5, 0.45
    assert choose([1.0, 1.0], [2, 2]) == (0, 0)
    examples = [Example([1], [[2], [3, 4, 5], [6, 7]], label=1), Example([1], [[2], [3, 4, 5], [6, 7]], label=0)]
    scorer = ChoiceScorer([Task("toy", "toy.jsonl", examples)], block_size=8, dp_rank=0, dp=1, micro_batch=4,
                          fixed_shape=False)
    losses = torch.tensor([2.0, 3.0, 2.2, 1.0, 1.5, 0.9, 0.0, 0.0])  # two padding rows fill the micro-batch
    assert right_answers(scorer.mine, 1, losses.tolist()).tolist() == [[0.0, 1.0]]  # acc 0/2, acc_norm 1/2


def test_each_data_parallel_rank_scores_its_share_in_as_many_forwards():
    examples = [Example([1], [[2]] * (2 + i % 3), label=0) for i in range(7)]
    tasks = [Task("a", "a.jsonl", examples), Task("b", "b.jsonl", examples[:2])]
    whole = ChoiceScorer(tasks, 8, 0, 1, 4, fixed_shape=False)
    shares = [ChoiceScorer(tasks, 8, rank, 3, 4, fixed_shape=False) for rank in range(3)]
    assert sorted([id(e) for s in shares for _, e in s.mine]) == sorted(id(e) for _, e in whole.mine)
    assert [(t, e) for s in shares for t, e in s.mine if t == 0] == [(0, e) for e in examples]
    assert len({len(s.rows) for s in shares}) == 1 and len(shares[0].rows) % 4 == 0


@pytest.fixture(scope="module")
def lm():
    cfg = ModelConfig(arch="gpt", n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=CHARS.vocab_size)
    model = build_model(cfg, seed=5).eval()
    return CheckpointLM(model, cfg.block_size, cfg.vocab_size, CHARS, "cpu", batch_size=3), model


class Request:
    def __init__(self, *args):
        self.args = args


def log_probs(model, ids: list[int]) -> torch.Tensor:
    """log p(ids[i + 1] | ids[:i + 1]) of one sequence of at most block_size + 1 tokens, unpadded, unbatched, over
    the real vocabulary (the model's is padded to 128)."""
    with torch.no_grad():
        logits = model(torch.tensor([ids[:-1]]))[0, :, :CHARS.vocab_size].float()
    return torch.log_softmax(logits, dim=-1)[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]


def test_the_harness_interface_gives_the_models_log_probabilities(lm):
    """loglikelihood in batches of padded rows = the continuation's log-probabilities of one unpadded sequence
    (a context longer than the model's loses its start); greedy is whether each is the most likely token."""
    adapter, model = lm
    pairs = [("Thou art", " a lord"), ("a" * 30, " bc"), ("Go", "!")]
    got = adapter.loglikelihood([Request(*pair) for pair in pairs])
    for (context, continuation), (loglik, greedy) in zip(pairs, got):
        ids = (CHARS.encode(context) + CHARS.encode(continuation))[-17:]
        expected = log_probs(model, ids)[-len(continuation):].sum().item()
        # fp32 sums of a padded batch's and one sequence's kernels: 4e-5 apart seen once under two pytest workers
        assert loglik == pytest.approx(expected, abs=1e-4)
    with torch.no_grad():
        best = model(torch.tensor([CHARS.encode("Go")]))[0, -1].argmax().item()
    [(_, greedy)] = adapter.loglikelihood([Request("Go", CHARS.decode([best]))])
    assert greedy and not got[2][1] or CHARS.decode([best]) == "!"


def test_rolling_loglikelihood_predicts_every_token_once_after_the_delimiter(lm):
    adapter, model = lm
    text = "To be or not"  # within one window: every token after the end-of-text id
    [total] = adapter.loglikelihood_rolling([Request(text)])
    assert total == pytest.approx(log_probs(model, [CHARS.eot_id] + CHARS.encode(text)).sum().item(), abs=1e-5)
    long = "To be, or not to be, that is the question"  # three windows of 16
    [total] = adapter.loglikelihood_rolling([Request(long)])
    ids = [CHARS.eot_id] + CHARS.encode(long)
    pieces = [log_probs(model, ids[:17]), log_probs(model, ids[16:33]), log_probs(model, ids[-17:])[-(len(ids) - 33):]]
    assert total == pytest.approx(sum(p.sum().item() for p in pieces), abs=1e-4)


def test_generation_is_greedy_and_stops_at_a_stop_string(lm):
    adapter, model = lm
    ids = CHARS.encode("The")
    for _ in range(12):
        with torch.no_grad():
            ids.append(model(torch.tensor([ids[-16:]]))[0, -1, :CHARS.vocab_size].argmax().item())
    free = CHARS.decode(ids[3:])
    [text] = adapter.generate_until([Request("The", {"max_gen_toks": 12})])
    assert text == free.split(CHARS.decode([CHARS.eot_id]))[0]
    stop = text[3:5]
    [cut] = adapter.generate_until([Request("The", {"until": [stop], "max_gen_toks": 12})])
    assert cut == text.split(stop)[0]


def test_a_request_the_tokenizer_cannot_encode_says_so(lm):
    adapter, _ = lm
    with pytest.raises(RequestError, match="the char tokenizer cannot encode the request 'naïve x': .* a char model "
                                           "scores only tasks written in its training text's characters"):
        adapter.loglikelihood([Request("naïve", " x")])


def test_the_harness_task_of_a_jsonl_file_reads_it_as_the_loop_does(tmp_path):
    config = harness_task(str(tmp_path / "toy.jsonl"))
    assert config["task"] == "toy" and config["target_delimiter"] == " "
    assert config["dataset_kwargs"] == {"data_files": {"validation": str(tmp_path / "toy.jsonl")}}
    assert (config["doc_to_text"], config["doc_to_choice"], config["doc_to_target"]) == ("{{ctx}}", "{{endings}}",
                                                                                         "{{label}}")
