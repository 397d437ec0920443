"""A Hugging Face model's folder that this repo did not write, served, sampled and scored where an export is
(`--export`): the model its config.json describes, checked by transformers' own logits for every class; its
tokenizer and chat template as transformers renders them, the answer stopping at the token that ends a turn; the
server's greedy answer transformers' generate; and folders it cannot compute refused in one line."""
import dataclasses
import json
import shutil
import subprocess
import sys

import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file

from common.checks import ConfigError
from harness import REPO
from hub_folders import ENDS, IM_END, LLAMA, PADDING, QWEN3_TIED, decisive_qwen3, hub_folder, hub_tokenizer
from model.config import ModelConfig
from model.registry import read_settings
from servers import Server
from training.checkpoints.export import load_trained
from training.checkpoints.hf_folder import folder_model

MOE = dataclasses.replace(LLAMA, n_head=2, n_kv_head=2, n_experts=4, expert_hidden=48)
CLASSES = {"gpt2": ModelConfig(n_layer=2, n_head=2, n_embd=32, block_size=32, vocab_size=512),
           "gpt2_exact_gelu": ModelConfig(n_layer=2, n_head=2, n_embd=32, block_size=32, vocab_size=512,
                                          activation="gelu"),
           "llama_gqa": LLAMA,
           "llama_mqa_tied": dataclasses.replace(LLAMA, n_kv_head=1, tie_embeddings=True, norm_eps=1e-6),
           "llama3.1_rope_scaling": dataclasses.replace(LLAMA, rope_scale_factor=8.0, rope_original_context=16),
           "llama_wide_heads": dataclasses.replace(LLAMA, head_dim=16),
           "qwen2": dataclasses.replace(LLAMA, qkv_bias=True, rope_theta=1e6, norm_eps=1e-6),
           "qwen3_tied": QWEN3_TIED,
           "mixtral": MOE,
           "qwen3_moe": dataclasses.replace(MOE, qk_norm=True, moe_every=2),
           "qwen2_moe": dataclasses.replace(MOE, n_shared_experts=1),
           "qwen2_moe_biased": dataclasses.replace(MOE, n_shared_experts=1, qkv_bias=True)}
# Settings a Mixtral's config.json cannot tell: the dense MLP's width, where every block has experts.
UNTOLD = {"mixtral": ("ffn_hidden",)}


@pytest.fixture(scope="module")
def tokenizer_files(tmp_path_factory, shakespeare_path):
    return hub_tokenizer(tmp_path_factory.mktemp("tokenizer"), shakespeare_path)


@pytest.mark.parametrize("name", CLASSES)
@torch.no_grad()
def test_a_folder_of_each_class_loads_as_the_model_transformers_computes(tmp_path, tokenizer_files, name):
    cfg = CLASSES[name]
    theirs = hub_folder(tmp_path, cfg, tokenizer_files)
    got, model, tokenizer, meta = load_trained(None, None, str(tmp_path))
    untold = UNTOLD.get(name, ())
    assert {k: v for k, v in read_settings(dataclasses.asdict(got)).items() if k not in untold} == \
        {k: v for k, v in read_settings(dataclasses.asdict(cfg)).items() if k not in untold}
    idx = torch.randint(0, cfg.vocab_size, (2, cfg.block_size), generator=torch.Generator().manual_seed(0))
    assert (model(idx)[..., : cfg.vocab_size] - theirs(idx).logits).abs().max().item() <= 1e-5
    assert (meta["vocab_size"], tokenizer.vocab_size, got.vocab_size) == (500, 500, 512)


