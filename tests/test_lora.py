"""LoRA (model.lora_rank, model/lora.py): the adapted model starts as the model it adapts (the same weights from the
same seed, the same logits); only the adapters train, through the real DeepSpeed engine at every ZeRO stage (the
frozen weights bitwise as they were, the optimizer holding the adapters alone); the merged model computes what the
adapted one does; the memory plan and the FLOPs count the frozen weights as such. Through train.py: a fine-tune of a
transformers-built Llama with adapters equals one process under ZeRO-3 over two ranks, over two pipeline stages and
over two tensor ranks (the adapters split as their maps, and lora_dropout's masks as one process draws them); its
checkpoint holds the folder's weights untouched and, converted to the universal format, resumes at another layout;
its export (merged, or the adapters alone in PEFT's layout) equals the adapted model in transformers, and in PEFT
while training too (lora_dropout's masks)."""
import dataclasses
import json
import os

import deepspeed
import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file

from chats import reverse_tasks
from common.checks import ConfigError
from data.prepare_chat import prepare_chat
from harness import FP32, export, grad_norms, launch, metrics, one_rank_world, train_losses, universal
from hf_check import load_in_transformers, transformers_model
from model import build_model
from model.config import ModelConfig
from model.lora import LoRALinear, is_adapter, merged
from model.tensor_parallel import COLUMN, ROW, TensorParallel, shard_parameter, split_rule
from model_checks import SMALL_GPT
from training.checkpoints.adapter import write_adapter
from training.checkpoints.export import consolidated_state_dict, load_trained, write_export
from training.checkpoints.hf import from_hf, weight_files
from training.config import RunConfig
from training.engines import training_engine
from training.memory_plan import layer_params, plan
from training.metrics import flops_per_token
from training.optim import optimizer_and_schedule
from training.steps import lm_loss

SMALL_LLAMA = ModelConfig(arch="llama", n_layer=2, n_head=4, n_kv_head=2, n_embd=32, ffn_hidden=64, block_size=16,
                          vocab_size=65)
RANK = 4


def adapted(cfg: ModelConfig, **lora) -> ModelConfig:
    return dataclasses.replace(cfg, lora_rank=RANK, **lora)


