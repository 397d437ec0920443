"""The training loop's multiple-choice score (training/evaluation/multiple_choice.py) from a task's text, in one
process: a BPE whose choices differ in length and in tokens per character, scored through the loop's own path (the
task read and tokenized, its rows in micro-batches, the evaluation forward, the accuracies counted over a one-rank
group), against acc and the per-token acc_norm computed here from each choice's loss alone. The per-character acc_norm
(the harness's rule, training/evaluation/evaluate.py) picks other answers on this task: a loop dividing by
characters fails."""
import json

import pytest
import torch

from data.tokenizers import train_bpe
from harness import free_port
from model import build_model
from model.config import ModelConfig
from training.engines import PlainDriver
from training.evaluation.multiple_choice import ChoiceScorer, open_tasks

CORPUS = "the king is in his kingdom and the queen is in her chamber; the kingdom is the king's. " * 40
# Whole words of the corpus are one token each, letters it never joins one a letter: " kingdom" is 1 token of 8
# characters, " qz vw" 6 of 6. Each example's label is its choice of most tokens per character.
EXAMPLES = [("the king is in his", ["kingdom", "qz vw", "chamber"], 1),
            ("the queen is in her", ["chamber", "xq", "the king", "zebra"], 3),
            ("and the kingdom is", ["the king's", "vzq", "queen"], 1),
            ("the", ["queen", "wyx zq", "kingdom"], 1),
            ("his kingdom and the", ["queen", "king", "fjv", "chamber"], 2),
            ("the king's", ["chamber", "kingdom is the king's", "zz xy"], 2),
            ("is in", ["the queen", "jxw"], 1),
            ("her chamber; the", ["king", "vvq", "kingdom"], 1)]


@pytest.fixture(scope="module")
def one_rank_group():
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    torch.distributed.destroy_process_group()


def choice_loss(model, vocab_size: int, context: list[int], choice: list[int]) -> float:
    """The summed loss of `choice`'s tokens after `context`, one unpadded sequence, over the real vocabulary."""
    ids = torch.tensor([context + choice])
    with torch.no_grad():
        logits = model(ids[:, :-1])[0, :, :vocab_size].float()
    log_probs = torch.log_softmax(logits, dim=-1)[torch.arange(ids.size(1) - 1), ids[0, 1:]]
    return -log_probs[-len(choice):].sum().item()


def test_acc_norm_divides_each_choices_loss_by_its_tokens_not_its_characters(tmp_path, one_rank_group):
    tokenizer = train_bpe(iter([CORPUS]), 300)
    path = tmp_path / "words.jsonl"
    path.write_text("".join(json.dumps({"ctx": c, "endings": e, "label": label}) + "\n" for c, e, label in EXAMPLES))
    cfg = ModelConfig(n_layer=2, n_head=2, n_embd=32, block_size=32, vocab_size=tokenizer.vocab_size)
    model = build_model(cfg, seed=0)
    with torch.no_grad():  # far from uniform: every choice's loss its own, no near ties between the rules' picks
        for p in model.parameters():
            p.normal_(0, 0.5, generator=torch.Generator().manual_seed(p.numel()))

    # The loop's path: eval.tasks opened, this rank's rows in micro-batches of 4, the evaluation forward, the counts.
    tasks = open_tasks([str(path)], str(tmp_path), None, tokenizer, cfg.block_size)
    scorer = ChoiceScorer(tasks, cfg.block_size, dp_rank=0, dp=1, micro_batch=4, fixed_shape=False)
    losses = PlainDriver(model).choice_losses(scorer.batches(torch.device("cpu")), cfg.vocab_size)
    acc, acc_norm = scorer.scores(losses, None)["words"]

    # Here: each choice on its own, " " + ending after the context, its tokens and characters counted.
    picks = {"sum": [], "token": [], "char": []}
    for context, endings, label in EXAMPLES:
        choices = [tokenizer.encode(" " + ending) for ending in endings]
        summed = [choice_loss(model, cfg.vocab_size, tokenizer.encode(context), ids) for ids in choices]
        per = {"sum": summed, "token": [s / len(ids) for s, ids in zip(summed, choices)],
               "char": [s / len(ending) for s, ending in zip(summed, endings)]}
        for rule, values in per.items():
            best, second = sorted(values)[:2]
            assert second - best > 1e-3, (context, rule)  # a clear pick, whatever the batching's rounding
            picks[rule].append(values.index(best) == label)
    expected = {rule: sum(right) / len(EXAMPLES) for rule, right in picks.items()}
    assert acc == expected["sum"]
    assert acc_norm == expected["token"]
    assert expected["token"] != expected["char"]  # the task tells the two normalizations apart