def test_the_chat_template_and_the_end_of_turn_are_the_folders(tmp_path, tokenizer_files):
    """The template comes from tokenizer_config.json, or from chat_template.jinja where there is one (transformers'
    order), with the tokenizer's special tokens; answers end at the special token it writes after an answer."""
    from transformers import AutoTokenizer

    from data.chat import chat_prompt

    hub_folder(tmp_path, LLAMA, tokenizer_files)
    _, _, tokenizer, meta = load_trained(None, None, str(tmp_path))
    turns = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Who art thou?"}]
    ids, end = chat_prompt(turns, meta, tokenizer, "the chat", "")
    reference = AutoTokenizer.from_pretrained(str(tmp_path))
    assert ids == reference.apply_chat_template(turns, add_generation_prompt=True, tokenize=True, return_dict=True
                                                )["input_ids"]
    assert (end, meta["chat"]["end_of_turn"]) == (reference.convert_tokens_to_ids(IM_END), IM_END)
    assert meta["chat"]["template"] == str(tmp_path / "tokenizer_config.json")

    llama3 = ("{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n\n{{ m['content'] }}<|endoftext|>"
              "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n\n{% endif %}")
    (tmp_path / "chat_template.jinja").write_text(llama3)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<|endoftext|>", "eos_token": IM_END}))
    _, _, tokenizer, meta = load_trained(None, None, str(tmp_path))
    ids, end = chat_prompt(turns, meta, tokenizer, "the chat", "")
    assert meta["chat"]["template"] == str(tmp_path / "chat_template.jinja")
    assert (end, meta["chat"]["end_of_turn"]) == (tokenizer.encode("<|endoftext|>")[0], "<|endoftext|>")
    reference = AutoTokenizer.from_pretrained(str(tmp_path))
    assert reference.chat_template == llama3
    assert ids == reference.apply_chat_template(turns, add_generation_prompt=True, tokenize=True, return_dict=True
                                                )["input_ids"]
    assert tokenizer.decode(ids).startswith("<|endoftext|><|im_start|>system")  # its bos_token


@pytest.mark.parametrize("template,eos,expected", [
    ("{% for m in messages %}{{ m['content'] }}\n{% endfor %}", IM_END, IM_END),  # nothing special after the answer
    ("{% for m in messages %}{{ m['content'] }}\n{% endfor %}", None, None),
    ("{% for m in messages %}{{ raise_exception('no') }}{% endfor %}", IM_END, IM_END),
])
def test_where_answers_end_without_a_special_token_after_them(tmp_path, tokenizer_files, template, eos, expected):
    hub_folder(tmp_path, LLAMA, tokenizer_files)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template,
                                                                **({"eos_token": eos} if eos else {})}))
    if expected is None:
        with pytest.raises(ConfigError) as caught:
            load_trained(None, None, str(tmp_path))
        assert str(caught.value) == (
            f"--export {tmp_path}: its chat template writes no special token after an answer and its "
            f"tokenizer_config.json names no eos_token, so where an answer ends is unknown; fix: set eos_token there "
            f"to the token that ends the model's turns")
        return
    meta = load_trained(None, None, str(tmp_path))[3]
    assert meta["chat"]["end_of_turn"] == expected


def test_a_base_models_folder_has_no_chat(tmp_path, tokenizer_files):
    hub_folder(tmp_path, LLAMA, tokenizer_files)
    (tmp_path / "tokenizer_config.json").write_text("{}")
    assert "chat" not in load_trained(None, None, str(tmp_path))[3]


def with_tensor(folder, name: str, tensor: torch.Tensor) -> None:
    weights = load_file(str(folder / "model.safetensors"))
    save_file({**weights, name: tensor}, str(folder / "model.safetensors"), metadata={"format": "pt"})


def damaged(change):
    def damage(folder):
        config = json.loads((folder / "config.json").read_text())
        change(config)
        (folder / "config.json").write_text(json.dumps(config))
    return damage


