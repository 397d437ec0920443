"""A reward model (train.objective=reward, model.head=score): its loss is TRL's RewardTrainer's; a pair row is scored
at its whole sequence's last token that is not the pad id, as transformers' LlamaForSequenceClassification scores
it; a short run trains, and its export loads in transformers with equal scores and in load_reward_model; what a
reward run refuses at start."""
import json
from collections import defaultdict
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from chats import documents, write_jsonl
from common.checks import ConfigError
from data.pairs import PairData
from data.reverse_task import preference_pair, tasks
from data.tokenizers import tokenizer_from_meta
from harness import FP32, TINY, export, launch, metrics, train_py
from hf_check import transformers_model
from model import build_model
from model.config import ModelConfig
from model_checks import decisive_model
from refusals import assert_refused_at_start, train_py_as_typed
from training.checkpoints.export import load_trained, write_export
from training.checkpoints.hf import score_pad_id
from training.config import DEFAULT_CONFIG, load_run_config
from training.objectives import choose_objective
from training.objectives.reward import reward_losses, row_scores, score_positions, whole_sequences
from training.reward_model import load_reward_model
from training.topology import Layout

CONTEXT = 63  # a sequence of up to 64 tokens: the window of model.block_size=64 holds it whole
LM = ModelConfig(arch="llama", n_layer=2, n_head=2, n_kv_head=1, n_embd=32, ffn_hidden=64, block_size=64)
RUN = [*TINY, *FP32, "model.arch=llama", "model.n_kv_head=1", "model.ffn_hidden=64", "model.block_size=64",
       "model.dropout=0", "train.objective=reward", "model.head=score"]


def prepare(root, template: str, context: int = CONTEXT) -> dict:
    """The pairs of root/pairs.jsonl prepared in characters through a built-in template into root/<template>."""
    from data.prepare_preference import prepare_preference
    return prepare_preference([str(root / "pairs.jsonl")], str(root / template), "char", template, context,
                              val_fraction=0.25)


@pytest.fixture(scope="module")
def pairs(tmp_path_factory) -> dict:
    """The reverse-words task's pairs (data/reverse_task.py: the reversal chosen, the words as given rejected) in
    characters through the lines template (a sequence ends with its answer's newline, not with the pad id, the end
    of text), and a causal Llama of transformers' own on their vocabulary."""
    root = tmp_path_factory.mktemp("reward")
    records = [p for p in map(preference_pair, tasks(16, 0)[0]) if p]
    write_jsonl(root / "pairs.jsonl", records)
    meta = prepare(root, "lines")
    cfg = ModelConfig(**{**LM.__dict__, "vocab_size": meta["vocab_size"]})
    transformers_model(cfg, root / "lm", seed=3)
    return {"root": root, "data": root / "lines", "meta": meta, "lm": root / "lm", "cfg": cfg, "records": records}


def trl_reward_loss(scores: torch.Tensor, center: float | None) -> tuple[float, dict]:
    """TRL's RewardTrainer.compute_loss on rows (chosen, rejected, ...) of `scores`: its loss and logged figures.
    Its model returns the scores as its batch holds them, every chosen row, then every rejected one."""
    from trl import RewardTrainer
    trainer = SimpleNamespace(model=SimpleNamespace(training=False), _metrics={"eval": defaultdict(list)},
                              args=SimpleNamespace(center_rewards_coefficient=center), _total_train_tokens=0,
                              accelerator=SimpleNamespace(gather=lambda x: x, gather_for_metrics=lambda x: x))
    logits = torch.cat([scores[0::2], scores[1::2]]).unsqueeze(1)
    loss = RewardTrainer.compute_loss(trainer, lambda **_: SimpleNamespace(logits=logits),
                                      {"attention_mask": torch.ones(len(scores), 4)})
    return loss.item(), {name: values[-1] for name, values in trainer._metrics["eval"].items()}


