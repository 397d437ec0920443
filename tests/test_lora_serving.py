"""Several LoRA adapters over one served model (model/lora_batch.py, serving/adapters.py), in one process: adapters
saved by PEFT itself over the transformers model of an export compute, row by row in one batch, what PEFT computes,
while the batch's rows of the model alone stay bit for bit what they are without adapters; the server's scheduler
decodes sequences of the model and of two adapters together, each drawing what it draws alone and what the merged
weights draw; the prefix cache never hands one adapter's keys and values to another; and every adapter the server
cannot run is refused in one line naming why."""
import dataclasses
import json

import pytest
import torch
from safetensors.torch import save_file

from common.checks import ConfigError
from hf_check import load_in_transformers
from model.config import ModelConfig
from model.generate import CachedDecoder, Sampling, generate
from model.prefix_cache import PrefixCache
from model_checks import decisive_model
from serving.adapters import Adapters
from serving.engine import start_engine
from serving.scheduler import Scheduler, Sequence
from serving.weights import Weights
from training.checkpoints.export import load_trained, write_export

LLAMA = ModelConfig(arch="llama", n_layer=2, n_head=4, n_kv_head=2, n_embd=32, ffn_hidden=64, block_size=48,
                    vocab_size=40)
META = {"format": 2, "tokenizer": "char", "vocab_size": 40, "chars": [chr(c) for c in range(48, 88)]}
# Two fine-tunes as PEFT saves them: (name, LoraConfig's settings); the second scales by alpha / sqrt(r) (rsLoRA)
PEFT_ADAPTERS = [("attention", {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}),
                 ("mlp", {"r": 2, "lora_alpha": 4, "use_rslora": True,
                          "target_modules": ["q_proj", "gate_proj", "down_proj"]})]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """The base export and each adapter's folder, saved by PEFT's save_pretrained with B away from its zero start."""
    import peft

    root = tmp_path_factory.mktemp("lora_serving")
    base = write_export(str(root / "base"), LLAMA, decisive_model(LLAMA, seed=3).state_dict(), META, step=0)
    out = {"base": base}
    for i, (name, settings) in enumerate(PEFT_ADAPTERS):
        tuned = peft.get_peft_model(load_in_transformers(base), peft.LoraConfig(**settings))
        generator = torch.Generator().manual_seed(10 + i)
        with torch.no_grad():
            for key, p in tuned.named_parameters():
                if "lora_" in key:
                    p.copy_(torch.randn(p.shape, generator=generator) * 0.3)
        tuned.save_pretrained(str(root / name))
        out[name] = str(root / name)
    return out


def served(base: str, folders: dict) -> Adapters:
    """The Adapters of the base export's engine (its linear maps packed for oneDNN) holding `folders` by name, as
    scripts.serve builds them."""
    cfg, model, _, meta = load_trained(None, None, base)
    engine = start_engine(cfg, model, meta, "cpu", "fp32", slots=4, max_queue=8, prefix_cache_mb=0, thread=False)
    adapters = Adapters("base", cfg, meta, engine.adapters, Weights(cfg, meta, engine.load).check_model)
    for name, path in folders.items():
        adapters.add(adapters.read(name, path))
    return adapters


def peft_served(folders) -> Adapters:
    return served(folders["base"], {name: folders[name] for name, _ in PEFT_ADAPTERS})


def test_each_row_computes_what_peft_computes_and_the_models_rows_stay_bitwise(folders):
    import peft

    adapters = peft_served(folders)
    model = adapters.batch.model
    idx = torch.randint(0, LLAMA.vocab_size, (3, 20), generator=torch.Generator().manual_seed(0))
    rows = [adapters.by_name["attention"], None, adapters.by_name["mlp"]]
    with torch.no_grad():
        plain = model(idx)[..., :LLAMA.vocab_size]
        with adapters.batch.selected(rows):
            mixed = model(idx)[..., :LLAMA.vocab_size]
        for i, (name, _) in enumerate(PEFT_ADAPTERS):
            theirs = peft.PeftModel.from_pretrained(load_in_transformers(folders["base"]), folders[name]).eval()
            expected = theirs(idx[2 * i:2 * i + 1]).logits
            assert (mixed[2 * i] - expected[0]).abs().max().item() <= 1e-5
            assert (plain[2 * i] - expected[0]).abs().max().item() > 1e-2  # the adapter counts
    assert torch.equal(mixed[1], plain[1])


