"""Fine-tuning a transformers-built Llama on conversations through the real launcher, fp32: the loss is the mean over
the global batch's supervised tokens (checked against transformers on each conversation alone), the same for
one process, accumulation, data parallelism, ZeRO-3, pipeline stages and tensor parallelism; a stopped run
resumes exactly; the export answers in transformers as sample.py --chat does. And the README's example, smaller: the
reverse task, prepared with a pretrained Llama's own characters, fine-tuned from its export, answers its held-out
prompt; conversations of other characters are refused by the export."""
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from chats import chatml_folder, reverse_tasks, write_jsonl
from data.conversations import ChatData
from data.prepare_chat import prepare_chat
from data.token_data import IGNORE
from harness import FP32, export, grad_norms, launch, metrics, sample_py, train_losses, train_py
from hf_check import transformers_model
from model.config import ModelConfig
from refusals import assert_refused_at_start
from training.topology import Layout

# The launch marker test by test (python -m pytest -m "not launch" skips those: several train.py processes, or long
# runs): the supervised-token mean, one process of 4 steps, is in the inner loop too. The README's example trains twice
# (pretraining, fine-tuning): launch.

CONTEXT = 64
# The reverse tasks' answers hold 1 to 8 words: windows hold very different numbers of supervised tokens.
FINETUNE = ["model.arch=llama", "model.n_layer=2", "model.n_head=4", "model.n_kv_head=2", "model.n_embd=32",
            "model.ffn_hidden=64", f"model.block_size={CONTEXT}", "model.document_masking=true", "train.max_steps=4",
            "train.save_interval=2", "train.eval_interval=2", "train.eval_windows=8", "optim.warmup_steps=2",
            "optim.lr=3e-3", *FP32]
LAYOUTS = {  # name: (processes, ds_config, overrides); global batch 4
    "one": (1, "zero0.json", ["ds.train_micro_batch_size_per_gpu=4", "ds.gradient_accumulation_steps=1"]),
    "accum4": (1, "zero0.json", ["ds.train_micro_batch_size_per_gpu=1", "ds.gradient_accumulation_steps=4"]),
    "dp2_accum2": (2, "zero0.json", ["ds.train_micro_batch_size_per_gpu=1", "ds.gradient_accumulation_steps=2"]),
    "zero3_dp2": (2, "zero3.json", ["ds.train_micro_batch_size_per_gpu=2", "ds.gradient_accumulation_steps=1"]),
    "pp2": (2, "pipe2.json", ["ds.train_micro_batch_size_per_gpu=1", "ds.gradient_accumulation_steps=4"]),
    "tp2_zero1": (2, "tp2.json", ["ds.train_micro_batch_size_per_gpu=2", "ds.gradient_accumulation_steps=2"]),
}


@pytest.fixture(scope="module")
def chat_data(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("reverse_finetune")
    (folder / "tasks.jsonl").write_text("".join(json.dumps(t) + "\n" for t in reverse_tasks(300, seed=1)))
    prepare_chat([str(folder / "tasks.jsonl")], str(folder / "data"), "char", context=CONTEXT, val_fraction=0.1)
    return str(folder / "data")


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory, chat_data):
    vocab = json.loads(open(f"{chat_data}/meta.json").read())["vocab_size"]
    shape = ModelConfig(arch="llama", n_layer=2, n_head=4, n_kv_head=2, n_embd=32, ffn_hidden=64,
                        block_size=CONTEXT, vocab_size=vocab)
    folder = tmp_path_factory.mktemp("transformers_llama")
    transformers_model(shape, folder)
    return folder


@pytest.fixture(scope="module")
def runs(tmp_path_factory, chat_data, hf_folder):
    done = {}

    def get(name: str):
        if name not in done:
            procs, ds_config, overrides = LAYOUTS[name]
            out = tmp_path_factory.mktemp(name)
            launch(procs, ds_config, out, chat_data, [*FINETUNE, *overrides, f"train.init_from={hf_folder}"])
            done[name] = out
        return done[name]
    return get


def step_micro_batches(chat_data: str, step: int) -> list[list[tuple[list[int], list[int]]]]:
    """(inputs, targets) of each conversation in each micro-batch of `step` under "accum4" (4 micro-batches of one
    window: the global batch of every layout), cut at the positions."""
    data = ChatData(chat_data, None, CONTEXT, document_masking=True, pack=True)
    micro_batches = []
    for inputs, targets in data.step_batches(1337, step, 0, Layout(1, 1, 1, 4), torch.device("cpu")):
        found = []
        for tokens, positions, row in zip(*inputs, targets):
            starts = [t for t in range(CONTEXT) if positions[t] == 0] + [CONTEXT]
            for a, b in zip(starts, starts[1:]):
                if (row[a:b] != IGNORE).any():
                    found.append((tokens[a:b].tolist(), row[a:b].tolist()))
        micro_batches.append(found)
    return micro_batches