@pytest.mark.parametrize("damage,message", [
    (damaged(lambda c: c.update(model_type="gemma2")),
     "--export {folder} holds a 'gemma2' model (config.json's model_type), which this repo does not compute; fix: pass "
     "a model of one of its classes (gpt2, llama, qwen2, qwen3, mistral, mixtral, qwen3_moe, qwen2_moe)"),
    (damaged(lambda c: c.pop("hidden_size")),
     "--export {folder}: its config.json lacks 'hidden_size', which a 'llama' model's shape needs; fix: save the "
     "model's config again (save_pretrained)"),
    (damaged(lambda c: c.update(num_key_value_heads=4)),
     "--export {folder}: its tensor model.layers.0.self_attn.k_proj.weight has shape [16, 32], the model its "
     "config.json describes [32, 32]; fix: save the model again (save_pretrained)"),
    (damaged(lambda c: c.update(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 500.0})),
     "--export={folder}: its RoPE is 'yarn', which this repo does not compute"),
    (lambda f: with_tensor(f, "model.layers.0.self_attn.o_proj.bias", torch.zeros(32)),
     "--export {folder}: its weights hold model.layers.0.self_attn.o_proj.bias, which this repo's 'llama' model does "
     "not compute (a bias, say, of another variant of the class); fix: pass a model of the class as transformers' own "
     "config describes it"),
    (lambda f: (f / "tokenizer.json").unlink(),
     "--export {folder} holds no tokenizer.json, the model's tokenizer; fix: save it beside the weights "
     "(tokenizer.save_pretrained), as the Hub's model folders hold it"),
    (damaged(lambda c: c.update(vocab_size=480)),
     "--export {folder}: its tensor model.embed_tokens.weight has shape [512, 32], the model its config.json "
     "describes [480, 32]; fix: save the model again (save_pretrained)"),
    (lambda f: (f / "generation_config.json").write_text('{"eos_token_id": [7, 9999]}'),
     "--export {folder}: its generation_config.json's eos_token_id is [7, 9999], not ids of its tokenizer (0 to 499); "
     "fix: correct it, or remove it"),
], ids=["class", "shape_field", "kv_heads", "yarn", "attention_bias", "tokenizer", "vocabulary", "ends"])
def test_a_folder_that_cannot_be_served_is_refused_in_one_line(tmp_path, tokenizer_files, damage, message):
    hub_folder(tmp_path, LLAMA, tokenizer_files)
    damage(tmp_path)
    with pytest.raises(ConfigError) as caught:
        load_trained(None, None, str(tmp_path))
    assert message.format(folder=tmp_path) in str(caught.value)


def test_a_mistral_is_served_within_its_window(tmp_path, tokenizer_files):
    """Mistral 7B v0.1 attends over its last 4,096 tokens: served with a context no longer (--max_model_len), it
    computes what transformers does; past it, refused."""
    import transformers

    torch.manual_seed(3)
    config = transformers.MistralConfig(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                        sliding_window=16)
    transformers.MistralForCausalLM(config).save_pretrained(tmp_path)
    for path in tokenizer_files.iterdir():
        shutil.copy(path, tmp_path / path.name)
    with pytest.raises(ConfigError, match="its config.json has sliding_window=16, attention over the last 16 tokens "
                                          "only, which this run's model does not compute at model.block_size=64"):
        folder_model(str(tmp_path))
    assert folder_model(str(tmp_path), context=16).block_size == 16


def test_the_kv_cache_is_checked_against_the_free_memory():
    from serving.engine import check_cache

    llama3_8b = ModelConfig(arch="llama", n_layer=32, n_head=32, n_kv_head=8, n_embd=4096, block_size=131072,
                            vocab_size=128256)
    check_cache(llama3_8b, None, 8, 8192, torch.bfloat16, "cpu", free=9 * 2**30)  # 8 x 8,192 x 128 KiB: 8 GiB
    with pytest.raises(ConfigError) as caught:
        check_cache(llama3_8b, None, 8, 131072, torch.bfloat16, "cpu", free=24 * 2**30)
    assert str(caught.value) == (
        "the key/value cache of --slots 8 x 131,072 tokens (--max_model_len, the model's context unless given) takes "
        "128.0 GiB at bfloat16, and 24.0 GiB are free on cpu; fix: pass --max_model_len 24574 or less, or fewer "
        "--slots")
    check_cache(llama3_8b, None, 8, 24574, torch.bfloat16, "cpu", free=24 * 2**30)
    with pytest.raises(ConfigError, match=r"^the key/value cache of 131,072 tokens .* fix: pass --max_model_len "
                                          r"65532 or less$"):  # one sequence's (scripts.chat's): no slots to name
        check_cache(llama3_8b, None, 1, 131072, torch.bfloat16, "cpu", free=8 * 2**30)
    with pytest.raises(ConfigError):
        check_cache(llama3_8b, None, 8, 24575, torch.bfloat16, "cpu", free=24 * 2**30)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory, tokenizer_files):
    return decisive_qwen3(tmp_path_factory.mktemp("Qwen3-tiny"), tokenizer_files)


