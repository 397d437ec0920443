"""Preference tuning against TRL: the step-1 figures of a DPO run equal TRL's DPOTrainer's on the same pairs, the
same policy and the same reference; a run whose policy is its reference starts at a loss of ln 2 with every reward
0; the reference is scored once, kept beside the dataset, and read back by the next run from the same model."""
import dataclasses
import json
import math
import os
import shutil

import pytest
import torch

from chats import CHATML, WORDS, chatml_folder, write_jsonl
from harness import FP32, TINY, export, launch, metrics, tool
from hf_check import transformers_model
from model.config import ModelConfig

pytestmark = pytest.mark.launch

SHAPE = ModelConfig(arch="llama", n_layer=2, n_head=2, n_kv_head=1, n_embd=32, ffn_hidden=64, block_size=64,
                    vocab_size=500)
LLAMA = [*TINY, "model.arch=llama", "model.n_kv_head=1", "model.ffn_hidden=64", "model.block_size=64",
         "model.vocab_size=500", "model.dropout=0", *FP32, "train.max_steps=1", "optim.lr=1e-20", "optim.min_lr=1e-20",
         "optim.warmup_steps=1", "train.objective=dpo", "preference.beta=0.1"]


def reverse_pairs(count: int) -> list[dict]:
    """'Reverse: w1 ... wn': the reversal chosen, the words as given rejected (a plausible wrong answer)."""
    pairs = []
    for i in range(count):
        words = [WORDS[(i * 3 + k * 7) % len(WORDS)] for k in range(2 + i % 4)]
        pairs.append({"prompt": [{"role": "user", "content": "Reverse: " + " ".join(words)}],
                      "chosen": [{"role": "assistant", "content": " ".join(reversed(words))}],
                      "rejected": [{"role": "assistant", "content": " ".join(words)}]})
    return pairs


@pytest.fixture(scope="module")
def setup(tmp_path_factory, shakespeare_path):
    root = tmp_path_factory.mktemp("preference")
    (root / "tokenizer").mkdir()
    tokenizer = chatml_folder(root / "tokenizer", shakespeare_path)
    policy, reference = root / "policy", root / "reference"
    transformers_model(SHAPE, policy, seed=7)
    transformers_model(SHAPE, reference, seed=8)
    records = reverse_pairs(12)
    inputs = write_jsonl(root / "pairs.jsonl", records)
    data = root / "pairs"
    from data.prepare import main as prepare
    tool(prepare, ["--format", "preference", "--input", inputs, "--tokenizer", str(tokenizer), "--context", "64",
                   "--val_fraction", "0.25", "--out_dir", str(data)])
    meta = json.loads((data / "meta.json").read_text())
    return {"root": root, "tokenizer": tokenizer, "policy": policy, "reference": reference, "records": records,
            "data": data, "train_pairs": meta["preference"]["train_pairs"]}


def train_records(setup) -> list[dict]:
    """The records of the train split, as the prepared dataset holds them (its chosen rows decoded)."""
    from tokenizers import Tokenizer

    from chats import documents
    from data.chat_template import ChatTemplate

    tok = Tokenizer.from_file(str(setup["tokenizer"] / "tokenizer.json"))
    texts = {tok.decode(ids, skip_special_tokens=False) for ids, _ in documents(setup["data"], "train")[::2]}
    template = ChatTemplate(CHATML)
    return [r for r in setup["records"] if template.render(r["prompt"] + r["chosen"])[0] in texts]


def run_dpo(setup, name: str, init_from, extra=()):
    out = setup["root"] / name
    rows = 2 * setup["train_pairs"]  # one step over every train pair
    proc = launch(1, "zero0.json", out, str(setup["data"]), [*LLAMA, f"train.init_from={init_from}",
                                                              f"ds.train_micro_batch_size_per_gpu={rows}", *extra])
    step = next(m for m in metrics(out) if m.get("step") == 1 and "loss" in m)
    return proc, step


@pytest.fixture(scope="module")
def runs(setup):
    """A run whose policy is its reference (which scores the reference), then one from another model that reads
    that reference."""
    from training.objectives.reference import fingerprint, reference_path
    itself = run_dpo(setup, "itself", setup["reference"])
    scored = reference_path(str(setup["data"]), fingerprint(str(setup["reference"])))
    shutil.copy(scored, reference_path(str(setup["data"]), fingerprint(str(setup["policy"]))))
    other = run_dpo(setup, "other", setup["policy"])
    return {"itself": itself, "other": other}