def random_adapters(model: torch.nn.Module) -> None:
    """B away from its zero start, so that the adapters change what the model computes."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("lora_b"):
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))))


@pytest.mark.parametrize("cfg", [SMALL_GPT, SMALL_LLAMA], ids=["gpt", "llama"])
def test_the_adapted_model_starts_as_the_model_it_adapts(cfg):
    plain, lora = build_model(cfg, seed=3), build_model(adapted(cfg), seed=3)
    ours, theirs = plain.state_dict(), lora.state_dict()
    assert set(theirs) - set(ours) == {n for n in theirs if is_adapter(n)}
    assert all(torch.equal(ours[name], theirs[name]) for name in ours)
    idx = torch.randint(0, 65, (2, cfg.block_size), generator=torch.Generator().manual_seed(0))
    assert torch.equal(plain(idx), lora(idx))
    # Every linear map of every block is adapted ("all"), and nothing but the adapters trains: r x (in + out) each.
    maps = [m for m in lora.modules() if isinstance(m, LoRALinear)]
    assert len(maps) == cfg.n_layer * (4 if cfg.arch == "gpt" else 7)
    trained = {n: p.numel() for n, p in lora.named_parameters() if p.requires_grad}
    assert set(trained) == {n for n in theirs if is_adapter(n)}
    assert sum(trained.values()) == sum(RANK * (m.in_features + m.out_features) for m in maps)


def test_the_targets_name_the_maps_adapted():
    lora = build_model(adapted(SMALL_LLAMA, lora_targets="attn.q,attn.v"))
    assert sorted(n for n, m in lora.named_modules() if isinstance(m, LoRALinear)) == \
        ["1.attn.q", "1.attn.v", "2.attn.q", "2.attn.v"]


@pytest.mark.parametrize("cfg", [SMALL_GPT, SMALL_LLAMA], ids=["gpt", "llama"])
def test_the_merged_model_computes_what_the_adapted_one_does(cfg):
    lora = build_model(adapted(cfg, lora_alpha=8.0), seed=3)
    random_adapters(lora)
    merged_cfg, state = merged(adapted(cfg, lora_alpha=8.0), lora.state_dict())
    assert merged_cfg == cfg and not any(is_adapter(name) for name in state)
    plain = build_model(merged_cfg)
    plain.load_state_dict(state)
    idx = torch.randint(0, 65, (2, cfg.block_size), generator=torch.Generator().manual_seed(0))
    difference = (plain(idx) - lora(idx)).abs().max().item()
    assert 0 < difference <= 1e-5  # merged, not the same computation
    unmerged = build_model(cfg, seed=3)(idx)
    assert (unmerged - lora(idx)).abs().max().item() > 1e-2  # the adapters count


@pytest.fixture(scope="module")
def process_group():
    with one_rank_world():
        yield


@pytest.mark.parametrize("stage,bf16", [(0, False), (1, True), (2, False), (3, False)])
def test_only_the_adapters_train_through_deepspeed(stage, bf16, process_group):
    """Three steps at a rate that moves every trained weight: the adapters change (A once B has left zero), nothing
    else by a bit; the optimizer DeepSpeed builds holds the adapters alone."""
    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(RunConfig), {"optim": {"lr": 1e-2}}))
    cfg.model = adapted(SMALL_GPT)
    ds = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
          "steps_per_print": 10**9, "zero_optimization": {"stage": stage}, "bf16": {"enabled": bf16}}
    ds.update(optimizer_and_schedule(cfg, ds))
    model = build_model(cfg.model, seed=1)
    engine = training_engine(model, cfg, ds)  # bf16: the weights in 16 bits from here
    params = list(model.parameters())
    with deepspeed.zero.GatheredParameters(params, enabled=stage == 3):
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
    adapters = {n for n in before if is_adapter(n)}
    for step in range(3):
        idx = torch.randint(0, 65, (2, 17), generator=torch.Generator().manual_seed(step))
        engine.backward(lm_loss(engine(idx[:, :-1]), idx[:, 1:]))
        engine.step()
    with deepspeed.zero.GatheredParameters(params, enabled=stage == 3):
        changed = {n for n, p in model.named_parameters() if not torch.equal(p.detach(), before[n])}
    assert changed == adapters
    numel = sum(p.ds_numel if stage == 3 else p.numel() for n, p in model.named_parameters() if n in adapters)
    assert numel == 2 * RANK * (32 + 96 + 32 + 32 + 32 + 128 + 128 + 32)  # qkv, proj, fc, proj; two blocks
    torch_adamw = getattr(engine.optimizer, "optimizer", engine.optimizer)  # inside ZeRO's wrapper, where there is one
    moments = sum(state["exp_avg"].numel() for state in torch_adamw.state.values())
    assert moments == numel
    engine.destroy()


@pytest.mark.parametrize("cfg,targets", [(SMALL_GPT, "attn.qkv,attn.proj"), (SMALL_LLAMA, "all")],
                         ids=["gpt", "llama"])
def test_the_adapters_load_in_peft_over_the_model_they_adapt(cfg, targets, tmp_path):
    """scripts.export --adapter's folder in PEFT over the transformers model of the weights adapted computes what the
    adapted model does; the GPT's attention c_proj adapted, its MLP's c_proj (the same short name) not, and its
    Conv1D maps transposed."""
    import peft

    lora_cfg = adapted(cfg, lora_targets=targets, lora_dropout=0.25)
    lora = build_model(lora_cfg, seed=3)
    random_adapters(lora)
    state = lora.state_dict()
    base = write_export(str(tmp_path / "base"), cfg, {n: t for n, t in state.items() if not is_adapter(n)},
                        {"format": 2, "tokenizer": "char", "vocab_size": 65}, step=0)
    folder = write_adapter(str(tmp_path / "adapter"), lora_cfg, state, base)
    theirs = peft.PeftModel.from_pretrained(load_in_transformers(base), folder).eval()
    settings = theirs.peft_config["default"]
    assert (settings.base_model_name_or_path, settings.lora_dropout) == (base, 0.25)
    idx = torch.randint(0, 65, (2, cfg.block_size), generator=torch.Generator().manual_seed(0))
    expected = lora.eval()(idx)[..., :65]
    assert (theirs(idx).logits - expected).abs().max().item() <= 1e-5
    assert (load_in_transformers(base)(idx).logits - expected).abs().max().item() > 1e-2  # the adapters count
    # Training, each adapter's input is dropped as PEFT drops it: the same masks from the same seed, map by map.
    dropped = [logits(model.train(), idx, seed=5) for model in (lora, theirs)]
    assert (dropped[0][..., :65] - dropped[1]).abs().max().item() <= 1e-5
    assert (dropped[0][..., :65] - expected).abs().max().item() > 1e-2


def logits(model: torch.nn.Module, idx: torch.Tensor, seed: int) -> torch.Tensor:
    torch.manual_seed(seed)
    out = model(idx)
    return getattr(out, "logits", out)


def test_an_adapter_export_is_refused_where_it_would_not_hold_the_model(tmp_path):
    """No adapters to write, a reward model's trained score head, an earlier folder: each refused in one line naming
    the fix, nothing written."""
    folder = str(tmp_path / "adapter")
    with pytest.raises(ConfigError, match=r"^the checkpoint holds no adapters \(its model.lora_rank is 0\); fix: "
                                          r"export it without --adapter, as the whole model$"):
        write_adapter(folder, SMALL_LLAMA, build_model(SMALL_LLAMA).state_dict(), None)
    reward = adapted(dataclasses.replace(SMALL_LLAMA, head="score"))
    with pytest.raises(ConfigError, match=r"^the checkpoint is a reward model's \(model.head=score\), whose score "
                                          r"head trains beside the adapters; fix: export it without --adapter"):
        write_adapter(folder, reward, build_model(reward).state_dict(), None)
    assert not (tmp_path / "adapter").exists()
    (tmp_path / "adapter").mkdir()
    (tmp_path / "adapter" / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match=r"already exists and would be overwritten; fix: pass another --output"):
        write_adapter(folder, adapted(SMALL_LLAMA), build_model(adapted(SMALL_LLAMA)).state_dict(), None, force=True)
    assert sorted(os.listdir(folder)) == ["notes.txt"]


def test_the_memory_plan_keeps_optimizer_states_for_the_adapters_alone():
    """The frozen weights at 16 bits, their gradients and optimizer states not there: ZeRO-0 and ZeRO-1 over two
    ranks (DeepSpeed's fp16 optimizer wrappers under bf16)."""
    cfg = adapted(SMALL_LLAMA)
    every, trained = sum(layer_params(cfg)), sum(layer_params(cfg, trainable=True))
    assert every == sum(layer_params(SMALL_LLAMA)) + trained
    assert trained == sum(p.numel() for n, p in build_model(cfg).named_parameters() if is_adapter(n))
    ds = {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True}}
    for stage, dp, gradients in ((0, 1, 0), (1, 2, 2 * trained + 4 * trained / 2)):
        ds["zero_optimization"] = {"stage": stage, "contiguous_gradients": False}
        parts = plan(cfg, ds, dp)["parts"]
        assert (parts["weights"], parts["gradients"], parts["optimizer"]) == (2 * every, gradients, 12 * trained / dp)


