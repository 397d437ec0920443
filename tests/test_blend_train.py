"""Training on a weighted blend of two prepared datasets at dp=2 (the uninterrupted run through the deepspeed
launcher, the others as forked ranks): a stopped and resumed run equals an uninterrupted one, dp=1, dp=2 and
pp=2 evaluate the same validation set (same val loss, fp32), the metrics count each source's epochs, and
resuming on other data is refused. The datasets are prepared with a word-level tokenizer.json, named nowhere in
the run's settings, and the runs keep the default prompt, a newline that encodes to no tokens: every run samples
from the end-of-text token instead."""
import json
import os

import pytest

from corpora import prepare_blend_sources
from harness import FP32, TINY, deepspeed_launch, launch, metrics, sample_py, train_losses, train_py

pytestmark = pytest.mark.launch  # several train.py processes per test (python -m pytest -m "not launch" skips them)

STEPS = ["train.max_steps=6", "train.eval_interval=3", "train.save_interval=3", "train.eval_windows=10"]


def blend(plays, docs, w_plays=0.3, w_docs=0.7):
    return [f"data.sources=[{{dir: {plays}, weight: {w_plays}}}, {{dir: {docs}, weight: {w_docs}}}]"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, shakespeare_path):
    root = tmp_path_factory.mktemp("blend_train")
    plays, docs = prepare_blend_sources(str(root), shakespeare_path, word_level=True)
    common = blend(plays, docs) + STEPS + FP32
    out = {name: str(root / name) for name in ("straight", "resumed", "dp1", "pp2")}
    proc = deepspeed_launch(2, "zero0.json", out["straight"], plays, common)  # the crash's own command, as typed
    with open(os.path.join(out["straight"], "launch.log"), "w") as f:
        f.write(proc.stdout + proc.stderr)
    launch(2, "zero0.json", out["resumed"], plays, common + ["train.stop_at_step=3"])
    launch(2, "zero0.json", out["resumed"], plays, common)  # train.resume=auto: continues from step 3
    launch(1, "zero0.json", out["dp1"], plays, common + ["ds.gradient_accumulation_steps=2"])  # same global batch
    # Two stages, micro-batches of 4: the 10 windows take 3 micro-batches, the last one half padding.
    launch(2, "pipe2.json", out["pp2"], plays, common + ["train.max_steps=1"])
    return plays, docs, out


def test_a_prompt_that_encodes_to_nothing_samples_from_the_end_of_text_token(runs):
    """The default prompt, a newline, has no word in it: the run says at start that it samples from the
    dataset's end-of-text token, trains, saves and ends with the sample (exit 0: launch checks it)."""
    _, _, out = runs
    with open(os.path.join(out["straight"], "launch.log")) as f:
        output = f.read()
    note = ("the prompt '\\n' encodes to no tokens with the dataset's tokenizer.json tokenizer: the sample starts "
            "from its document delimiter '<|endoftext|>' (id 0)")
    assert note in output and output.index(note) < output.index("step 0:")
    sample = output.split("--- sample ---\n")[1].split("\n--------------")[0]
    assert sample.startswith("<|endoftext|> ") and len(sample.split()) == 1 + 16  # sample.max_new_tokens words
    assert "Traceback" not in output


def test_sample_py_starts_from_the_end_of_text_token_too(runs):
    _, _, out = runs
    proc = sample_py(["--out_dir", out["straight"], "--max_new_tokens", "5"])
    assert "the prompt '\\n' encodes to no tokens with the dataset's tokenizer.json tokenizer" in proc.stderr
    assert proc.stdout.startswith("<|endoftext|> ") and len(proc.stdout.split()) == 1 + 5


def val_losses(out_dir):
    return [(m["step"], m["val_loss"]) for m in metrics(out_dir) if "val_loss" in m]


def test_a_resumed_blended_run_equals_an_uninterrupted_one(runs):
    _, _, out = runs
    straight = train_losses(out["straight"])
    assert len(straight) == 6 and train_losses(out["resumed"]) == pytest.approx(straight, abs=1e-6)
    resumed, uninterrupted = val_losses(out["resumed"]), val_losses(out["straight"])
    assert [s for s, _ in resumed] == [s for s, _ in uninterrupted] == [0, 3, 6]
    assert [v for _, v in resumed] == pytest.approx([v for _, v in uninterrupted], abs=1e-6)


def test_dp1_and_dp2_evaluate_the_same_validation_set(runs):
    _, _, out = runs
    dp1, dp2 = val_losses(out["dp1"]), val_losses(out["straight"])
    assert [s for s, _ in dp1] == [s for s, _ in dp2] == [0, 3, 6]
    assert [v for _, v in dp1] == pytest.approx([v for _, v in dp2], abs=1e-5)
    assert train_losses(out["dp1"]) == pytest.approx(train_losses(out["straight"]), abs=1e-5)  # the same samples


def test_a_pipeline_evaluates_the_same_validation_set(runs):
    """Same initial weights in every layout (layer-seeded), so the step-0 val loss must match."""
    _, _, out = runs
    assert val_losses(out["pp2"])[0][1] == pytest.approx(val_losses(out["straight"])[0][1], abs=1e-5)


def test_metrics_count_the_epochs_of_each_source(runs):
    _, docs, out = runs
    logged = [m for m in metrics(out["straight"]) if "loss" in m]
    with open(os.path.join(docs, "meta.json")) as f:
        docs_windows = (json.load(f)["train_tokens"] - 1) // 32  # the docstrings' windows of block_size 32
    for m in logged:  # 24 samples a step, 7 of every 10 from the docstrings
        assert m["epochs_docs_data"] == pytest.approx(0.7 * 24 * m["step"] / docs_windows, abs=2 / docs_windows)
    assert logged[-1]["epochs_plays_data"] < logged[-1]["epochs_docs_data"]


def test_resuming_on_other_weights_is_refused(runs):
    plays, docs, out = runs
    proc = train_py([f"train.out_dir={out['straight']}", *TINY, *FP32, *STEPS,
                     "train.max_steps=9", *blend(plays, docs, 0.5, 0.5)], check=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "the checkpoint was trained on other data: source 0" in proc.stdout + proc.stderr
    assert "the weight differs: 0.3 then, 0.5 now" in proc.stdout + proc.stderr
    assert "set data.allow_changed=true" in proc.stdout + proc.stderr
