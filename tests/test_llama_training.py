"""The Llama through the real launcher, fp32: pp=2 (the head tied to the embedding across the two stages) and
ZeRO-1 at dp=2 give the ZeRO-0 losses and gradient norms; ZeRO-3 trains; runs start from a Hugging Face
checkpoint (`train.init_from`) under ZeRO-3 and pipeline stages; their exports load in transformers with this
repo's logits."""
import pytest
import torch
from safetensors.torch import load_file

from harness import FP32, export, launch, metrics
from hf_check import assert_export_matches_transformers, load_in_transformers, transformers_model
from model.config import ModelConfig

pytestmark = pytest.mark.launch  # several train.py processes per test (python -m pytest -m "not launch" skips them)

# TINY's 2 layers x 32 wide and 2 heads, with 1 key/value head (multi-query) and SwiGLU 64; global batch 8.
RUN = ["train.max_steps=6", "optim.warmup_steps=2", "optim.lr=3e-3", *FP32]
LLAMA = ["model.arch=llama", "model.n_kv_head=1", "model.ffn_hidden=64", *RUN]
SHAPE = ModelConfig(arch="llama", n_layer=2, n_head=2, n_kv_head=1, n_embd=32, ffn_hidden=64, block_size=32,
                    vocab_size=65)
PP2 = ["ds.train_micro_batch_size_per_gpu=4", "ds.gradient_accumulation_steps=2"]
DP2 = ["ds.train_micro_batch_size_per_gpu=4"]
ZERO3_ALL = ["ds.zero_optimization.stage3_param_persistence_threshold=0"]  # every parameter partitioned
# One step at a learning rate of 1e-20: an AdamW update is about lr in size, far below half an ulp of any weight
# initialized at transformers' scale, so the step-1 checkpoint holds the imported tensors bit for bit.
STILL = ["train.max_steps=1", "optim.lr=1e-20", "optim.min_lr=1e-20"]


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("transformers_llama")
    transformers_model(SHAPE, folder)
    return folder


@pytest.fixture(scope="module")
def runs(tmp_path_factory, char_data, hf_folder):
    tied = "model.tie_embeddings=true"  # the parity runs tie the head across stages; the imports do not
    layouts = {  # name: (ds_config, processes, overrides)
        "zero0": ("zero0.json", 1, [*LLAMA, "ds.train_micro_batch_size_per_gpu=8", tied]),
        "zero1_dp2": ("zero1.json", 2, [*LLAMA, *DP2, tied]),
        "pp2": ("pipe2.json", 2, [*LLAMA, *PP2, tied]),
        # From transformers' weights: trains under ZeRO-3, and one step that moves no weight (STILL) leaves
        # transformers' tensors in the checkpoint, under ZeRO-3 and 2 stages; the pipeline's run names no Llama
        # setting (the quickstart GPT's preset): its model is the folder's.
        "zero3_init": ("zero3.json", 2, [*LLAMA, *DP2, f"train.init_from={hf_folder}", *ZERO3_ALL]),
        "zero3_load": ("zero3.json", 2, [*LLAMA, *DP2, f"train.init_from={hf_folder}", *ZERO3_ALL, *STILL]),
        "pp2_init": ("pipe2.json", 2, [*RUN, *PP2, f"train.init_from={hf_folder}", *STILL]),
    }
    out = {}
    for name, (ds_config, nprocs, overrides) in layouts.items():
        out[name] = tmp_path_factory.mktemp(f"llama_{name}")
        proc = launch(nprocs, ds_config, out[name], char_data, overrides)
        if "init" in name:
            assert f"initialized from {hf_folder}" in proc.stdout
    return out


def losses_and_norms(out_dir):
    steps = [m for m in metrics(out_dir) if "loss" in m]
    return [m["loss"] for m in steps], [m["grad_norm"] for m in steps]


@pytest.mark.parametrize("layout", ["pp2", "zero1_dp2"])
def test_layouts_match_zero0_step_for_step(runs, layout):
    losses, norms = losses_and_norms(runs[layout])
    if layout == "pp2":
        assert [m["tied_weights_in_sync"] for m in metrics(runs[layout]) if "tied_weights_in_sync" in m] == [True]
    reference_losses, reference_norms = losses_and_norms(runs["zero0"])
    assert len(losses) == len(reference_losses) == 6
    assert losses == pytest.approx(reference_losses, abs=1e-5)
    assert norms == pytest.approx(reference_norms, abs=1e-5)


def test_zero3_from_transformers_weights_trains(runs):
    losses, _ = losses_and_norms(runs["zero3_init"])
    assert len(losses) == 6 and losses[-1] < losses[0] - 0.05


@pytest.mark.parametrize("name", ["zero3_load", "pp2_init"])
def test_init_from_loads_transformers_weights_exactly(runs, hf_folder, name):
    """The checkpoint after a step that moves no weight holds transformers' tensors, under ZeRO-3 and 2 stages."""
    exported = load_file(f"{export(runs[name], 'step_000001')}/model.safetensors")
    original = load_file(hf_folder / "model.safetensors")
    assert sorted(exported) == sorted(original)
    for key, tensor in original.items():
        torch.testing.assert_close(exported[key], tensor, rtol=0, atol=0, msg=key)


@torch.no_grad()
def test_imported_run_computes_transformers_logits(runs, hf_folder):
    """The run's own weights after step 1, in this repo's forward, give transformers' logits."""
    folder = export(runs["pp2_init"], "step_000001")
    assert_export_matches_transformers(folder, tokens=32)
    idx = torch.randint(0, 65, (2, 32), generator=torch.Generator().manual_seed(1))
    theirs = load_in_transformers(str(hf_folder))(idx).logits
    assert (load_in_transformers(folder)(idx).logits - theirs).abs().max().item() <= 1e-5


@pytest.mark.parametrize("name", ["zero3_init", "pp2"])
def test_trained_exports_load_in_transformers(runs, name):
    assert_export_matches_transformers(export(runs[name], "step_000006"), tokens=32)
