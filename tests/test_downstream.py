"""Multiple-choice accuracy in the training loop and lm-evaluation-harness on its checkpoints, fp32, on the
Shakespeare continuation task: the loop's score and python -m scripts.evaluate's of one checkpoint agree
(acc by the same rule, acc_norm per token from the harness interface's log-likelihoods); data parallelism
under ZeRO-3, pipeline stages and tensor parallelism give the one-process score, in the loop and once their
checkpoints are merged."""
import json
import os
import re
import shutil

import pytest

from data.tasks import DELIMITER, read_task
from harness import FP32, REPO, TINY, export, launch, metrics
from scripts import evaluate
from training.checkpoints.export import load_trained
from training.evaluation.lm_eval_model import CheckpointLM
from training.evaluation.multiple_choice import choose

pytestmark = pytest.mark.launch  # several train.py processes per test (python -m pytest -m "not launch" skips them)

EXAMPLES = 48
# Vocabulary slices of 36 under tp 2: both tensor ranks hold characters of the text.
SCORED = [*TINY, "model.block_size=64", "model.vocab_multiple=8", f"eval.limit={EXAMPLES}", "train.eval_interval=1000",
          *FP32]
LAYOUTS = {"zero3_dp2": ("zero3.json", ["ds.train_micro_batch_size_per_gpu=6"]),
           "pp2": ("pipe2.json", ["ds.train_micro_batch_size_per_gpu=3", "ds.gradient_accumulation_steps=4"]),
           "tp2": ("tp2.json", ["ds.train_micro_batch_size_per_gpu=6", "ds.gradient_accumulation_steps=2"])}


def loop_scores(out_dir) -> dict[int, tuple[float, float]]:
    """{step: (acc, acc_norm)} the training loop logged for the task."""
    return {r["step"]: (r["shakespeare_acc"], r["shakespeare_acc_norm"]) for r in metrics(out_dir)
            if "shakespeare_acc" in r}


def harness_acc(out_dir, task: str, tmp_path) -> float:
    """acc of python -m scripts.evaluate on the run's newest checkpoint (its slices merged, one process)."""
    output = tmp_path / f"{out_dir.name}.json"
    evaluate.main(["--out_dir", str(out_dir), "--tasks", task, "--limit", str(EXAMPLES), "--output", str(output)])
    return json.loads(output.read_text())["tasks"]["shakespeare"]["metrics"]["acc,none"]


class Request:
    def __init__(self, *args):
        self.args = args


def per_token_acc_norm(out_dir, task: str) -> float:
    """acc_norm by the loop's rule from the log-likelihoods the harness's model interface gives."""
    cfg, model, tokenizer, _ = load_trained(str(out_dir))
    lm = CheckpointLM(model, cfg.block_size, cfg.vocab_size, tokenizer, "cpu")
    examples = read_task(task, tokenizer, EXAMPLES).examples
    with open(task) as f:
        records = [json.loads(line) for line, _ in zip(f, range(EXAMPLES))]
    right = 0
    for record, example in zip(records, examples):
        scored = lm.loglikelihood([Request(record["ctx"], DELIMITER + ending) for ending in record["endings"]])
        _, pick = choose([-loglik for loglik, _ in scored], [len(ids) for ids in example.ending_ids])
        right += pick == example.label
    return right / EXAMPLES


@pytest.fixture(scope="module")
def trained(tmp_path_factory, char_data, shakespeare_task):
    """One process, 200 steps at a high learning rate (a model that prefers some lines), and its export."""
    out = tmp_path_factory.mktemp("scored_one")
    launch(1, "zero0.json", out, char_data, [*SCORED, f"eval.tasks=[{shakespeare_task}]", "train.max_steps=200",
                                            "optim.lr=1e-2", "optim.warmup_steps=10"])
    return out, export(out, "step_000200")


def test_the_loop_and_the_harness_score_a_checkpoint_alike(trained, shakespeare_task, tmp_path):
    out, _ = trained
    scores = loop_scores(out)
    acc, acc_norm = scores[200]
    assert scores[200] != scores[0]  # training moved the score: the check below compares a trained model
    assert harness_acc(out, shakespeare_task, tmp_path) == acc
    assert per_token_acc_norm(out, shakespeare_task) == acc_norm


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_layout_gives_the_one_process_score(trained, layout, char_data, shakespeare_task, tmp_path):
    """Started from the one-process model's export: their step-0 score is its final one; after two steps, the
    harness's score of the layout's checkpoint is the loop's."""
    _, weights = trained
    ds_config, overrides = LAYOUTS[layout]
    out = tmp_path / layout
    launch(2, ds_config, out, char_data, [*SCORED, *overrides, f"eval.tasks=[{shakespeare_task}]", "train.max_steps=2",
                                          f"train.init_from={weights}"])
    scores = loop_scores(out)
    assert scores[0] == loop_scores(trained[0])[200]
    assert harness_acc(out, shakespeare_task, tmp_path) == scores[2][0]


def test_the_docs_task_yaml_runs_offline_and_scores_as_the_jsonl_task(trained, shakespeare_task, tmp_path,
                                                                       monkeypatch):
    """docs/evaluation.md's task YAML, its data read from the folder the command runs in, the hub switched off."""
    out, _ = trained
    docs = open(os.path.join(REPO, "docs", "evaluation.md")).read()
    (tmp_path / "shakespeare.yaml").write_text(re.search(r"```yaml\n(.*?)```", docs, re.S).group(1))
    (tmp_path / "data" / "eval").mkdir(parents=True)
    shutil.copy(shakespeare_task, tmp_path / "data" / "eval" / "shakespeare.jsonl")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    evaluate.main(["--out_dir", str(out), "--tasks", "shakespeare.yaml", "--limit", str(EXAMPLES), "--output",
                   "yaml.json"])
    scored = json.loads((tmp_path / "yaml.json").read_text())["tasks"]["shakespeare_yaml"]["metrics"]
    assert scored["acc,none"] == loop_scores(out)[200][0]