@torch.no_grad()
def test_the_server_answers_as_transformers_generates(qwen3, tokenizer_files, tmp_path):
    """Served from the folder at a shorter context: the prompt's ids are transformers' apply_chat_template's, the
    greedy answer its generate's among the tokenizer's ids, and an answer stops at the end of turn or at one its
    generation config names; another folder's weights of the same model loaded without a restart answer as that
    model does in transformers."""
    from transformers import AutoTokenizer

    folder, theirs = qwen3
    reference = AutoTokenizer.from_pretrained(str(folder))
    messages = [{"role": "user", "content": "Who art thou?"}]
    prompt = reference.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True
                                           )["input_ids"]
    expected = theirs.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, eos_token_id=None,
                               pad_token_id=0, suppress_tokens=PADDING)[0, len(prompt):].tolist()
    unsuppressed = theirs.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, eos_token_id=None,
                                   pad_token_id=0)[0, len(prompt):].tolist()
    assert set(unsuppressed) <= set(PADDING)
    server = Server(str(folder), "--max_model_len", "48")
    try:
        assert httpx.get(f"{server.url}/v1/models").json()["data"][0]["max_model_len"] == 48
        reply = httpx.post(f"{server.url}/v1/chat/completions", timeout=60, json={
            "messages": messages, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}).json()
        assert (reply["prompt_token_ids"], reply["choices"][0]["token_ids"]) == (prompt, expected)
        assert reply["choices"][0]["message"]["content"] == reference.decode(expected)
        end = reference.convert_tokens_to_ids(IM_END)
        stopped = httpx.post(f"{server.url}/v1/chat/completions", timeout=60, json={
            "messages": messages, "max_tokens": 8, "logit_bias": {str(end): 100}}).json()["choices"][0]
        assert (stopped["finish_reason"], stopped["message"]["content"]) == ("stop", "")
        for path, body in (("chat/completions", {"messages": messages}), ("completions", {"prompt": "Speak"})):
            ended = httpx.post(f"{server.url}/v1/{path}", timeout=60, json={
                **body, "max_tokens": 8, "logit_bias": {"1": 100}, "return_token_ids": True}).json()["choices"][0]
            assert (ended["finish_reason"], ended["token_ids"]) == ("stop", [1])  # generation_config.json's end
        too_long = httpx.post(f"{server.url}/v1/completions", timeout=60, json={"prompt": [1] * 48})
        assert too_long.status_code == 400 and "the model's context is 48" in too_long.json()["error"]["message"]

        other = hub_folder(tmp_path, dataclasses.replace(CLASSES["qwen3_tied"], block_size=64), tokenizer_files, 11)
        shutil.copy(folder / "generation_config.json", tmp_path)
        loaded = httpx.post(f"{server.url}/v1/load_weights", timeout=60, json={"path": str(tmp_path)})
        assert loaded.json() == {"status": "ok", "path": str(tmp_path), "step": None}
        expected = other.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, eos_token_id=None,
                                  pad_token_id=0, suppress_tokens=PADDING)[0, len(prompt):].tolist()
        reply = httpx.post(f"{server.url}/v1/chat/completions", timeout=60, json={
            "messages": messages, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}).json()
        assert reply["choices"][0]["token_ids"] == expected
    finally:
        assert server.stop()[0] == 0