def test_the_loss_is_the_mean_over_the_global_batchs_supervised_tokens(runs, chat_data, hf_folder):
    """Step 1's loss (before any update) under accumulation 4 against transformers' model run on each conversation
    alone: the micro-batches hold different numbers of supervised tokens, so the mean of each micro-batch's mean
    is another number. The repo's vocabulary is padded to a multiple of 64, and an import gives the padding rows
    zeros: logits of 0 there."""
    import transformers

    model = transformers.LlamaForCausalLM.from_pretrained(hf_folder, torch_dtype=torch.float32).eval()
    padding = 64 - model.config.vocab_size % 64
    sums, counts = [], []  # per micro-batch
    with torch.no_grad():
        for conversations in step_micro_batches(chat_data, 1):
            sums.append(0.0)
            counts.append(0)
            for tokens, targets in conversations:
                logits = torch.nn.functional.pad(model(torch.tensor([tokens])).logits[0], (0, padding))
                sums[-1] += torch.nn.functional.cross_entropy(logits, torch.tensor(targets), ignore_index=IGNORE,
                                                              reduction="sum").item()
                counts[-1] += sum(t != IGNORE for t in targets)
    mean = sum(sums) / sum(counts)
    per_micro_batch = sum(s / n for s, n in zip(sums, counts)) / len(counts)
    assert len(counts) == 4 and sum(counts) > 20 and len(set(counts)) > 1
    assert abs(per_micro_batch - mean) > 1e-3  # the two rules tell apart here
    assert train_losses(runs("accum4"))[0] == pytest.approx(mean, abs=1e-5)


@pytest.mark.launch
@pytest.mark.parametrize("layout", ["accum4", "dp2_accum2", "zero3_dp2", "pp2", "tp2_zero1"])
def test_every_layout_fine_tunes_as_one_process_does(runs, layout):
    out, reference = runs(layout), runs("one")
    assert len(train_losses(out)) == 4
    assert train_losses(out) == pytest.approx(train_losses(reference), abs=1e-5)
    assert grad_norms(out) == pytest.approx(grad_norms(reference), abs=1e-5)
    assert train_losses(reference)[-1] < train_losses(reference)[0] - 0.1  # it really trains
    val = [[m["val_loss"] for m in metrics(run) if "val_loss" in m] for run in (out, reference)]
    assert val[0] == pytest.approx(val[1], abs=1e-5)


@pytest.mark.launch
def test_a_stopped_fine_tune_resumes_exactly(runs, tmp_path, chat_data, hf_folder):
    procs, ds_config, overrides = LAYOUTS["dp2_accum2"]
    args = [*FINETUNE, *overrides, f"train.init_from={hf_folder}"]
    launch(procs, ds_config, tmp_path, chat_data, [*args, "train.stop_at_step=2"])
    resumed = launch(procs, ds_config, tmp_path, chat_data, args)
    assert "at step 2" in resumed.stdout
    steps = [(m["step"], m["loss"], m["grad_norm"]) for m in metrics(tmp_path) if "loss" in m]
    assert steps == [(m["step"], m["loss"], m["grad_norm"]) for m in metrics(runs("dp2_accum2")) if "loss" in m]


@pytest.mark.launch
def test_epochs_set_the_steps_from_the_data(runs, tmp_path, chat_data, hf_folder):
    procs, ds_config, overrides = LAYOUTS["one"]
    launch(procs, ds_config, tmp_path, chat_data, [*FINETUNE, *overrides, f"train.init_from={hf_folder}",
                                                   "train.epochs=0.5"])
    windows = ChatData(chat_data, None, CONTEXT, document_masking=True, pack=True).train_windows
    assert [m["step"] for m in metrics(tmp_path) if "loss" in m][-1] == int(np.ceil(0.5 * windows / 4))


@pytest.fixture(scope="module")
def chatml_export(tmp_path_factory, shakespeare_path):
    """A Llama fine-tuned from scratch on the reverse tasks in ChatML (a tokenizer.json with its chat template),
    exported."""
    folder = tmp_path_factory.mktemp("chatml_run")
    chatml_folder(folder, shakespeare_path)
    tasks = write_jsonl(folder / "tasks.jsonl", reverse_tasks(300, seed=2))
    prepare_chat([tasks], str(folder / "data"), str(folder / "tokenizer.json"), context=CONTEXT, val_fraction=0.1)
    procs, ds_config, overrides = LAYOUTS["one"]
    launch(procs, ds_config, folder / "run", str(folder / "data"),
           [*FINETUNE, *overrides, "train.max_steps=60", "train.save_interval=60", "train.eval_interval=60"])
    return export(folder / "run", "step_000060")