def test_sequences_of_the_model_and_two_adapters_decode_together_as_each_alone_and_merged(folders):
    adapters = peft_served(folders)
    model, batch = adapters.batch.model, adapters.batch
    attention, mlp = adapters.by_name["attention"], adapters.by_name["mlp"]
    prompts = [([1, 5, 7, 2, 9], None), ([1, 5, 7, 2, 9], attention), ([4, 4, 11, 3], attention), ([8, 1], None),
               ([3, 6, 2, 2], mlp)]
    greedy = Sampling(max_new_tokens=12, temperature=0)
    alone = []
    for prompt, adapter in prompts:
        decoder = CachedDecoder(model, LLAMA.block_size, LLAMA.vocab_size, adapters=batch)
        slot, logits = decoder.start(prompt, adapter=adapter)
        tokens = [int(logits.argmax())]
        for _ in range(greedy.max_new_tokens - 1):
            tokens.append(int(decoder.step({slot: [tokens[-1]]})[slot].argmax()))
        alone.append(tokens)
    merged = [generate(CachedDecoder(merged_model(folders, adapter), LLAMA.block_size, LLAMA.vocab_size), prompt,
                       greedy) for prompt, adapter in prompts]
    assert alone == merged
    assert len({tuple(a) for a in alone[:2]}) == 2  # the same prompt draws apart through the adapter
    scheduler = Scheduler(CachedDecoder(model, LLAMA.block_size, LLAMA.vocab_size, slots=4, adapters=batch), slots=4,
                          max_waiting=4)
    try:
        # four admitted in one step (the first two's one prompt prefilled apart), the fifth, of another adapter, once
        # the second has left
        with scheduler.changed:
            sequences = [scheduler.submit(Sequence(prompt, Sampling(max_new_tokens=n, temperature=0), adapter=adapter))
                         for (prompt, adapter), n in zip(prompts, LENGTHS)]
        drawn = [[value.id for kind, value in events(s) if kind == "token"] for s in sequences]
    finally:
        scheduler.close()
    assert drawn == [tokens[:n] for tokens, n in zip(alone, LENGTHS)]


LENGTHS = (12, 5, 9, 12, 8)  # sequences leaving and joining the batch: the rows' adapters change under it


def merged_model(folders, adapter) -> torch.nn.Module:
    """The base export's model with the adapter's B A (scaled) added to each weight it adapts."""
    model = load_trained(None, None, folders["base"])[1].eval()
    if adapter is not None:
        with torch.no_grad():
            for name, (a, b) in adapter.maps.items():
                model.get_submodule(name).weight += b.float() @ a.float()
    return model


def events(sequence: Sequence, timeout: float = 60) -> list:
    seen = []
    while not seen or seen[-1][0] not in ("done", "failed"):
        seen.append(sequence.events.get(timeout=timeout))
    return seen


def test_the_prefix_cache_keeps_each_adapters_keys_and_values_apart(folders):
    adapters = peft_served(folders)
    model, batch = adapters.batch.model, adapters.batch
    attention, prompt = adapters.by_name["attention"], list(range(1, 38))

    def drawn(decoder, adapter):
        slot, logits = decoder.start(prompt, adapter=adapter)
        decoder.release(slot)
        return int(logits.argmax()), logits

    cache = PrefixCache(2**20, block=16)
    decoder = CachedDecoder(model, LLAMA.block_size, LLAMA.vocab_size, adapters=batch, prefix_cache=cache)
    fresh = CachedDecoder(model, LLAMA.block_size, LLAMA.vocab_size, adapters=batch)
    drawn(decoder, None)  # the model alone fills the cache with the prompt's two blocks
    hits = cache.hits
    _, through_adapter = drawn(decoder, attention)
    assert cache.hits == hits  # not the model's blocks
    assert torch.allclose(through_adapter, drawn(fresh, attention)[1], atol=1e-5)
    drawn(decoder, attention)
    assert cache.hits == hits + 32  # its own, the second time


def test_an_adapter_the_server_cannot_run_is_refused_in_one_line(folders, tmp_path):
    adapters = peft_served(folders)
    saved = json.loads(open(f"{folders['attention']}/adapter_config.json").read())
    weights = f"{folders['attention']}/adapter_model.safetensors"

    def folder(name, config=None, tensors=None):
        path = tmp_path / name
        path.mkdir()
        (path / "adapter_config.json").write_text(json.dumps({**saved, **(config or {})}))
        if tensors is None:
            (path / "adapter_model.safetensors").write_bytes(open(weights, "rb").read())
        else:
            save_file(tensors, str(path / "adapter_model.safetensors"))
        return str(path)

    a = torch.zeros(4, 32)
    cases = [
        (("attention", folders["attention"]), "the lora adapter 'attention' has already been loaded"),
        (("base", folders["attention"]), "lora_name 'base' is the served model's name"),
        (("new", str(tmp_path / "nowhere")), "no such folder on the server's machine"),
        (("new", folders["base"]), "an export of whole weights, not adapters; fix: load it with /v1/load_weights"),
        (("new", folder("dora", {"use_dora": True})), "DoRA are not supported by this server"),
        (("new", folders["mlp"], "step_000004"), "an adapter folder, whose tag has no meaning"),
        (("new", folder("head", tensors={"base_model.model.lm_head.lora_A.weight": a,
                                         "base_model.model.lm_head.lora_B.weight": torch.zeros(40, 4)})),
         "base_model.model.lm_head.lora_A.weight adapts no linear map of the served model's blocks"),
        (("new", folder("wide", tensors={"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": a,
                                         "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight":
                                             torch.zeros(64, 4)})),
         "1.attn.q's lora_A and lora_B are (4, 32) and (64, 4) where the served model needs (4, 32) and (32, 4)"),
    ]
    for asked, message in cases:
        with pytest.raises(ConfigError) as refused:
            adapters.read(*asked)
        assert message in str(refused.value) and "\n" not in str(refused.value)
    assert sorted(adapters.by_name) == ["attention", "mlp"]