def test_sample_answers_from_the_folder(qwen3):
    """sample.py's chat answer, greedy: transformers' generate's up to the end of turn."""
    from transformers import AutoTokenizer

    folder, theirs = qwen3
    reference = AutoTokenizer.from_pretrained(str(folder))
    messages = [{"role": "user", "content": "Speak!"}]
    prompt = reference.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True
                                           )["input_ids"]
    with torch.no_grad():
        expected = theirs.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, pad_token_id=0,
                                   eos_token_id=[reference.convert_tokens_to_ids(IM_END), *ENDS],
                                   suppress_tokens=PADDING)[0, len(prompt):].tolist()
    proc = subprocess.run([sys.executable, "sample.py", "--export", str(folder), "--chat", "Speak!",
                           "--temperature", "0", "--max_new_tokens", "12"], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == reference.decode(expected, skip_special_tokens=True) + "\n"


def test_a_folder_is_read_at_the_dtype_served(qwen3):
    """The server reads a folder at its dtype (bf16 on a GPU), not in fp32 first: each weight the folder's, rounded,
    and the rotary tables, which no folder holds, computed."""
    folder, theirs = qwen3
    _, full, _, _ = load_trained(None, None, str(folder))
    _, half, _, _ = load_trained(None, None, str(folder), dtype=torch.bfloat16)
    weights = dict(full.named_parameters())
    assert {name: p.dtype for name, p in half.named_parameters()} == {name: torch.bfloat16 for name in weights}
    assert all(torch.equal(p, weights[name].bfloat16()) for name, p in half.named_parameters())
    assert all(torch.equal(b, dict(full.named_buffers())[name]) for name, b in half.named_buffers())


def test_a_run_from_a_folder_trains_the_model_its_config_describes(tmp_path, tokenizer_files):
    """train.init_from's folder gives the run's model settings over the preset's (the quickstart's GPT here), less
    its context and head; the command line's still win (and the run's check of the folder refuses them where they
    differ); an unreadable folder gives none, for that check to say why."""
    from training.config import load_run_config

    hub_folder(tmp_path, CLASSES["qwen3_tied"], tokenizer_files)
    model = load_run_config("configs/quickstart.yaml", [f"train.init_from={tmp_path}"]).model
    preset = load_run_config("configs/quickstart.yaml", []).model
    assert (model.arch, model.n_layer, model.n_embd, model.n_kv_head, model.head_dim, model.qk_norm,
            model.tie_embeddings, model.vocab_size, model.rope_theta, model.norm_eps) == \
        ("llama", 2, 32, 2, 16, True, True, 512, 500.0, 1e-6)
    assert (model.block_size, model.head, model.dropout) == (preset.block_size, "lm", preset.dropout)
    assert load_run_config("configs/quickstart.yaml", [f"train.init_from={tmp_path}", "model.n_layer=3"]
                           ).model.n_layer == 3
    (tmp_path / "config.json").write_text("{oops")
    assert load_run_config("configs/quickstart.yaml", [f"train.init_from={tmp_path}"]).model == preset


@torch.no_grad()
def test_a_peft_adapter_over_the_folder_computes_what_peft_computes(tmp_path, tokenizer_files):
    """PEFT's own fine-tune of the folder's model, served by name over it (--lora_modules), as vLLM serves one."""
    import peft

    from test_lora_serving import served

    theirs = hub_folder(tmp_path / "base", CLASSES["qwen3_tied"], tokenizer_files)
    tuned = peft.get_peft_model(theirs, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    generator = torch.Generator().manual_seed(5)
    for name, p in tuned.named_parameters():
        if "lora_" in name:
            p.copy_(torch.randn(p.shape, generator=generator) * 0.3)
    tuned.save_pretrained(str(tmp_path / "adapter"))
    adapters = served(str(tmp_path / "base"), {"tuned": str(tmp_path / "adapter")})
    idx = torch.randint(0, 500, (1, 16), generator=torch.Generator().manual_seed(0))
    with adapters.batch.selected([adapters.by_name["tuned"]]):
        ours = adapters.batch.model(idx)[..., :512]
    assert (ours - tuned(idx).logits).abs().max().item() <= 1e-5
    assert (adapters.batch.model(idx)[..., :512] - tuned(idx).logits).abs().max().item() > 1e-2  # the adapter counts
