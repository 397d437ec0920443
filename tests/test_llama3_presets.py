"""The Llama 3.1 presets at scale (configs/llama3.1_{8b,70b,405b}.yaml) as they train here: a tiny version of each
shape (its layers cut to 2 and its widths to a few dozen, its head-to-key/value-head ratio, untied head and RoPE
scaling kept) gives one process's losses and gradient norms at tp=2 and over 2 pipeline stages. (Their parameter
counts are the published ones: tests/test_llama.py.)"""
import pytest

from harness import FP32, launch, metrics

pytestmark = pytest.mark.launch

# preset: its query heads per key/value head and FFN width per model width (8B: 32 / 8 and 14,336 / 4,096)
SHAPES = {"llama3.1_8b": (4, 3.5), "llama3.1_70b": (8, 3.5), "llama3.1_405b": (16, 3.25)}
LAYOUTS = {"one": ("zero0.json", 1), "tp2": ("tp2.json", 2), "pp2": ("pipe2.json", 2)}


def tiny(preset: str) -> list[str]:
    """2 key/value heads of width 4 (tp=2 splits them), the preset's ratio of query heads to them; the
    characters' vocabulary."""
    ratio, ffn = SHAPES[preset]
    heads = 2 * ratio
    return [f"model.n_head={heads}", "model.n_kv_head=2", f"model.n_embd={4 * heads}",
            f"model.ffn_hidden={int(ffn * 4 * heads)}", "model.n_layer=2", "model.block_size=32",
            "model.vocab_size=null", "data.tokenizer=null",
            "train.max_steps=3", "optim.warmup_steps=1", "optim.lr=3e-3", "ds.train_micro_batch_size_per_gpu=4",
            *FP32]


@pytest.mark.parametrize("preset", SHAPES)
def test_a_tiny_version_trains_alike_at_tp2_and_pp2(tmp_path, char_data, preset):
    runs = {}
    for name, (ds_config, ranks) in LAYOUTS.items():
        launch(ranks, ds_config, tmp_path / name, char_data, [*tiny(preset), "ds.gradient_accumulation_steps=2"],
               config=f"{preset}.yaml")
        runs[name] = [(m["loss"], m["grad_norm"]) for m in metrics(tmp_path / name) if "loss" in m]
    assert len(runs["one"]) == 3
    for name in ("tp2", "pp2"):
        assert [loss for loss, _ in runs[name]] == pytest.approx([loss for loss, _ in runs["one"]], rel=1e-5), name
        assert [norm for _, norm in runs[name]] == pytest.approx([norm for _, norm in runs["one"]], rel=1e-5), name