@pytest.mark.launch
def test_the_export_answers_in_transformers_as_sample_chat_does(chatml_export):
    """The export carries the chat template and the end-of-turn token: transformers' apply_chat_template and greedy
    generate give the answer `sample.py --chat` gives."""
    import transformers

    message = "Reverse: king crown night"
    ours = sample_py(["--export", chatml_export, "--chat", message, "--temperature", "0",
                      "--max_new_tokens", "24"]).stdout.rstrip("\n")
    tokenizer = transformers.AutoTokenizer.from_pretrained(chatml_export)
    model = transformers.LlamaForCausalLM.from_pretrained(chatml_export, torch_dtype=torch.float32).eval()
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": message}], add_generation_prompt=True,
                                           return_tensors="pt", return_dict=True)
    out = model.generate(**prompt, max_new_tokens=24, do_sample=False)[0, prompt["input_ids"].size(1):].tolist()
    if out and out[-1] == tokenizer.eos_token_id:
        out = out[:-1]
    assert tokenizer.eos_token == "<|im_end|>" and model.generation_config.eos_token_id == tokenizer.eos_token_id
    assert ours == tokenizer.decode(out) and ours  # an answer, the same text


# The README's fine-tuning example at a small size: a Llama of the quickstart's kind (its block_size, its characters),
# narrower and pretrained for 100 steps; the fine-tuning at a higher learning rate for as many steps as it takes such
# a model to answer the README's prompt (the default seed answers it, on one thread or two; of seeds 1-4, all but 3).
EXAMPLE_LLAMA = ["model.n_layer=2", "model.n_embd=64", "model.ffn_hidden=192", "train.eval_interval=0",
                 "train.eval_windows=8", "optim.warmup_steps=10", *FP32]
EXAMPLE_PROMPT = "Reverse: king crown night"


@pytest.fixture(scope="module")
def example_task(tmp_path_factory) -> Path:
    """`python -m data.reverse_task`, smaller: train.jsonl and test.jsonl."""
    from data import reverse_task

    task = tmp_path_factory.mktemp("reverse_task")
    reverse_task.main(["--out_dir", str(task), "--train", "600", "--test", "20"])
    return task


@pytest.fixture(scope="module")
def example_export(tmp_path_factory, char_data) -> Path:
    """The quickstart Llama, smaller and shorter (`python train.py --config configs/llama_quickstart.yaml`), exported
    (`python -m scripts.export`)."""
    import scripts.export

    out = tmp_path_factory.mktemp("out")
    train_py(["--config", "configs/llama_quickstart.yaml", f"data.dir={char_data}", f"train.out_dir={out / 'llama'}",
              "train.max_steps=100", "optim.lr=3e-3", *EXAMPLE_LLAMA])
    scripts.export.main(["--out_dir", str(out / "llama"), "--output", str(out / "llama_export")])
    return out / "llama_export"


@pytest.fixture(scope="module")
def example_sft(tmp_path_factory, char_data, example_task, example_export) -> dict:
    """The README's fine-tuning commands as typed, in this process but for train.py (forked from the rank server):
    the task's conversations prepared with the pretrained export's own tokenizer, and the fine-tuning preset from
    the export."""
    from data import prepare

    folder = tmp_path_factory.mktemp("example_sft")
    data = folder / "reverse"
    prepare.main(["--format", "chat", "--input", str(example_task / "train.jsonl"), "--tokenizer", str(example_export),
                  "--context", "64", "--out_dir", str(data)])
    sft = folder / "llama_quickstart_sft"
    proc = train_py(["--config", "configs/llama_quickstart_sft.yaml", f"train.init_from={example_export}",
                     f"data.dir={data}", f"train.out_dir={sft}", "train.epochs=null", "train.max_steps=600",
                     "optim.lr=3e-3", *EXAMPLE_LLAMA])
    return {"data": data, "run": sft, "stdout": proc.stdout}