@pytest.mark.parametrize("center", [None, 0.01])
def test_the_loss_is_trls_reward_trainers(center):
    scores = torch.tensor([1.5, -0.25, 0.1, 0.9, -2.0, -2.5, 3.0, 3.0, 0.0, 4.0, -1.0, 2.0], dtype=torch.float64)
    losses, figures = reward_losses(scores, center or 0.0)
    theirs, logged = trl_reward_loss(scores, center)
    assert losses.mean().item() == pytest.approx(theirs, abs=1e-6)
    assert figures["rewards_accuracy"].mean().item() == pytest.approx(logged["accuracy"], abs=1e-6) == 2 / 6
    assert figures["rewards_margin"].mean().item() == pytest.approx(logged["margin"], abs=1e-6)
    assert losses[2].item() == pytest.approx(np.log1p(np.exp(-0.5)) + (center or 0) * 4.5 ** 2, abs=1e-12)


def test_a_score_is_read_at_the_last_token_that_is_not_the_pad_id():
    tokens = torch.tensor([[5, 6, 7, 9, 9], [5, 9, 6, 0, 0], [9, 9, 9, 9, 9]])
    assert score_positions(tokens, torch.tensor([5, 3, 5]), pad_id=9).tolist() == [2, 2, 0]


@pytest.mark.parametrize("template,ending", [("lines", "\n"), ("plain", "<|endoftext|>")])
def test_a_pair_row_is_scored_on_its_whole_sequence_as_transformers_scores_it(pairs, tmp_path, template, ending):
    """Rows as the loader reads them (inputs = sequence[:-1], targets = sequence[1:]) rebuilt into the prepared
    sequences, and a random model's scores of them equal LlamaForSequenceClassification's of the same sequences
    (right-padded with the pad id) from the model's export: at the last token (lines), or at the one before the
    end of text that ends every sequence of the plain template, the pad id."""
    (tmp_path / "pairs.jsonl").write_bytes((pairs["root"] / "pairs.jsonl").read_bytes())
    meta = prepare(tmp_path, template)
    data, pad = PairData(str(tmp_path / template), None, 64), score_pad_id(meta)
    rows = torch.from_numpy(data.splits["train"].rows(np.arange(8)))
    tokens, marks = whole_sequences(rows[:, :64], rows[:, 64:128], pad)
    sequences = [ids for ids, _ in documents(tmp_path / template, "train")[:8]]
    tokenizer = tokenizer_from_meta(meta, str(tmp_path / template))
    assert all(tokenizer.decode(ids).endswith(ending) for ids in sequences)
    for row, ids in enumerate(sequences):
        assert tokens[row, :len(ids)].tolist() == ids
        assert marks[row].nonzero().flatten().tolist() == [len(ids) - (2 if template == "plain" else 1)]
    cfg = ModelConfig(**{**pairs["cfg"].__dict__, "vocab_size": meta["vocab_size"], "head": "score"})
    model = decisive_model(cfg, seed=1)
    ours = row_scores(model(tokens), marks)
    folder = write_export(str(tmp_path / "export"), cfg, model.state_dict(), meta, 0)
    theirs = transformers_scores(folder, sequences)
    assert (ours - theirs).abs().max().item() <= 1e-5 and ours.std() > 0.1  # scores that differ, equal in both


