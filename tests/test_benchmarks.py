"""The benchmarks: the memory theory is the ZeRO paper's arithmetic, and the throughput comparison trains the
same model on the same data with the same optimizer in the DeepSpeed engine and in the plain loop."""
import json
import sys

import pytest

from benchmarks.memory import theory_bytes
from benchmarks.tensor_parallel import theory as tensor_parallel_theory
from conftest import TINY, run
from training.config import load_run_config

PSI, RANKS, SUB_GROUP = 1_000_000, 2, 100_000


@pytest.mark.parametrize("name, total, step_fp32_grads", [
    ("zero0", (2 + 2 + 12) * PSI, 4 * PSI),
    ("zero1", (2 + 2) * PSI + 12 * PSI / RANKS, 4 * PSI / RANKS),
    ("zero2", 2 * PSI + (2 + 12) * PSI / RANKS, 4 * PSI / RANKS),
    ("zero3", (2 + 2 + 12) * PSI / RANKS, 4 * SUB_GROUP),  # ZeRO-3 converts one sub-group at a time
    ("zero2_offload", 2 * PSI + (2 + 12 + 4 + 2) * PSI / RANKS, 0),  # the fp32 gradient partition is kept
])
def test_memory_theory_mixed_precision(name, total, step_fp32_grads):
    theory = theory_bytes(PSI, name, RANKS, mixed=True, sub_group_size=SUB_GROUP)
    assert theory["total"] == total
    assert theory["step_fp32_grads"] == step_fp32_grads


def test_memory_theory_fp32():
    zero0 = theory_bytes(PSI, "zero0", RANKS, mixed=False, sub_group_size=SUB_GROUP)
    zero3 = theory_bytes(PSI, "zero3", RANKS, mixed=False, sub_group_size=SUB_GROUP)
    assert (zero0["weights"], zero0["grads"], zero0["optimizer"]) == (4 * PSI, 4 * PSI, 8 * PSI)
    assert zero3["total"] == 16 * PSI / RANKS
    assert zero0["step_fp32_grads"] == zero3["step_fp32_grads"] == 0


def test_tensor_parallel_theory_is_megatrons_arithmetic():
    """The baby GPT (6 layers, d 384, context 256, 128 padded vocabulary) at tp 2: every rank keeps the positions
    and, per layer, two LayerNorms and two row-parallel biases whole, and half of everything else; per micro-batch
    of 8 sequences, 4 all-reduces of b x s x d per layer, 2 more around the vocabulary, 3 per-token fp32 ones."""
    cfg = load_run_config("configs/baby_gpt.yaml", ["model.vocab_size=65"]).model
    whole, d, tokens = 10_795_008, 384, 8 * 256
    replicated = 256 * d + 6 * (2 * d + 2 * d + d + d) + 2 * d
    tp1, tp2 = tensor_parallel_theory(cfg, 1, 8, 4), tensor_parallel_theory(cfg, 2, 8, 4)
    assert (tp1["params"], tp2["params"]) == (whole, replicated + (whole - replicated) // 2)
    assert (tp1["states"], tp2["states"]) == (12 * whole, 12 * tp2["params"])
    assert (tp1["tp_bytes"], tp2["tp_bytes"]) == (0, (4 * 6 + 2) * tokens * d * 4 + 3 * tokens * 4)
    assert tp2["ring_bytes"] == tp2["tp_bytes"]  # 2 (t - 1) / t = 1 at t = 2


def test_throughput_reference_trains_the_same_model(char_data, tmp_path):
    report = tmp_path / "throughput.json"
    run([sys.executable, "benchmarks/throughput.py", "--config", "configs/quickstart.yaml", "--steps", "4",
         "--warmup", "1", "--chunk", "2", "--json", str(report), f"data.dir={char_data}"])
    written = json.loads(report.read_text())
    results = {r["precision"]: r for r in written["results"]}
    assert set(results) == {"bf16", "fp32"}
    fp32, bf16 = results["fp32"], results["bf16"]
    # fp32: the same arithmetic in both loops; bf16: DeepSpeed and the loop round the master weights alike, but
    # not every kernel sums in the same order.
    assert fp32["deepspeed"]["final_loss"] == pytest.approx(fp32["reference"]["final_loss"], rel=1e-5)
    assert bf16["deepspeed"]["final_loss"] == pytest.approx(bf16["reference"]["final_loss"], rel=1e-2)
    for result in results.values():
        # MFU is against the peak the script measured on this machine, for this precision
        assert result["peak_tflops"] > 0
        assert result["deepspeed"]["mfu"] == pytest.approx(
            result["deepspeed"]["tokens_per_s"] * written["flops_per_token"] / (result["peak_tflops"] * 1e12))


def test_llama_throughput_builds_and_times_both_models(char_data, tmp_path):
    """The mode whose import once moved away unnoticed: one timed step each of a tiny GPT and Llama."""
    out = tmp_path / "out"
    run([sys.executable, "benchmarks/llama.py", "throughput", "--steps", "1", "--warmup", "0", "--chunk", "1",
         "--out_dir", str(out), f"data.dir={char_data}", *TINY])
    written = json.loads((out / "throughput.json").read_text())
    assert written["llama"]["parameters"] != written["gpt"]["parameters"]  # two models, not one twice
    assert written["gpt"]["tokens_per_s"] > 0 and written["llama"]["tokens_per_s"] > 0 and written["mfu_ratio"] > 0
