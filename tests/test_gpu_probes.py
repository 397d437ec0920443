"""The GPU tier's checks that each run a probe of their own (tests/test_gpu.py has the rest, and what the tier
is): a bf16 matmul against the datasheet, FlexAttention's document mask, ZeRO-3's first weights, a background save,
the memory plan against a step's measured peak, the preflight on one device."""
import json
import re

import pytest
import torch

from gpu_tier import CUDA, DEVICES, probe
from harness import BF16, FP32, TINY

# Two bf16 kernels of one attention (FlexAttention's and the dense mask's), relative to the largest magnitude:
# bf16 keeps 8 significant bits (0.4%), and each kernel rounds and orders its sums its own way.
BF16_KERNEL_RTOL = 0.01


@pytest.mark.timed
@pytest.mark.parametrize("device", [CUDA])
def test_a_bf16_matmul_reaches_60_percent_of_the_datasheet_peak(tmp_path, device):
    """So that an MFU read against the datasheet is honest: the device delivers the datasheet's range."""
    probe(device, "matmul", tmp_path / "matmul.json", "8192")
    measured = json.loads((tmp_path / "matmul.json").read_text())
    assert measured["tflops"] >= 0.6 * measured["datasheet_tflops"], measured



@pytest.mark.parametrize("device", DEVICES)
def test_flex_document_masking_equals_the_dense_mask_within_bf16(tmp_path, device):
    """The GPU's document-masking kernel (FlexAttention's block mask, compiled) computes the dense mask's attention
    to bf16's tolerance (docs/performance.md), outputs and gradients; the CPU, whose FlexAttention has no
    backward, checks its eager forward and keeps the dense kernel."""
    probe(device, "documents", tmp_path / "documents.json")
    measured = json.loads((tmp_path / "documents.json").read_text())
    assert measured["kernel"] == ("flex" if device == "cuda" else "dense")
    assert measured["documents"] > 8  # windows hold many documents
    for compared in [measured["output"], *measured["grads"]]:
        assert compared["max_diff"] <= BF16_KERNEL_RTOL * compared["max_abs"], measured
    assert len(measured["grads"]) == (3 if device == "cuda" else 0)



@pytest.mark.parametrize("device", DEVICES)
def test_zero3_starts_from_the_weights_zero0_builds_on_the_cpu(tmp_path, char_data, device):
    """Every layer is generated on the CPU from the CPU's generator, then partitioned: bitwise the same weights."""
    from model import build_model
    from training.config import DEFAULT_CONFIG, load_run_config

    model = [o for o in TINY if o.startswith("model.")]
    probe(device, "weights", tmp_path / "zero3.pt", "--ds_config", "ds_configs/zero3.json", *model, *FP32,
          "ds.zero_optimization.stage3_param_persistence_threshold=0", f"data.dir={char_data}",
          f"train.out_dir={tmp_path / 'out'}")  # not the quickstart's, which a checkout may hold
    zero3 = torch.load(tmp_path / "zero3.pt", weights_only=True)
    cfg = load_run_config(DEFAULT_CONFIG, [*model, "model.vocab_size=65"])
    zero0 = {name: p.detach() for name, p in build_model(cfg.model, cfg.train.seed).named_parameters()}
    assert zero3.keys() == zero0.keys()
    assert [name for name in zero0 if not torch.equal(zero3[name], zero0[name])] == []


@pytest.mark.parametrize("device", [CUDA])
def test_a_background_save_writes_the_bytes_of_a_synchronous_one(tmp_path, char_data, device):
    """The GPU's states are copied to the host, yet the files name the device as a synchronous save's do."""
    proc = probe(device, "saves", tmp_path / "saves.json", "--ds_config", "ds_configs/zero1.json", *TINY, *BF16,
                 f"data.dir={char_data}", f"train.out_dir={tmp_path}")
    record = json.loads((tmp_path / "saves.json").read_text())
    assert record["files"] == ["bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt", "mp_rank_00_model_states.pt"], \
        proc.stdout
    assert record["differ"] == []
    assert record["locations"]["mp_rank_00_model_states.pt"] == ["cuda:0"]