def test_an_adapter_export_of_this_repo_serves_as_the_adapted_model(tmp_path):
    """scripts.export --adapter's folder (written here from a LoRA model's state) computes the adapted model."""
    from model import build_model
    from training.checkpoints.adapter import write_adapter

    lora_cfg = dataclasses.replace(LLAMA, lora_rank=4, lora_alpha=8.0)
    lora = build_model(lora_cfg, seed=3).eval()
    with torch.no_grad():
        for name, p in lora.named_parameters():
            if name.endswith("lora_b"):
                p.normal_(0, 0.3, generator=torch.Generator().manual_seed(1))
    state = lora.state_dict()
    base = write_export(str(tmp_path / "base"), LLAMA, {n: t for n, t in state.items() if "lora_" not in n}, META,
                        step=0)
    adapters = served(base, {"tuned": write_adapter(str(tmp_path / "adapter"), lora_cfg, state, base)})
    idx = torch.randint(0, LLAMA.vocab_size, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), adapters.batch.selected([adapters.by_name["tuned"]] * 2):
        got = adapters.batch.model(idx)[..., :LLAMA.vocab_size]
    assert (got - lora(idx)[..., :LLAMA.vocab_size]).abs().max().item() <= 1e-5


def test_a_run_is_served_where_it_sees_documents_as_the_model_does():
    """document_masking is compared as generation reads it: without a delimiter in the dataset a window is one
    document either way (the README's LoRA fine-tune over the pretrained quickstart); with one, refused."""
    weights = Weights(LLAMA, META, load=None)
    masked = dataclasses.replace(LLAMA, document_masking=True)
    weights.check_model("run", masked, META)
    with pytest.raises(ConfigError) as refused:
        weights.check_model("run", masked, {**META, "delimiter": "eot", "eot_id": 3})
    assert str(refused.value) == "path run: trained to see documents begin at its eot id 3, where the served model " \
        "sees them nowhere (a window is one document); fix: start a server for it"
    with pytest.raises(ConfigError, match="another model \\(n_layer=3 \\(served: 2\\)\\)"):
        weights.check_model("run", dataclasses.replace(masked, n_layer=3), META)
    weights.check_model("run", dataclasses.replace(masked, activation="gelu"), META)  # the GPT's GELU: not read


def test_weights_of_another_chat_rendering_are_refused_and_an_earlier_record_is_none():
    """The chat record's template and the special tokens it renders with decide the prompts: another is refused;
    a record from before special tokens were kept is one without any."""
    chat = {"template": "plain", "chat_template": "{{ bos_token }}", "end_of_turn_id": 3}
    served = {**META, "chat": {**chat, "special_tokens": {}}}
    weights = Weights(LLAMA, served, load=None)
    weights.check_model("run", LLAMA, {**META, "chat": chat})
    with pytest.raises(ConfigError, match="trained with another tokenizer or chat template than the served model's"):
        weights.check_model("run", LLAMA, {**META, "chat": {**chat, "special_tokens": {"bos_token": "<s>"}}})


def test_an_adapter_of_a_mixture_of_experts_experts_is_refused(tmp_path):
    """The experts see the tokens routed to them, not the batch's rows: LoRA adapts the blocks' own maps only."""
    from training.checkpoints.hf import tensor_pairs

    moe = dataclasses.replace(LLAMA, n_experts=2, experts_per_token=2)
    base = write_export(str(tmp_path / "base"), moe, decisive_model(moe, seed=3).state_dict(), META, step=0)
    adapters = served(base, {})
    module = next(theirs for ours, theirs, _ in tensor_pairs(moe) if ".experts." in ours and ours.endswith(".up.weight")
                  ).removesuffix(".weight")
    path = tmp_path / "expert_adapter"
    path.mkdir()
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 2, "lora_alpha": 4}))
    save_file({f"base_model.model.{module}.lora_A.weight": torch.zeros(2, 32),
               f"base_model.model.{module}.lora_B.weight": torch.zeros(64, 2)}, str(path / "adapter_model.safetensors"))
    with pytest.raises(ConfigError, match=f"base_model.model.{module}.lora_A.weight adapts no linear map of the served "
                                          f"model's blocks"):
        adapters.read("experts", str(path))
