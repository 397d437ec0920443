"""Online RL end to end: prompts prepared with their records, GRPO runs of a tiny Llama from an export with real
rollouts: the same seed gives the same run, a stopped run resumes exactly, and the figures count what was sampled;
the refusals at start, each in one line."""
import json
import os

import pytest
import torch

from chats import CHATML, WORDS, chatml_folder, write_jsonl
from harness import FP32, TINY, launch, metrics, tool
from hf_check import transformers_model
from model.config import ModelConfig

pytestmark = pytest.mark.launch

SHAPE = ModelConfig(arch="llama", n_layer=2, n_head=2, n_kv_head=2, n_embd=32, ffn_hidden=64, block_size=64,
                    vocab_size=500)
GRPO = [*TINY, "model.arch=llama", "model.n_kv_head=2", "model.ffn_hidden=64", "model.block_size=64",
        "model.vocab_size=500", "model.dropout=0", *FP32, "train.objective=grpo", "optim.lr=3e-3",
        "optim.warmup_steps=1", "train.max_steps=3", "train.eval_windows=4", "rl.group_size=4",
        "rl.max_new_tokens=8", "rl.reward=rl_rewards:length", "ds.train_micro_batch_size_per_gpu=8",
        "ds.gradient_accumulation_steps=2", "sample.max_new_tokens=0"]
FIGURES = ("loss", "grad_norm", "reward", "reward_std", "answer_tokens", "truncated", "mismatch")


def reverse_prompts(count: int) -> list[dict]:
    records = []
    for i in range(count):
        words = [WORDS[(i * 3 + k * 7) % len(WORDS)] for k in range(2 + i % 2)]
        records.append({"prompt": [{"role": "user", "content": "Reverse: " + " ".join(words)}],
                        "answer": " ".join(reversed(words)), "id": i})
    return records


@pytest.fixture(scope="module")
def setup(tmp_path_factory, shakespeare_path):
    root = tmp_path_factory.mktemp("rl")
    (root / "tokenizer").mkdir()
    tokenizer = chatml_folder(root / "tokenizer", shakespeare_path)
    transformers_model(SHAPE, root / "policy", seed=7)
    inputs = write_jsonl(root / "prompts.jsonl", reverse_prompts(40))
    from data.prepare import main as prepare
    tool(prepare, ["--format", "prompts", "--input", inputs, "--tokenizer", str(tokenizer), "--context", "48",
                   "--val_fraction", "0.2", "--out_dir", str(root / "prompts")])
    return {"root": root, "data": str(root / "prompts"), "policy": str(root / "policy"), "tokenizer": tokenizer}


def test_prompts_are_kept_with_their_records_in_the_order_of_their_ids(setup):
    data = setup["data"]
    meta = json.loads(open(os.path.join(data, "meta.json")).read())
    record = meta["prompts"]
    assert (record["format"], record["train_prompts"] + record["val_prompts"]) == ("messages", 40)
    assert meta["chat"]["end_of_turn"] == "<|im_end|>"
    from data.chat_template import ChatTemplate
    from data.prompt_data import PromptData
    prompts, template = PromptData(data, None, 64), ChatTemplate(CHATML)
    tok = prompts.tokenizer()
    for split in ("train", "val"):
        ids, records = prompts.eval_prompts(split, 100)
        assert len(ids) == record[f"{split}_prompts"]
        for prompt_ids, kept in zip(ids, records):
            rendered = template.render(kept["record"]["prompt"], add_generation_prompt=True)[0]
            assert rendered.endswith(f"{kept['record']['prompt'][0]['content']}<|im_end|><|im_start|>assistant\n")
            assert prompt_ids == tok.encode_with_offsets(rendered)[0]
            assert kept["where"].endswith(f"prompts.jsonl:{kept['record']['id'] + 1}")
    assert max(len(i) for s in ("train", "val") for i in prompts.eval_prompts(s, 100)[0]) == record["longest"]


@pytest.mark.parametrize("record, problem", [
    ({"text": "x"}, "prompts.jsonl:2: no \"prompt\" in it (found keys ['text'])"),
    ({"prompt": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]},
     "prompts.jsonl:2: the prompt ends with the assistant's turn"),
    ({"prompt": "plain text"}, "prompts.jsonl:2: a prompt of text in a file of prompts of messages"),
])
def test_a_bad_prompt_record_is_refused_with_its_line(setup, tmp_path, capsys, record, problem):
    inputs = write_jsonl(tmp_path / "prompts.jsonl", [reverse_prompts(1)[0], record])
    from data.prepare import main as prepare
    with pytest.raises(SystemExit) as e:
        prepare(["--format", "prompts", "--input", inputs, "--tokenizer", str(setup["tokenizer"]), "--out_dir",
                 str(tmp_path / "out")])
    assert e.value.code == 2
    assert problem in capsys.readouterr().err
    assert not (tmp_path / "out" / "meta.json").exists()