def test_flops_count_the_frozen_weights_without_their_gradients():
    cfg = adapted(SMALL_LLAMA)
    adapters = sum(p.numel() for n, p in build_model(cfg).named_parameters() if is_adapter(n))
    scores = 12 * cfg.n_layer * cfg.q_width * cfg.block_size
    assert flops_per_token(cfg) == (flops_per_token(SMALL_LLAMA) - scores) * 4 / 6 + 6 * adapters + scores


@pytest.mark.parametrize("cfg", [SMALL_GPT, SMALL_LLAMA], ids=["gpt", "llama"])
def test_the_adapters_split_as_their_maps_from_the_same_draws(cfg):
    """At tp 2 each rank holds its slice of the adapters a one-rank model draws from the seed: a column-split map's
    B by rows (the GPT's fused q|k|v in its three blocks), a row-split map's A by columns, the other whole."""
    whole = dict(build_model(adapted(cfg), seed=3).named_parameters())
    for rank in (0, 1):
        tp = TensorParallel(2, rank)
        for name, p in build_model(adapted(cfg), seed=3, tp=tp).named_parameters():
            if is_adapter(name):
                assert torch.equal(p, shard_parameter(whole[name], split_rule(p), tp)), name
    rules = {n: split_rule(p) for n, p in build_model(adapted(cfg), tp=TensorParallel(2)).named_parameters()}
    assert rules["2.mlp." + ("fc" if cfg.arch == "gpt" else "up") + ".lora_b"] == COLUMN
    assert rules["2.attn." + ("proj" if cfg.arch == "gpt" else "o") + ".lora_a"] == ROW