def test_a_policy_that_is_its_reference_starts_at_ln2_with_rewards_zero(runs):
    proc, step = runs["itself"]
    assert "reference log-probabilities of 12 pairs scored and written to" in proc.stdout
    assert ("objective: dpo (beta 0.1, label smoothing 0, sft weight 0), a mean over the pairs of each global "
            "batch, against the reference, train.init_from") in proc.stdout
    assert step["loss"] == pytest.approx(math.log(2), abs=1e-6)
    for name in ("rewards_chosen", "rewards_rejected", "rewards_margin"):
        assert step[name] == pytest.approx(0, abs=1e-6)
    assert step["rewards_accuracy"] == 0  # no pair's chosen reward is above its rejected one's


def test_a_run_reads_the_reference_its_model_scored_before(runs):
    proc, _ = runs["other"]
    assert "reference log-probabilities read from" in proc.stdout


def test_adapters_start_at_the_reference_they_adapt(setup, runs):
    """DPO with LoRA's adapters from the reference's own folder: its reference read as the plain run scored it, and
    the adapted policy, which starts as that folder's model, at ln 2 with rewards 0; the adapters' gradient is not."""
    proc, step = run_dpo(setup, "lora", setup["reference"], ["model.lora_rank=4"])
    assert "reference log-probabilities read from" in proc.stdout
    assert step["loss"] == pytest.approx(math.log(2), abs=1e-6) and step["grad_norm"] > 0
    for name in ("rewards_chosen", "rewards_rejected", "rewards_margin"):
        assert step[name] == pytest.approx(0, abs=1e-6)


def trl_step(setup, records, beta: float = 0.1, **settings) -> dict:
    """TRL's DPOTrainer on the same pairs, policy and reference: its loss and logged figures of one batch."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast
    from trl import DPOConfig, DPOTrainer

    from data.tokenizers import EOT
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(setup["tokenizer"] / "tokenizer.json"), eos_token=EOT,
                                        pad_token=EOT, chat_template=CHATML)
    args = DPOConfig(output_dir=str(setup["root"] / "trl"), beta=beta, learning_rate=0.0, max_steps=1,
                     per_device_train_batch_size=len(records), use_cpu=True, report_to=[], max_length=None,
                     save_strategy="no", bf16=False, **settings)  # TRL's default is bf16 autocast: fp32 here
    trainer = DPOTrainer(model=str(setup["policy"]), ref_model=AutoModelForCausalLM.from_pretrained(
        setup["reference"]), args=args, train_dataset=Dataset.from_list(records), processing_class=tokenizer)
    batch = next(iter(trainer.get_train_dataloader()))
    trainer.model.train()  # as in a training step: its figures are logged as "train" (the model has no dropout)
    with torch.no_grad():
        loss = trainer.compute_loss(trainer.model, batch)
    return {"loss": loss.item(), **{name: values[-1] for name, values in trainer._metrics["train"].items()}}


def test_dpo_equals_trls_trainer_on_the_same_pairs(setup, runs):
    _, ours = runs["other"]
    records = train_records(setup)
    assert len(records) == setup["train_pairs"]
    theirs = trl_step(setup, records)
    assert ours["loss"] == pytest.approx(theirs["loss"], abs=1e-5)
    for mine, trl in (("rewards_chosen", "rewards/chosen"), ("rewards_rejected", "rewards/rejected"),
                      ("rewards_margin", "rewards/margins"), ("rewards_accuracy", "rewards/accuracies"),
                      ("logps_chosen", "logps/chosen"), ("logps_rejected", "logps/rejected")):
        assert ours[mine] == pytest.approx(theirs[trl], abs=1e-5), mine
    assert abs(ours["loss"] - math.log(2)) > 1e-3  # the reference is not the policy: the figures say something


# Every layout of one global batch (8 rows: 4 pairs) trains alike: 4 DPO steps at a learning rate that moves the
# weights, a checkpoint at step 2. Each layout scores the reference itself, into its own copy of the dataset. Its
# Llama has 2 key/value heads, which tensor and sequence ranks split.
WIDE = dataclasses.replace(SHAPE, n_kv_head=2)
MOVING = ["model.n_kv_head=2", "train.max_steps=4", "optim.lr=3e-3", "optim.min_lr=3e-4", "optim.warmup_steps=2",
          "train.save_interval=2", "train.eval_interval=2", "ds.train_micro_batch_size_per_gpu=2"]
LAYOUTS = {  # name: (processes, ds_config, overrides)
    "one": (1, "zero0.json", ["ds.train_micro_batch_size_per_gpu=8"]),
    "accum4": (1, "zero0.json", ["ds.gradient_accumulation_steps=4"]),
    "dp2_accum2": (2, "zero1.json", ["ds.gradient_accumulation_steps=2"]),
    "zero3_dp2": (2, "zero3.json", ["ds.gradient_accumulation_steps=2"]),
    "pp2": (2, "pipe2.json", ["ds.gradient_accumulation_steps=4"]),
    "tp2": (2, "tp2.json", ["ds.gradient_accumulation_steps=4"]),
    "sp2": (2, "sp2.json", ["ds.gradient_accumulation_steps=4"]),
}


@pytest.fixture(scope="module")
def layouts(setup):
    model = setup["root"] / "wide"
    transformers_model(WIDE, model, seed=9)
    out = {}
    for name, (procs, ds_config, overrides) in LAYOUTS.items():
        data = setup["root"] / f"pairs_{name}"
        shutil.copytree(setup["data"], data, ignore=shutil.ignore_patterns("references"))
        run = setup["root"] / f"layout_{name}"
        launch(procs, ds_config, run, str(data), [*LLAMA, *MOVING, *overrides, f"train.init_from={model}"])
        out[name] = (run, data)
    return out


def step_figures(run) -> list[float]:
    """Each step's loss, gradient norm and reward margin, in a row."""
    return [m[key] for m in metrics(run) if "loss" in m for key in ("loss", "grad_norm", "rewards_margin")]


