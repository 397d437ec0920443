"""Document masking through the real launcher, fp32, on tinyshakespeare's speeches as separate documents: pipeline
stages (with activation checkpointing), tensor parallelism, both, and ZeRO-3 at dp 2 train as one process does, a run
stopped and resumed continues the uninterrupted one, the masking changes the losses of many short documents,
and it changes nothing on the single-document quickstart data."""
import pytest

from harness import FP32, TINY, grad_norms, launch, metrics, train_losses, train_py

pytestmark = pytest.mark.launch  # several train.py processes per test (python -m pytest -m "not launch" skips them)

# Global batch 8 in every layout (micro 2 x accumulation 4 / dp); a checkpoint at step 2 of 4; the Llama with
# grouped-query attention (4 query heads, 2 key/value heads: whole groups on each of 2 tensor ranks).
MASKED = ["model.document_masking=true", "train.max_steps=4", "train.save_interval=2", "train.eval_interval=2",
          "optim.warmup_steps=2", "optim.lr=3e-3", "ds.train_micro_batch_size_per_gpu=2", *FP32]
ARCHS = {"gpt": ("quickstart.yaml", []), "llama": ("llama_quickstart.yaml", ["model.n_head=4", "model.n_kv_head=2"])}
LAYOUTS = {  # name: (processes, ds_config, overrides)
    "one": (1, "zero0.json", ["ds.gradient_accumulation_steps=4"]),
    "pp2": (2, "pipe2.json", ["ds.gradient_accumulation_steps=4", "ds.pipeline.activation_checkpoint_interval=1"]),
    "tp2": (2, "tp2.json", ["ds.gradient_accumulation_steps=4"]),
    "zero3_dp2": (2, "zero3.json", ["ds.gradient_accumulation_steps=2"]),
    # DeepSpeed splits the activations a stage sends over the tensor ranks: the positions ride beside them.
    "pp2_tp2": (4, "pipe2_tp2.json", ["ds.gradient_accumulation_steps=4"]),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, speech_data):
    done = {}

    def get(arch: str, layout: str, extra=()):
        key = (arch, layout, *extra)
        if key not in done:
            config, shape = ARCHS[arch]
            procs, ds_config, overrides = LAYOUTS[layout]
            out = tmp_path_factory.mktemp(f"{arch}_{layout}")
            proc = launch(procs, ds_config, out, speech_data, [*MASKED, *shape, *overrides, *extra], config=config)
            done[key] = (out, proc.stdout)
        return done[key]
    return get


def val_losses(out_dir) -> list[float]:
    return [m["val_loss"] for m in metrics(out_dir) if "val_loss" in m]


@pytest.mark.parametrize("layout", ["pp2", "tp2", "zero3_dp2", "pp2_tp2"])
@pytest.mark.parametrize("arch", ARCHS)
def test_layouts_train_as_one_process_does(runs, arch, layout):
    (out, stdout), (reference, _) = runs(arch, layout), runs(arch, "one")
    assert "document masking: attention within each document" in stdout
    assert len(train_losses(out)) == 4
    assert train_losses(out) == pytest.approx(train_losses(reference), abs=1e-5)
    assert grad_norms(out) == pytest.approx(grad_norms(reference), abs=1e-5)
    assert val_losses(out) == pytest.approx(val_losses(reference), abs=1e-5)
    assert train_losses(reference)[-1] < train_losses(reference)[0] - 0.05  # it really trains


@pytest.mark.parametrize("arch", ARCHS)
def test_a_resumed_run_continues_the_uninterrupted_one(runs, tmp_path, speech_data, arch):
    uninterrupted, _ = runs(arch, "one")
    config, shape = ARCHS[arch]
    procs, ds_config, overrides = LAYOUTS["one"]
    resumed = launch(procs, ds_config, tmp_path, speech_data,
                     [*MASKED, *shape, *overrides, f"train.resume={uninterrupted}/checkpoints/step_000002"],
                     config=config)
    assert "at step 2" in resumed.stdout
    after = [(m["step"], m["loss"], m["grad_norm"]) for m in metrics(tmp_path) if "loss" in m]
    assert after == [(m["step"], m["loss"], m["grad_norm"]) for m in metrics(uninterrupted)
                     if "loss" in m and m["step"] > 2]


@pytest.mark.parametrize("arch", ARCHS)
def test_masking_changes_the_losses_of_many_short_documents(runs, arch):
    masked, unmasked = runs(arch, "one")[0], runs(arch, "one", ("model.document_masking=false",))[0]
    # At these first steps the models use little context: the differences are small (1e-4), yet 100 times what
    # two layouts of one computation differ by.
    for ours, theirs in ((train_losses(masked), train_losses(unmasked)), (grad_norms(masked), grad_norms(unmasked))):
        assert len(ours) == len(theirs) == 4 and all(abs(a - b) > 1e-5 for a, b in zip(ours, theirs))


def test_single_document_data_trains_as_without_masking(tmp_path, char_data):
    """The character quickstart's dataset has no delimiter: masking on gives the unmasked losses, bit for bit."""
    outputs = {}
    for masking in ("true", "false"):
        out = tmp_path / masking
        proc = train_py([f"data.dir={char_data}", f"train.out_dir={out}", *TINY, *FP32, "train.max_steps=3",
                         "train.eval_interval=3", f"model.document_masking={masking}"], env={"OMP_NUM_THREADS": "1"})
        outputs[masking] = (metrics(out), proc.stdout)
    (on, stdout), (off, _) = outputs["true"], outputs["false"]
    assert "document masking: on, but the data has no document delimiter (one document)" in stdout
    strip = ("tokens_per_s", "mfu", "peak_mem_gb", "reserved_gb", "time")
    assert [{k: v for k, v in m.items() if k not in strip} for m in on] == \
        [{k: v for k, v in m.items() if k not in strip} for m in off]