def grpo(setup, name: str, extra=(), nprocs: int = 1, ds_config: str = "zero0.json", env=None):
    out = setup["root"] / name
    launch(nprocs, ds_config, out, setup["data"], [*GRPO, f"train.init_from={setup['policy']}", *extra],
           env={"PYTHONPATH": os.path.dirname(__file__), **(env or {})})
    return out


def steps(out) -> dict:
    return {m["step"]: m for m in metrics(out) if "loss" in m}


CHECKED = {"MEGALITE_RL_CHECK": "1"}  # tests/rl_check.py checks each step's rows from outside the objective


def test_a_checked_run_is_its_seeds_and_resumes_exactly(setup):
    """GRPO with rollouts trained twice (rl.epochs=2): the same seed gives the same run, a run stopped at step 2
    resumes exactly, and tests/rl_check.py finds every row of every step its prompt and its answer alone in the
    loss, with its group's advantage, and at each sampling step the rollouts' log-probabilities the model's before
    the step."""
    twice = ["rl.epochs=2", "train.max_steps=4", "train.save_interval=2"]
    whole = steps(grpo(setup, "whole", twice, env=CHECKED))
    stopped = grpo(setup, "stopped", [*twice, "train.stop_at_step=2"], env=CHECKED)
    grpo(setup, "stopped", [*twice, "train.resume=auto"], env=CHECKED)
    resumed = steps(stopped)
    assert sorted(whole) == sorted(resumed) == [1, 2, 3, 4]
    for step in (1, 2, 3, 4):  # steps 1-2: the same seed; steps 3-4: after the resume
        assert {k: whole[step][k] for k in FIGURES} == {k: resumed[step][k] for k in FIGURES}, step
    first = whole[1]
    # 4 prompts a step (16 answers: 2 micro-batches of 8 rows, 4 answers a prompt), each answer 1 to 8 tokens
    assert 1 <= first["answer_tokens"] <= 8 and first["grad_norm"] > 0
    assert first["reward"] > 0 and first["reward_std"] > 0  # the graded reward, the answer's characters / 10
    assert first["mismatch"] < 1e-5  # the sampler's log-probabilities and the training forward's
    assert 0 <= first["rollout_s"] and first["no_signal_groups"] == 0
    # a sampling step trains on the policy that sampled (ratio 1); the second step on a batch sees it moved
    clipped = [whole[s]["clipped"] for s in (1, 2, 3, 4)]
    assert clipped[0] == clipped[2] == 0 and clipped[1] + clipped[3] > 0


def test_layouts_sample_and_train_alike(setup):
    """Each prompt's answers are drawn from its own generator, seeded by its place in the run: ranks that split
    the prompts sample what one process samples, and train the same step (RLOO, its rows checked in one process)."""
    rloo = ["train.objective=rloo", "ds.train_micro_batch_size_per_gpu=4"]
    one = steps(grpo(setup, "one", [*rloo, "ds.gradient_accumulation_steps=4"], env=CHECKED))
    for name, nprocs, config, extra in [("dp2", 2, "zero0.json", []), ("zero3", 2, "zero3.json", []),
                                        ("tp2", 2, "tp2.json", ["ds.gradient_accumulation_steps=4"])]:
        other = steps(grpo(setup, name, [*rloo, *extra], nprocs, config))
        for step in (1, 2, 3):
            for k in FIGURES:
                assert other[step][k] == pytest.approx(one[step][k], rel=1e-5, abs=1e-6), (name, step, k)


def test_adapters_sample_and_train_with_every_row_checked(setup):
    """GRPO with LoRA's adapters (model.lora_rank): the sampler's key/value cache runs through the adapted maps (the
    rollouts' log-probabilities are the training forward's), tests/rl_check.py finds every row as it should be, and
    the folder's weights stay as they were while the adapters learn."""
    from safetensors.torch import load_file

    from model.lora import is_adapter
    from training.checkpoints.export import consolidated_state_dict
    from training.checkpoints.hf import from_hf

    out = grpo(setup, "lora", ["model.lora_rank=4", "optim.lr=3e-2"], env=CHECKED)
    figures = steps(out)
    assert sorted(figures) == [1, 2, 3]
    assert all(figures[s]["mismatch"] < 1e-5 for s in (1, 2, 3)) and figures[1]["grad_norm"] > 0
    state = consolidated_state_dict(str(out / "checkpoints" / "step_000003"))
    base = from_hf(load_file(os.path.join(setup["policy"], "model.safetensors")), SHAPE)
    assert all(torch.equal(state[name], base[name]) for name in base)
    assert all(state[name].abs().max() > 0 for name in state if name.endswith("lora_b") and is_adapter(name))