def test_a_row_split_maps_ranks_drop_their_slices_of_one_processs_mask():
    """lora_dropout at tp 2: the tensor ranks of a replica draw from one generator state (train.py), and a row-split
    map's ranks, each holding a slice of the input, keep their slices of the mask one process draws for the whole."""
    cfg = adapted(SMALL_LLAMA, lora_dropout=0.5)
    whole = build_model(cfg).get_submodule("1.attn.o").train()
    x = torch.randn(2, 16, whole.in_features, generator=torch.Generator().manual_seed(0))
    torch.manual_seed(7)
    expected = whole._dropped(x)
    assert 0 < (expected == 0).float().mean().item() < 1 and (x != 0).all()
    for rank in (0, 1):
        split = build_model(cfg, tp=TensorParallel(2, rank)).get_submodule("1.attn.o").train()
        assert split.split == ROW
        start, stop = split.tp.shard(x.size(-1))
        torch.manual_seed(7)
        assert torch.equal(split._dropped(x[..., start:stop]), expected[..., start:stop])
        assert torch.equal(split.eval()._dropped(x[..., start:stop]), x[..., start:stop])


# A fine-tune with adapters from a transformers-built Llama, through train.py's ranks (launch: several processes).
CONTEXT = 64
FINETUNE = ["model.arch=llama", "model.n_layer=2", "model.n_head=4", "model.n_kv_head=2", "model.n_embd=32",
            "model.ffn_hidden=64", f"model.block_size={CONTEXT}", "model.document_masking=true",
            f"model.lora_rank={RANK}", "train.max_steps=4", "train.save_interval=2", "train.eval_interval=2",
            "train.eval_windows=8", "optim.warmup_steps=2", "optim.lr=3e-2", *FP32]