@pytest.mark.launch
def test_the_readme_example_answers_from_the_pretrained_llama(char_data, example_task, example_export, example_sft,
                                                              capsys):
    """The README's path: the task; its conversations prepared with the pretrained export's own tokenizer (the
    quickstart's characters: the template lines, the newline ending each answer); the fine-tuning preset from the
    export; and sample.py --chat answering the held-out prompt through the template, up to the end of turn."""
    import sample

    assert EXAMPLE_PROMPT not in (example_task / "train.jsonl").read_text()  # held out
    meta, pretraining = (json.loads((path / "meta.json").read_text()) for path in (example_sft["data"],
                                                                                   Path(char_data)))
    assert meta["tokenizer_fingerprint"] == pretraining["tokenizer_fingerprint"]  # the pretrained model's ids
    assert (meta["chat"]["template"], meta["chat"]["end_of_turn"]) == ("lines", "\n")
    sft = example_sft["run"]
    assert f"initialized from {example_export}" in example_sft["stdout"]
    # the run's own last sample, the preset's sample.chat: the template's prompt, the answer to its end of turn
    assert f"--- sample ---\nUser: {EXAMPLE_PROMPT}\nAssistant: night crown king\n\n--------------" in \
        example_sft["stdout"]
    first = next(m for m in metrics(sft) if "val_loss" in m)  # before any update: the pretrained weights' loss
    assert first["step"] == 0 and first["val_loss"] < 3.6  # from scratch: 4.8, about ln 128 (the padded vocabulary)
    capsys.readouterr()
    sample.main(["--out_dir", str(sft), "--chat", EXAMPLE_PROMPT])
    assert capsys.readouterr().out == "night crown king\n"  # the answer, stopped at the end of turn


@pytest.mark.launch
def test_the_documented_dpo_path_goes_on_from_the_fine_tuned_model(tmp_path, example_task, example_sft, capsys):
    """docs/preference.md's commands after fine-tuning: the fine-tuned run exported, the task's pairs prepared with
    that export, the DPO preset from it (the reference scored first), sample.py --chat and the export."""
    import sample
    import scripts.export
    from data import prepare

    sft_export = tmp_path / "llama_quickstart_sft_export"
    scripts.export.main(["--out_dir", str(example_sft["run"]), "--output", str(sft_export)])
    pairs = tmp_path / "reverse_pairs"
    prepare.main(["--format", "preference", "--input", str(example_task / "pairs.jsonl"), "--tokenizer",
                  str(sft_export), "--context", "64", "--out_dir", str(pairs)])
    dpo = tmp_path / "llama_quickstart_dpo"
    proc = train_py(["--config", "configs/llama_quickstart_dpo.yaml", f"train.init_from={sft_export}",
                     f"data.dir={pairs}", f"train.out_dir={dpo}", "train.epochs=null", "train.max_steps=30",
                     "train.eval_interval=30", *EXAMPLE_LLAMA])
    assert "reference log-probabilities of" in proc.stdout and "scored and written to" in proc.stdout
    evaluations = [m for m in metrics(dpo) if "val_rewards_accuracy" in m]
    assert evaluations[0]["val_rewards_margin"] == 0 and evaluations[0]["step"] == 0  # the policy is its reference
    assert evaluations[-1]["val_rewards_accuracy"] >= 0.7 and evaluations[-1]["val_loss"] < evaluations[0]["val_loss"]
    capsys.readouterr()
    sample.main(["--out_dir", str(dpo), "--chat", EXAMPLE_PROMPT])
    assert capsys.readouterr().out == "night crown king\n"
    scripts.export.main(["--out_dir", str(dpo), "--output", str(tmp_path / "dpo_export")])
    template = json.loads((tmp_path / "dpo_export" / "tokenizer_config.json").read_text())["chat_template"]
    assert template == json.loads((sft_export / "tokenizer_config.json").read_text())["chat_template"]


@pytest.mark.launch
def test_conversations_of_their_own_characters_are_refused_by_the_export(tmp_path, example_task, example_export):
    """Prepared with the default --tokenizer char (the conversations' 27 characters and an end-of-text), not the
    export's: train.init_from refuses at start, naming the fix."""
    from data import prepare

    prepare.main(["--format", "chat", "--input", str(example_task / "train.jsonl"), "--context", "64", "--out_dir",
                  str(tmp_path / "own")])
    proc = train_py(["--config", "configs/llama_quickstart_sft.yaml", f"train.init_from={example_export}",
                     f"data.dir={tmp_path / 'own'}", f"train.out_dir={tmp_path / 'run'}", *EXAMPLE_LLAMA], check=False)
    assert_refused_at_start(proc, f"error: train.init_from={example_export}: its tokenizer holds 65 ids, the "
                                  f"dataset's 28: the dataset was prepared with another tokenizer; fix: prepare it "
                                  f"with the folder's (python -m data.prepare ... --tokenizer {example_export})\n")
