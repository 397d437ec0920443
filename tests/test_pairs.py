"""Preference pairs in the training loop, in one process: a pair's two rows always share a micro-batch, whatever the
layout; their labels carry the reference and the answer's length; the losses' formulas; the refusals at start."""
import json
import math
import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from common.checks import ConfigError
from data.pairs import PairData
from data.prepare_preference import prepare_preference
from data.token_data import IGNORE
from hf_check import transformers_model
from model.config import ModelConfig
from model.sequence_parallel import SequenceParallel
from training.config import DEFAULT_CONFIG, load_run_config
from training.objectives import choose_objective
from training.objectives.preference import PairLoss, pair_losses
from training.objectives.reference import check_reference, fingerprint, reference_path
from training.topology import Layout

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def pair_data(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("pairs")
    records = [{"prompt": f"Reverse: {a} {b}\n", "chosen": f"{b} {a}", "rejected": f"{a} {b}"}
               for a in ("lord", "king", "sword", "night") for b in ("crown", "queen", "heart", "blood", "ghost")]
    (folder / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    prepare_preference([str(folder / "pairs.jsonl")], str(folder / "data"), "char", context=32, val_fraction=0.2)
    return str(folder / "data")


def window_of(data: PairData) -> dict:
    """Each train row's window index, by its tokens and targets."""
    rows = data.splits["train"].rows(np.arange(2 * data.pairs["train"]))[:, :2 * data.block_size]
    return {row.tobytes(): w for w, row in enumerate(rows)}


@pytest.mark.parametrize("dp,micro,accum", [(1, 2, 1), (1, 4, 2), (2, 2, 2), (2, 6, 1), (4, 2, 1)])
def test_a_pairs_two_rows_share_a_micro_batch_in_every_layout(pair_data, dp, micro, accum):
    data = PairData(pair_data, None, 32)
    windows, layout = window_of(data), Layout(dp, 1, micro, accum)
    for step in (1, 2, 7):  # step 7 runs into the next epochs
        seen = []
        for rank in range(dp):
            for inputs, (targets, info) in data.step_batches(0, step, rank, layout, CPU):
                assert inputs.shape == (micro, 32)
                rows = torch.cat([inputs, targets], dim=1).numpy()
                ids = [windows[row.tobytes()] for row in rows]
                assert ids[0::2] == [i + 1 - 2 for i in ids[1::2]] and all(i % 2 == 0 for i in ids[0::2]), ids
                assert info[:, 1].tolist() == (targets != IGNORE).sum(dim=1).tolist()
                seen += [i // 2 for i in ids[0::2]]
        assert len(seen) == dp * micro * accum // 2


def test_every_pair_once_an_epoch_in_an_order_of_the_seed(pair_data):
    data = PairData(pair_data, None, 32)
    windows, pairs = window_of(data), data.pairs["train"]
    layout = Layout(1, 1, 2, 1)
    order = [windows[torch.cat([inputs, targets], dim=1)[0].numpy().tobytes()] // 2
             for step in range(1, pairs + 1) for inputs, (targets, _) in data.step_batches(3, step, 0, layout, CPU)]
    assert sorted(order) == list(range(pairs)) and order != list(range(pairs))


def test_the_labels_carry_the_reference_of_each_row(pair_data):
    data = PairData(pair_data, None, 32)
    values = -np.arange(2 * data.pairs["train"], dtype=np.float64) - 0.5
    data.set_reference("train", values)
    windows = window_of(data)
    inputs, (targets, info) = data.train_batch(5, 1, 0, 0, Layout(1, 1, 4, 1), CPU)
    rows = torch.cat([inputs, targets], dim=1).numpy()
    assert info[:, 0].tolist() == [values[windows[row.tobytes()]] for row in rows]


def test_sequence_ranks_keep_the_rows_values_whole():
    inputs, targets, info = torch.arange(16).view(2, 8), torch.arange(16).view(2, 8) + 1, torch.ones(2, 2)
    (tokens, positions), (sliced, kept) = SequenceParallel(size=2, rank=1).split(inputs, (targets, info))
    assert tokens.tolist() == inputs[:, 4:].tolist() and sliced.tolist() == targets[:, 4:].tolist()
    assert kept is info and positions.tolist() == [[4, 5, 6, 7]] * 2


LOGPS = torch.tensor([-10.0, -12.0, -30.0, -29.0], dtype=torch.float64)  # two pairs: (chosen, rejected) each
COUNTS = torch.tensor([4.0, 5.0, 10.0, 8.0], dtype=torch.float64)
REFERENCE = torch.tensor([-11.0, -11.5, -31.0, -28.0], dtype=torch.float64)


def expected(kind: str, beta=0.1, eps=0.0, gamma=0.5, sft=0.0) -> list[float]:
    out = []
    for c, r in ((0, 1), (2, 3)):
        lc, lr, rc, rr, nc, nr = LOGPS[c], LOGPS[r], REFERENCE[c], REFERENCE[r], COUNTS[c], COUNTS[r]
        if kind == "dpo":
            z = beta * ((lc - rc) - (lr - rr))
            loss = -(1 - eps) * math.log(1 / (1 + math.exp(-z))) - eps * math.log(1 / (1 + math.exp(z)))
        elif kind == "ipo":
            loss = ((lc - rc) / nc - (lr - rr) / nr - 1 / (2 * beta)) ** 2
        else:
            z = beta * (lc / nc - lr / nr) - gamma
            loss = -(1 - eps) * math.log(1 / (1 + math.exp(-z))) - eps * math.log(1 / (1 + math.exp(z)))
        out.append(float(loss - sft * lc / nc))
    return out


@pytest.mark.parametrize("kind,settings", [("dpo", {}), ("dpo", {"eps": 0.2}), ("dpo", {"sft": 0.5}),
                                           ("ipo", {"beta": 0.5}), ("simpo", {"beta": 2.0, "gamma": 1.0}),
                                           ("simpo", {"beta": 2.0, "eps": 0.1})])
def test_the_losses_are_the_papers_formulas(kind, settings):
    objective = PairLoss(kind, settings.get("beta", 0.1), settings.get("eps", 0.0), settings.get("gamma", 0.5),
                          settings.get("sft", 0.0))
    losses, figures = pair_losses(objective, LOGPS, COUNTS, REFERENCE)
    assert losses.tolist() == pytest.approx(expected(kind, **settings), rel=1e-12)
    beta = objective.beta
    rewards = beta * LOGPS / COUNTS if kind == "simpo" else beta * (LOGPS - REFERENCE)
    assert figures["rewards_chosen"].tolist() == pytest.approx(rewards[0::2].tolist())
    assert figures["rewards_accuracy"].tolist() == [float(rewards[0] > rewards[1]), float(rewards[2] > rewards[3])]
    assert F.logsigmoid(torch.tensor(0.0)).item() == pytest.approx(-math.log(2))


def run_config(pair_data, *overrides):
    return load_run_config(DEFAULT_CONFIG, [f"data.dir={pair_data}", "model.block_size=32", *overrides])


def test_what_a_preference_run_refuses_at_start(pair_data, char_data, tmp_path):
    data = PairData(pair_data, None, 32)
    with pytest.raises(ConfigError, match="the micro-batch of 3 rows splits a preference pair .* set an even "
                                          "train_micro_batch_size_per_gpu"):
        choose_objective(run_config(pair_data), data, Layout(1, 1, 3, 1), None, None)
    with pytest.raises(ConfigError, match="train.objective=dpo compares the model with the one it starts from, but "
                                          "train.init_from is not set; fix: set train.init_from"):
        choose_objective(run_config(pair_data), data, Layout(1, 1, 2, 1), None, None)
    with pytest.raises(ConfigError, match=r"train.objective='ppo': must be null \(the data's\) or one of next_token, "
                                          r"dpo, ipo, simpo, reward, grpo, rloo; fix: set train.objective to one of"):
        choose_objective(run_config(pair_data, "train.objective=ppo"), data, Layout(1, 1, 2, 1), None, None)
    objective = choose_objective(run_config(pair_data, "train.objective=simpo"), data, Layout(1, 1, 2, 1), None, None)
    assert objective.name == "simpo" and objective.record() == {"reference": None}  # no reference to compare with
    from data.loader import open_data
    text = open_data(char_data, None, 32)
    with pytest.raises(ConfigError, match=f"train.objective=ipo trains on preference pairs, but {char_data} holds "
                                          f"text; fix: prepare pairs with python -m data.prepare --format preference"):
        choose_objective(run_config(char_data, "train.objective=ipo"), text, Layout(1, 1, 2, 1), None, None)
    with pytest.raises(ConfigError, match=f"train.objective=next_token trains on text or conversations, but "
                                          f"{pair_data} holds preference pairs; fix: set train.objective to dpo"):
        choose_objective(run_config(pair_data, "train.objective=next_token"), data, Layout(1, 1, 2, 1), None, None)
    with pytest.raises(ConfigError, match="the reference log-probabilities this run started with, .*abc.npz, are "
                                          "gone; fix: restore the file, or start a fresh run"):
        check_reference(data, "abc", resuming=True)
    path = reference_path(pair_data, "other")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    np.savez(path, dataset=np.array("another"), train=np.zeros(2), val=np.zeros(2))
    with pytest.raises(ConfigError, match="holds the reference's log-probabilities of another preparation of"):
        check_reference(data, "other", resuming=True)
    os.remove(path)


def test_a_preference_dataset_trains_alone(pair_data, char_data):
    from data.token_data import TokenData
    with pytest.raises(ConfigError, match="holds preference pairs \\(data.prepare --format preference\\), which "
                                          "train alone"):
        TokenData(None, None, 16, [{"dir": pair_data, "weight": 1}, {"dir": char_data, "weight": 1}])


@pytest.mark.parametrize("beta,gamma,eps", [(2.0, 0.5, 0.0), (2.5, 1.4, 0.1)])
def test_simpo_is_trls(beta, gamma, eps):
    """Our SimPO against TRL's own code for it (CPOTrainer.cpo_loss with loss_type simpo) on per-token means."""
    from types import SimpleNamespace

    from trl.experimental.cpo import CPOTrainer
    trl = SimpleNamespace(alpha=0.0, loss_type="simpo", beta=beta, simpo_gamma=gamma, label_smoothing=eps,
                          accelerator=SimpleNamespace(device=CPU))
    means = LOGPS / COUNTS
    losses, chosen, rejected = CPOTrainer.cpo_loss(trl, means[0::2], means[1::2])
    ours, figures = pair_losses(PairLoss("simpo", beta, eps, gamma), LOGPS, COUNTS, REFERENCE)
    assert ours.tolist() == pytest.approx(losses.tolist(), rel=1e-12)
    assert figures["rewards_chosen"].tolist() == pytest.approx(chosen.tolist(), rel=1e-12)
    assert figures["rewards_rejected"].tolist() == pytest.approx(rejected.tolist(), rel=1e-12)


def test_a_set_that_holds_no_pair_back_opens_with_an_empty_validation(tmp_path):
    records = [{"prompt": f"Reverse: {a} b\n", "chosen": f"b {a}", "rejected": f"{a} b"} for a in "xyzw"]
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    prepare_preference([str(tmp_path / "pairs.jsonl")], str(tmp_path / "data"), "char", context=32, val_fraction=0)
    data = PairData(str(tmp_path / "data"), None, 64)  # rows of a few tokens each, under a longer window
    assert data.pairs == {"train": 4, "val": 0} and data.eval_rows("val", 8) == 0


def test_rows_scored_in_chunks_give_the_whole_batchs_sums_and_gradients():
    """The per-row log-probabilities of the loss, a chunk of tokens at a time under activation checkpointing (fp32
    logits never whole), equal the whole batch's, and so do their gradients; the padded vocabulary takes nothing."""
    from training.evaluation.multiple_choice import row_losses
    torch.manual_seed(0)
    logits = torch.randn(4, 12, 40)
    targets = torch.randint(0, 33, (4, 12))
    targets[:, :5] = IGNORE
    sums = []
    for chunk in (10_000, 7):
        leaf = logits.clone().requires_grad_()
        losses = row_losses(leaf, targets, vocab_size=33, chunk_rows=chunk)
        (losses * torch.arange(1.0, 5.0)).sum().backward()
        sums.append((losses.detach(), leaf.grad))
    whole = F.cross_entropy(logits[..., :33].reshape(-1, 33), targets.reshape(-1), reduction="none").view(4, 12)
    assert torch.allclose(sums[0][0], whole.sum(-1)) and torch.equal(sums[0][0], sums[1][0])
    assert torch.allclose(sums[0][1], sums[1][1], atol=1e-7) and sums[1][1][..., 33:].abs().max() == 0


def test_the_references_fingerprint_is_of_the_weights_and_config_not_the_folder(tmp_path):
    shape = ModelConfig(arch="llama", n_layer=1, n_head=2, n_embd=16, ffn_hidden=32, block_size=16, vocab_size=50)
    for name, seed in (("a", 1), ("a_again", 1), ("b", 2)):
        transformers_model(shape, tmp_path / name, seed=seed)
    assert fingerprint(str(tmp_path / "a")) == fingerprint(str(tmp_path / "a_again"))
    assert fingerprint(str(tmp_path / "a")) != fingerprint(str(tmp_path / "b"))
    config = json.loads((tmp_path / "a_again" / "config.json").read_text())
    (tmp_path / "a_again" / "config.json").write_text(json.dumps({**config, "rms_norm_eps": 1e-3}))
    assert fingerprint(str(tmp_path / "a")) != fingerprint(str(tmp_path / "a_again"))