# The presets on a GPU; on a CPU, narrower shapes of them with the vocabulary kept, each ZeRO stage a few seconds.
# Eager: the presets compile, and under the probe's live-tensor count (a dispatch mode) the loss runs eagerly.
EAGER = ["train.compile=false"]
MEMORY_SHAPES = {"cuda": EAGER, "cpu": [*EAGER, "model.n_layer=2", "model.n_embd=192", "model.n_head=6",
                                        "model.block_size=128", "ds.train_micro_batch_size_per_gpu=4", *BF16]}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("preset, overrides", [("gpt2_124m", []),
                                               ("llama_124m", ["model.vocab_size=50000"])])
def test_the_memory_plan_is_within_5_percent_of_the_measured_peak(tmp_path, char_data, device, preset, overrides):
    """On a GPU the allocator's peak; on a CPU the live tensors' (benchmarks/live_tensors.py: the storages the
    allocator would hold), with the CPU's own kernels planned (torch's RMSNorm). ZeRO-3's peak is a known gap, its
    states are not."""
    stages = ",".join(f"ds_configs/zero{stage}.json" for stage in range(4))
    probe(device, "memory", tmp_path / "memory.json", f"configs/{preset}.yaml", stages, f"data.dir={char_data}",
          "data.tokenizer=char", *overrides, *MEMORY_SHAPES[device])
    results = json.loads((tmp_path / "memory.json").read_text())["results"]
    off = {name: r["plan"] / r["measured"] - 1 for name, r in results.items()}
    zero3 = results.pop("zero3.json")
    assert len(results) == 3 and all(abs(off[name]) <= 0.05 for name in results), off
    assert zero3["plan_states"] == pytest.approx(zero3["measured_states"], rel=0.05)  # its gradient bucket counted
    if abs(off["zero3.json"]) > 0.05:
        # what the next look at the gap starts from: whether the live tensors see it too, and the largest of them
        seen = {"allocator": zero3["measured"], "live tensors": zero3["live_tensors_peak"],
                "largest at the peak": zero3["largest_at_peak"][:6],
                "the allocator at its peak (benchmarks/allocator_trace.py)": zero3["allocator_at_peak"]}
        pytest.xfail(f"ZeRO-3's peak runs over the plan's activations ({off}; ZeRO-3's peak: {seen}): "
                     "docs/performance.md, 'The memory plan on a GPU'")


@pytest.mark.parametrize("device", [CUDA])
def test_selective_recomputation_is_planned_within_5_percent_of_the_measured_peak(tmp_path, char_data, device):
    """Llama-124M with every block recomputed selectively, under ZeRO-1 (on a CPU the block's count is checked to
    the byte, eager and compiled: tests/test_recompute.py), eager as MEMORY_SHAPES says."""
    probe(device, "memory", tmp_path / "memory.json", "configs/llama_124m.yaml", "ds_configs/zero1.json",
          f"data.dir={char_data}", "data.tokenizer=char", "model.vocab_size=50000", *MEMORY_SHAPES[device],
          "ds.pipeline.activation_checkpoint_interval=1", "ds.pipeline.recompute=selective")
    result = json.loads((tmp_path / "memory.json").read_text())["results"]["zero1.json"]
    assert abs(result["plan"] / result["measured"] - 1) <= 0.05, result



@pytest.mark.parametrize("device", DEVICES)
def test_the_preflight_on_one_device(tmp_path, char_data, device):
    """One rank: its device (on a GPU its name, UUID and NCCL version), and a process group of the device's
    backend that starts, all-reduces and ends cleanly."""
    proc = probe(device, "preflight", tmp_path / "preflight.json", "--ds_config", "ds_configs/zero1.json",
                 f"data.dir={char_data}", f"train.out_dir={tmp_path / 'out'}")
    seen = json.loads((tmp_path / "preflight.json").read_text())
    backend = {"cuda": "nccl", "cpu": "gloo"}[device]
    assert seen == {"backend": backend, "destroyed": True, "exit": 0}
    uuid = r"(GPU-)?[0-9a-f]{8}(-[0-9a-f]{4}){3}-[0-9a-f]{12}"
    identity = rf"cuda:0 \(.+, {uuid}, NCCL \d+\.\d+\.\d+\)" if device == "cuda" else "cpu"
    assert re.search(rf"rank +0 on .+, local rank 0, {identity}: ok\n", proc.stdout), proc.stdout
    assert "preflight passed" in proc.stdout and "Traceback" not in proc.stderr