LAYOUTS = {  # name: (processes, ds_config, overrides); global batch 4
    "one": (1, "zero0.json", ["ds.train_micro_batch_size_per_gpu=4", "ds.gradient_accumulation_steps=1"]),
    "zero3_dp2": (2, "zero3.json", ["ds.train_micro_batch_size_per_gpu=2", "ds.gradient_accumulation_steps=1"]),
    "pp2": (2, "pipe2.json", ["ds.train_micro_batch_size_per_gpu=1", "ds.gradient_accumulation_steps=4"]),
    # with lora_dropout: one process drawing the masks of tp 2's micro-batches, whose tensor ranks draw alike
    "one_dropout": (1, "zero0.json", ["ds.train_micro_batch_size_per_gpu=2", "ds.gradient_accumulation_steps=2",
                                      "model.lora_dropout=0.1"]),
    "tp2_zero1": (2, "tp2.json", ["ds.train_micro_batch_size_per_gpu=2", "ds.gradient_accumulation_steps=2",
                                  "model.lora_dropout=0.1"]),
}
REFERENCE = {"tp2_zero1": "one_dropout"}  # else "one"
# Adam divides each element's step by the size of its own gradients: with masks, one element of A in 128 of two MLP
# maps ended 2.4e-5 apart (the others within 1e-6), its small gradient summed over the tensor ranks in another order.
WEIGHT_TOLERANCE = {"tp2_zero1": 1e-4}


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("lora_finetune")
    (folder / "tasks.jsonl").write_text("".join(json.dumps(t) + "\n" for t in reverse_tasks(300, seed=1)))
    prepare_chat([str(folder / "tasks.jsonl")], str(folder / "data"), "char", context=CONTEXT, val_fraction=0.1)
    vocab = json.loads((folder / "data" / "meta.json").read_text())["vocab_size"]
    shape = ModelConfig(arch="llama", n_layer=2, n_head=4, n_kv_head=2, n_embd=32, ffn_hidden=64,
                        block_size=CONTEXT, vocab_size=vocab)
    transformers_model(shape, folder / "llama")
    return folder


@pytest.fixture(scope="module")
def runs(tmp_path_factory, hf_folder):
    done = {}

    def get(name: str):
        if name not in done:
            procs, ds_config, overrides = LAYOUTS[name]
            out = tmp_path_factory.mktemp(name)
            launch(procs, ds_config, out, str(hf_folder / "data"),
                   [*FINETUNE, *overrides, f"train.init_from={hf_folder / 'llama'}"])
            done[name] = out
        return done[name]
    return get


@pytest.mark.launch
@pytest.mark.parametrize("layout", ["zero3_dp2", "pp2", "tp2_zero1"])
def test_adapters_train_on_every_layout_as_in_one_process(runs, layout):
    out, reference = runs(layout), runs(REFERENCE.get(layout, "one"))
    assert train_losses(out) == pytest.approx(train_losses(reference), abs=1e-5)
    assert grad_norms(out) == pytest.approx(grad_norms(reference), abs=1e-5)
    assert train_losses(reference)[-1] < train_losses(reference)[0] - 0.03  # the adapters alone really train
    if layout in REFERENCE:  # the masks count
        assert abs(train_losses(reference)[-1] - train_losses(runs("one"))[-1]) > 1e-3
    # what an export reads: the adapters from the optimizer's files, the frozen weights from the module's (ZeRO-3's
    # fragments of each rank, a pipeline's layer files)
    ours, theirs = (consolidated_state_dict(str(run / "checkpoints" / "step_000004")) for run in (out, reference))
    assert set(ours) == set(theirs)
    print(sorted(((ours[name] - theirs[name]).abs().max().item(), name) for name in ours)[-6:])
    assert max((ours[name] - theirs[name]).abs().max().item() for name in ours) <= WEIGHT_TOLERANCE.get(layout, 1e-5)


@pytest.mark.launch
def test_the_checkpoint_keeps_the_folders_weights_and_the_export_is_the_adapted_model(runs, hf_folder):
    """The checkpoint's weights bitwise the folder's, the adapters trained beside them; the export merges them, and
    transformers' forward of it, sample.py's model (merged on reading) and the adapted model agree."""
    out = runs("one")
    state = consolidated_state_dict(str(out / "checkpoints" / "step_000004"))
    folder = str(hf_folder / "llama")
    run_cfg = load_trained(str(out))[0]
    assert run_cfg.lora_rank == 0  # read merged
    cfg = adapted(dataclasses.replace(run_cfg, block_size=CONTEXT))
    base = from_hf({k: v for path in set(weight_files(folder).values()) for k, v in load_file(path).items()}, cfg)
    assert set(state) - set(base) == {n for n in state if is_adapter(n)}
    assert all(torch.equal(state[name], base[name]) for name in base)
    assert all(state[name].abs().max() > 0 for name in state if name.endswith("lora_b"))
    lora = build_model(cfg)
    lora.load_state_dict(state)
    idx = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    expected = lora.eval()(idx)[..., : cfg.vocab_size]
    exported = load_in_transformers(export(out, "step_000004"))
    assert (exported(idx).logits - expected).abs().max().item() <= 1e-5
    sampled = load_trained(str(out))[1].eval()(idx)[..., : cfg.vocab_size]
    assert (sampled - expected).abs().max().item() <= 1e-5
    assert (build_model(run_cfg).eval()(idx)[..., : cfg.vocab_size] - expected).abs().max().item() > 1e-3