def transformers_scores(folder: str, sequences: list[list[int]],
                        expected: str = "LlamaForSequenceClassification") -> torch.Tensor:
    """The scores of transformers' class named in the folder's config.json (checked: `expected`, with one label and
    a pad id), its batch right-padded with that id."""
    import transformers
    config = json.loads(open(f"{folder}/config.json").read())
    assert config["architectures"] == [expected] and config["id2label"] == {"0": "LABEL_0"}
    model, info = getattr(transformers, expected).from_pretrained(folder, output_loading_info=True,
                                                                  dtype=torch.float32)
    assert not any(info[key] for key in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    batch = torch.full((len(sequences), max(map(len, sequences))), config["pad_token_id"])
    for row, ids in enumerate(sequences):
        batch[row, :len(ids)] = torch.tensor(ids)
    with torch.no_grad():
        return model.eval()(batch).logits[:, 0]


def test_a_gpt_reward_model_exports_as_gpt2_for_sequence_classification(pairs, tmp_path):
    cfg = ModelConfig(n_layer=2, n_head=2, n_embd=32, block_size=64, vocab_size=pairs["meta"]["vocab_size"],
                      head="score")
    model = decisive_model(cfg, seed=2)
    folder = write_export(str(tmp_path / "gpt"), cfg, model.state_dict(), pairs["meta"], 0)
    sequences = [ids for ids, _ in documents(pairs["data"], "train")[:6]]
    theirs = transformers_scores(folder, sequences, "GPT2ForSequenceClassification")
    ours = load_reward_model(folder).score(sequences)
    assert (ours - theirs).abs().max().item() <= 1e-5 and ours.std() > 0.01  # scores that differ, equal in both


@pytest.fixture(scope="module")
def reward_run(pairs):
    """40 steps over all the train pairs from the causal Llama (its LM head left, a score head begun), a checkpoint
    at the end, exported."""
    out = pairs["root"] / "run"
    proc = train_py([f"data.dir={pairs['data']}", f"train.out_dir={out}", *RUN, f"train.init_from={pairs['lm']}",
                     "train.max_steps=40", "optim.lr=1e-2", "optim.min_lr=1e-3", "optim.warmup_steps=2",
                     f"ds.train_micro_batch_size_per_gpu={2 * pairs['meta']['preference']['train_pairs']}"],
                    env={"OMP_NUM_THREADS": "1"})
    return {"proc": proc, "out": out, "export": export(out, "step_000040")}


def test_a_reward_run_trains_from_a_causal_model(pairs, reward_run):
    proc, steps = reward_run["proc"], [m for m in metrics(reward_run["out"]) if "loss" in m]
    assert f"initialized from {pairs['lm']}; score.weight not there" in proc.stdout
    assert "objective: reward (Bradley-Terry: -log sigmoid(r_chosen - r_rejected), center rewards 0)" in proc.stdout
    assert " | reward accuracy " in proc.stdout and "--- sample ---" not in proc.stdout  # no LM head to sample
    # the score head begins at N(0, 0.02): scores near 0, a loss near ln 2; then the 8 pairs are learned
    assert steps[0]["loss"] == pytest.approx(np.log(2), abs=0.05) and steps[-1]["loss"] < 0.2 * steps[0]["loss"]
    assert steps[-1]["rewards_accuracy"] == 1 and steps[-1]["rewards_margin"] > 1
    assert "val_rewards_accuracy" in metrics(reward_run["out"])[-1]


def test_the_export_scores_in_transformers_and_load_reward_model_as_the_run(pairs, reward_run):
    folder = reward_run["export"]
    cfg, model, _, _ = load_trained(str(reward_run["out"]), "step_000040", head="score")  # the checkpoint's weights
    assert cfg.head == "score"
    pad, prepared = score_pad_id(pairs["meta"]), [ids for ids, _ in documents(pairs["data"], "val")]
    sequences = prepared + [ids + [pad] for ids in prepared[:3]]  # one that ends with the pad id: read before it
    lengths = torch.tensor([len(ids) for ids in sequences])
    batch = torch.full((len(sequences), int(lengths.max())), pad)
    for row, ids in enumerate(sequences):
        batch[row, :len(ids)] = torch.tensor(ids)
    with torch.no_grad():
        ours = model.eval()(batch)[torch.arange(len(sequences)), score_positions(batch, lengths, pad), 0]
    theirs = transformers_scores(folder, sequences)
    assert (ours - theirs).abs().max().item() <= 1e-5 and ours.std() > 0.1
    assert torch.equal(ours[-3:], ours[:3])
    loaded = load_reward_model(folder)
    assert (loaded.score(sequences, batch_size=5) - ours).abs().max().item() <= 1e-5
    val = [r for r in pairs["records"] if loaded.encode(r["prompt"], r["chosen"]) in prepared]
    assert [loaded.encode(r["prompt"], side) for r in val for side in (r["chosen"], r["rejected"])] == prepared


# Every layout of one global batch (8 rows: 4 pairs) trains alike: 4 steps, evaluated at 2 and 4. The pipeline
# computes the loss on its last stage, tensor ranks replicate the score head, sequence ranks each hold a slice of
# the rows (step_batches gathers them whole first) and the mark or none.
LAYOUTS = {"one": (1, "zero0.json", ["ds.train_micro_batch_size_per_gpu=8"]),
           "pp2": (2, "pipe2.json", ["ds.gradient_accumulation_steps=4"]),
           "tp2": (2, "tp2.json", ["ds.gradient_accumulation_steps=4"]),
           "sp2": (2, "sp2.json", ["ds.gradient_accumulation_steps=4"])}


@pytest.fixture(scope="module")
def layouts(pairs) -> dict:
    wide = pairs["root"] / "wide"  # 2 key/value heads, which the tensor and sequence ranks split
    transformers_model(ModelConfig(**{**pairs["cfg"].__dict__, "n_kv_head": 2}), wide, seed=4)
    out = {}
    for name, (procs, ds_config, overrides) in LAYOUTS.items():
        out[name] = pairs["root"] / f"layout_{name}"
        launch(procs, ds_config, out[name], str(pairs["data"]), [
            *RUN, "model.n_kv_head=2", f"train.init_from={wide}", "train.max_steps=4", "optim.lr=3e-3",
            "optim.min_lr=3e-4", "optim.warmup_steps=2", "train.eval_interval=2", "preference.center_rewards=0.01",
            "ds.train_micro_batch_size_per_gpu=2", *overrides])
    return out


def figures(run) -> list[float]:
    """Each step's loss, gradient norm and reward margin, and each evaluation's val loss and accuracy, in a row."""
    return [m[key] for m in metrics(run) for key in ("loss", "grad_norm", "rewards_margin", "val_loss",
                                                     "val_rewards_accuracy") if key in m]


@pytest.mark.launch
@pytest.mark.parametrize("layout", [name for name in LAYOUTS if name != "one"])
def test_every_layout_trains_a_reward_model_as_one_process_does(layouts, layout):
    expected = figures(layouts["one"])
    assert len(expected) == 4 * 3 + 3 * 2 and expected[6] > 0.1  # step 2's gradient: the weights move
    assert figures(layouts[layout]) == pytest.approx(expected, abs=1e-5)


def config(data, *overrides):
    return load_run_config(DEFAULT_CONFIG, [f"data.dir={data}", "model.block_size=64", *overrides])


def test_what_a_reward_run_refuses_at_start(pairs, char_data):
    from data.loader import open_data
    data, layout = PairData(str(pairs["data"]), None, 64), Layout(1, 1, 2, 1)
    text = open_data(char_data, None, 64)
    refusals = [
        (config(char_data, "train.objective=reward", "model.head=score"), text,
         f"train.objective=reward trains on preference pairs, but {char_data} holds text; fix: prepare pairs with "
         f"python -m data.prepare --format preference"),
        (config(pairs["data"], "train.objective=reward"), data,
         "train.objective=reward trains a reward model's score head, but model.head=lm; fix: set model.head=score"),
        (config(pairs["data"], "train.objective=simpo", "model.head=score"), data,
         "train.objective=simpo trains a language model's LM head, but model.head=score; fix: set model.head=lm, or "
         "train.objective=reward"),
        (config(pairs["data"], "train.objective=reward", "model.head=score", "eval.tasks=[hellaswag]"), data,
         "eval.tasks scores answers by their log-probabilities, which a reward model (train.objective=reward) has "
         "none of; fix: leave eval.tasks empty")]
    for cfg, dataset, message in refusals:
        with pytest.raises(ConfigError) as refused:
            choose_objective(cfg, dataset, layout, None, None)
        assert str(refused.value).startswith(message), str(refused.value)
    with pytest.raises(ConfigError, match=r"preference.center_rewards=-1.0: must be >= 0 \(0 adds no centering"):
        config(pairs["data"], "preference.center_rewards=-1")


def test_a_reward_run_refuses_pairs_its_window_cannot_hold_whole(pairs, tmp_path):
    from data.prepare_preference import prepare_preference
    long = prepare_preference([str(pairs["root"] / "pairs.jsonl")], str(tmp_path / "long"), "char", context=40,
                              val_fraction=0.25)
    longest = max(len(ids) for split in ("train", "val") for ids, _ in documents(tmp_path / "long", split))
    assert long["preference"]["truncated"] and longest == 41
    proc = train_py_as_typed(f"data.dir={tmp_path / 'long'}", f"train.out_dir={tmp_path / 'out'}", *RUN,
                             "model.block_size=40")
    assert_refused_at_start(proc, f"error: {tmp_path / 'long'} holds sequences of up to 41 tokens, model.block_size="
                                  f"40: a reward model reads each whole sequence (prompt and answer) in one window, "
                                  f"one token more than a language model's inputs; fix: prepare the pairs again with "
                                  f"--context 39, or raise model.block_size to 41")


def test_a_reward_model_is_not_sampled_and_a_language_model_not_scored(pairs, reward_run):
    folder = reward_run["export"]
    with pytest.raises(ConfigError, match=f"{folder} holds a reward model \\(model.head=score\\): it scores whole "
                                          f"sequences and has no next-token logits to sample, serve or evaluate "
                                          f"with; fix: pass a language model, or score with "
                                          f"training.reward_model.load_reward_model"):
        load_trained(None, None, folder)
    lm = write_export(str(pairs["root"] / "lm_export"), pairs["cfg"], build_model(pairs["cfg"]).state_dict(),
                      pairs["meta"], 0)
    with pytest.raises(ConfigError, match=f"{lm} holds a language model \\(model.head=lm\\), not a reward model; fix: "
                                          f"pass the export of a train.objective=reward run"):
        load_reward_model(lm)


def test_load_reward_model_encodes_text_pairs_as_they_were_prepared(pairs, tmp_path):
    """Text pairs: the prompt and answer as one string, the end of text appended (data.prepare's, TRL's add_eos)."""
    from data.prepare_preference import prepare_preference
    records = [{"prompt": f"Reverse: {a} {b}\n", "chosen": f"{b} {a}", "rejected": f"{a} {b}"}
               for a, b in (("king", "crown"), ("night", "sword"), ("moon", "star"), ("sea", "fire"))]
    meta = prepare_preference([write_jsonl(tmp_path / "text.jsonl", records)], str(tmp_path / "text"), "char",
                              context=CONTEXT, val_fraction=0)
    cfg = ModelConfig(**{**pairs["cfg"].__dict__, "vocab_size": meta["vocab_size"], "head": "score"})
    folder = write_export(str(tmp_path / "export"), cfg, build_model(cfg).state_dict(), meta, 0)
    loaded = load_reward_model(folder)
    assert meta["preference"]["eos_appended"] and loaded.chat_template is None
    assert [loaded.encode(r["prompt"], r[side]) for r in records for side in ("chosen", "rejected")] == \
        [ids for ids, _ in documents(tmp_path / "text", "train")]
    with pytest.raises(ValueError, match="this reward model learned text pairs: pass the prompt and the completion "
                                         "as strings"):
        loaded.encode([{"role": "user", "content": "x"}], [{"role": "assistant", "content": "y"}])