@pytest.mark.parametrize("layout", [name for name in LAYOUTS if name != "one"])
def test_every_layout_trains_the_pairs_as_one_process_does(layouts, layout):
    import numpy as np

    run, data = layouts[layout]
    expected = step_figures(layouts["one"][0])
    assert len(expected) == 12 and expected[-3] < expected[0] - 0.05  # the weights moved: the losses say something
    assert step_figures(run) == pytest.approx(expected, abs=1e-5)
    evaluations = [[m["val_loss"], m["val_rewards_accuracy"]] for m in metrics(run) if "val_loss" in m]
    assert sum(evaluations, []) == pytest.approx(sum(([m["val_loss"], m["val_rewards_accuracy"]] for m in metrics(
        layouts["one"][0]) if "val_loss" in m), []), abs=1e-5)
    scored = [np.load(next((d / "references").iterdir())) for d in (data, layouts["one"][1])]
    for split in ("train", "val"):
        assert scored[0][split] == pytest.approx(scored[1][split], rel=1e-6)


def test_ipo_equals_trls_trainer_on_the_same_pairs(setup, runs):
    """IPO's per-token log-ratios: our run and TRL's DPOTrainer(loss_type=["ipo"]), same pairs, policy, reference."""
    _, ours = run_dpo(setup, "ipo", setup["policy"], ["train.objective=ipo", "preference.beta=0.5"])
    theirs = trl_step(setup, train_records(setup), beta=0.5, loss_type=["ipo"])
    assert ours["loss"] == pytest.approx(theirs["loss"], rel=1e-5)
    assert ours["rewards_chosen"] == pytest.approx(theirs["rewards/chosen"], abs=1e-5)
    assert ours["rewards_margin"] == pytest.approx(theirs["rewards/margins"], abs=1e-5)


def test_a_stopped_run_resumes_exactly_with_its_reference(setup, layouts):
    """Stopped at step 2 and resumed (the reference read back by the fingerprint its checkpoint names, though
    train.init_from's weights changed in between), the steps after are the uninterrupted run's; with the reference
    gone, the resume stops at start."""
    procs, ds_config, overrides = LAYOUTS["one"]
    run, data = layouts["one"]
    model = setup["root"] / "wide_then_changed"
    shutil.copytree(setup["root"] / "wide", model)
    settings = [*LLAMA, *MOVING, *overrides, f"train.init_from={model}"]
    out = setup["root"] / "resumed"
    launch(procs, ds_config, out, str(data), [*settings, "train.stop_at_step=2"])
    transformers_model(WIDE, model, seed=10)  # another model in the folder now: its fingerprint names no reference
    proc = launch(procs, ds_config, out, str(data), settings)
    assert "resumed from" in proc.stdout and "reference log-probabilities read from" in proc.stdout
    assert step_figures(out)[-6:] == pytest.approx(step_figures(run)[-6:], abs=1e-6)
    (reference,) = (data / "references").iterdir()
    reference.rename(reference.with_suffix(".moved"))
    try:
        gone = launch(procs, ds_config, out, str(data), [*settings, "train.max_steps=6"], check=False)
    finally:
        reference.with_suffix(".moved").rename(reference)
    assert gone.returncode == 2 and "step 2" not in gone.stdout
    assert (f"the reference log-probabilities this run started with, {reference}, are gone; fix: restore the file, "
            f"or start a fresh run") in gone.stdout + gone.stderr


def test_the_export_carries_the_chat_template(layouts):
    """A DPO run exports as any run does, with the template its pairs were rendered by."""
    folder = export(layouts["one"][0], "step_000004")
    assert json.loads(open(os.path.join(folder, "tokenizer_config.json")).read())["chat_template"] == CHATML