RESUMED = {  # the run whose step 2 resumes through the universal format, and the layout it resumes at
    "tp2-to-one": ("tp2_zero1", 1, "zero1.json", ["ds.train_micro_batch_size_per_gpu=2",
                                                  "ds.gradient_accumulation_steps=2", "model.lora_dropout=0.1"]),
    "one-to-tp2": ("one", 2, "tp2.json", ["ds.train_micro_batch_size_per_gpu=2", "ds.gradient_accumulation_steps=2"]),
    # a pipeline's frozen weights, from its stages' layer files
    "pp2-to-one": ("pp2", 1, "zero1.json", ["ds.train_micro_batch_size_per_gpu=4", "ds.gradient_accumulation_steps=1"]),
    # ZeRO-3's frozen weights, partitioned, written whole through DeepSpeed's gather
    "zero3-dp2-to-one": ("zero3_dp2", 1, "zero3.json", ["ds.train_micro_batch_size_per_gpu=4",
                                                        "ds.gradient_accumulation_steps=1"]),
}


@pytest.mark.launch
@pytest.mark.parametrize("case", RESUMED)
def test_a_lora_run_resumes_on_another_layout_through_the_universal_format(runs, hf_folder, tmp_path, case):
    """The universal format holds what the optimizer holds, the adapters: the converter writes the frozen weights
    beside them, whole, and the resuming run (without train.init_from) reads them, cut for its tensor ranks. Steps 3
    and 4 as the uninterrupted run's (1e-5); the frozen weights of its last checkpoint, and of the universal one,
    bitwise the folder's."""
    source, procs, ds_config, overrides = RESUMED[case]
    run_dir = runs(source)
    converted = universal(run_dir, "step_000002")
    launch(procs, ds_config, tmp_path, str(hf_folder / "data"), [*FINETUNE, *overrides, f"train.resume={converted}"])
    steps, uninterrupted = ([m for m in metrics(out) if "loss" in m] for out in (tmp_path, run_dir))
    assert [m["step"] for m in steps] == [3, 4]
    for key in ("loss", "grad_norm"):
        assert [m[key] for m in steps] == pytest.approx([m[key] for m in uninterrupted[2:]], abs=1e-5)
    folder = consolidated_state_dict(str(run_dir / "checkpoints" / "step_000002"))
    for checkpoint_dir in (converted, str(tmp_path / "checkpoints" / "step_000004")):
        state = consolidated_state_dict(checkpoint_dir)
        assert set(state) == set(folder)
        assert [name for name in folder if not is_adapter(name) and not torch.equal(state[name], folder[name])] == []


def test_a_lora_run_over_experts_is_not_converted():
    """Its frozen experts are neither in the optimizer nor in the module's files the experts' converter reads."""
    from training.checkpoints import universal

    saved = {"layout": {"pp": 1, "tp": 1, "zero_stage": 1},
             "config": {"model": {"lora_rank": RANK, "n_experts": 4, "arch": "llama"}}}
    assert universal.unconvertible("out/checkpoints/step_000002", saved) == (
        "out/checkpoints/step_000002 is a LoRA run's checkpoint over a mixture of experts, whose frozen experts the "
        "experts' converter does not read. Resume it on its own layout (pp=1, tp=1, ZeRO-1), or start a new run from "
        "its weights, the adapters merged: python -m scripts.export --out_dir out --tag step_000002, then "
        "train.init_from=out/export/step_000002")