def test_a_reward_model_rewards_as_its_score_of_prompt_and_answer(setup):
    """rl.reward_model=EXPORT trains exactly as a reward function that scores each answer with that model by hand
    (load_reward_model's encode and score, tests/rl_rewards.py model_score)."""
    import dataclasses

    from model_checks import decisive_model
    from training.checkpoints.export import write_export
    meta = json.loads(open(os.path.join(setup["data"], "meta.json")).read())
    cfg = dataclasses.replace(SHAPE, head="score")
    folder = write_export(str(setup["root"] / "reward_export"), cfg, decisive_model(cfg, seed=5).state_dict(), meta, 0,
                          data_dir=setup["data"])
    one = ["train.max_steps=2", "train.eval_windows=2"]
    by_model = steps(grpo(setup, "by_model", [f"rl.reward_model={folder}", *one]))
    by_hand = steps(grpo(setup, "by_hand", ["rl.reward=rl_rewards:model_score", *one],
                         env={"RL_REWARD_MODEL": folder}))
    for step in (1, 2):
        assert {k: by_model[step][k] for k in FIGURES} == pytest.approx({k: by_hand[step][k] for k in FIGURES},
                                                                         rel=1e-6, abs=1e-7)
    assert by_model[1]["reward_std"] > 0 and by_model[1]["grad_norm"] > 0


def test_what_an_rl_run_refuses_at_start(setup, char_data, monkeypatch):
    """Each refusal one line with its fix, before any process group: the layouts rollouts cannot run on, groups a
    micro-batch cannot hold, answers the context cannot hold, no model to start from, and rewards that fail on the
    first prompt."""
    from common.checks import ConfigError
    from data.loader import open_data
    from data.prompt_data import PromptData
    from training.config import DEFAULT_CONFIG, load_run_config
    from training.objectives import choose_objective
    from training.topology import Layout

    monkeypatch.syspath_prepend(os.path.dirname(__file__))  # rl_rewards, as the ranks import it
    data, policy, layout = PromptData(setup["data"], None, 64), setup["policy"], Layout(1, 1, 8, 2)
    longest = data.longest
    rows = [
        ([], Layout(2, 2, 8, 1), None,
         "train.objective=grpo samples answers on every rank through a key/value cache, which pipeline stages cannot "
         "(each holds a part of the model or of the sequence); fix: a ds_config without them"),
        ([], Layout(2, 1, 8, 1, sp_size=2), None, "which sequence-parallel ranks cannot"),
        ([], Layout(2, 1, 8, 1, tp_size=2, tp_sequence=True), None,
         "which tensor ranks that split the sequence (tensor_sequence_parallel) cannot"),
        (["rl.group_size=3"], layout, None, "train_micro_batch_size_per_gpu=8 rows does not hold whole groups of "
                                            "rl.group_size=3 answers"),
        ([f"rl.max_new_tokens={65 - longest}"], layout, None,
         f"the longest prompt of {setup['data']} ({longest} tokens) and rl.max_new_tokens={65 - longest} exceed "
         f"model.block_size=64; fix: lower rl.max_new_tokens to {64 - longest}"),
        (["train.init_from=null"], layout, None, "train.objective=grpo samples answers from the model it trains: start "
                                                 "it from a fine-tuned one; fix: set train.init_from"),
        (["rl.epochs=2", "train.save_interval=3"], layout, None,
         "train.save_interval=3 is not a multiple of rl.epochs=2"),
        (["rl.reward=no_such_module:score"], layout, None,
         "rl.reward=no_such_module:score: module no_such_module does not import"),
        (["rl.reward=rl_rewards:nothing"], layout, None, "rl.reward=rl_rewards:nothing: module rl_rewards has no "
                                                         "nothing; fix: name a function it defines"),
        (["rl.reward=rl_rewards:raises"], layout, None,
         f"rl.reward=rl_rewards:raises raised KeyError: '' on the prompt {setup['root'] / 'prompts.jsonl'}:"),
        (["rl.reward=rl_rewards:text"], layout, None, "rl.reward=rl_rewards:text returned 'high' on the prompt "),
        ([f"data.dir={char_data}"], layout, open_data(char_data, None, 64), f"train.objective=grpo samples answers "
                                                                             f"to prompts, but "
                                                     f"{char_data} holds text; fix: prepare prompts"),
    ]
    for overrides, row_layout, dataset, message in rows:
        cfg = load_run_config(DEFAULT_CONFIG, [f"data.dir={setup['data']}", "model.block_size=64",
                                               f"train.init_from={policy}", "train.objective=grpo", "rl.group_size=4",
                                               "rl.max_new_tokens=8", *overrides])
        with pytest.raises(ConfigError) as refused:
            choose_objective(cfg, dataset or data, row_layout, cfg.train.init_from, None)
        assert message in str(refused.value), (overrides, str(refused.value))
        assert "\n" not in str(refused.value)


def test_a_refusal_ends_train_py_in_one_line(setup, tmp_path):
    from refusals import assert_one_error_line, assert_refused_at_start, train_py_as_typed
    proc = train_py_as_typed(f"data.dir={setup['data']}", f"train.out_dir={tmp_path}", *GRPO,
                             f"train.init_from={setup['policy']}", "rl.group_size=3")
    assert_refused_at_start(proc, "rl.group_size=3 answers")
    assert_one_error_line(proc.stderr, "train_micro_batch_size_per_gpu=8 rows does not hold whole groups ... fix: a "
                                       "micro-batch that is a multiple of rl.group_size$", {})
