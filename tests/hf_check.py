"""What the tests ask of `transformers` (a test-only dependency): load a folder exactly as a user would and
compare its logits with this repo's forward of the same weights; build and save models of its own."""
import json
import os

import torch

from model import architecture, build_model
from model.config import ModelConfig, model_config
from model.gpt import HF_GELU
from training.checkpoints.export import _fingerprint, consolidated_state_dict
from training.checkpoints.hf import hf_config

CLASSES = {"GPT2LMHeadModel", "LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MixtralForCausalLM",
           "Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM"}


def load_in_transformers(folder: str):
    import transformers

    with open(os.path.join(folder, "config.json")) as f:
        (architecture,) = json.load(f)["architectures"]
    assert architecture in CLASSES, architecture
    model, info = getattr(transformers, architecture).from_pretrained(folder, output_loading_info=True,
                                                                       dtype=torch.float32)
    # from_pretrained only warns about tensors it did not find or could not place: here each is a failure
    assert not any(info[key] for key in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    return model.eval()


@torch.no_grad()
def assert_export_matches_transformers(folder: str, tokens: int = 16, weights: dict | None = None) -> None:
    """An export's logits in transformers equal this repo's forward (fp32, max diff <= 1e-5) of the weights it was
    exported from: `weights` (this repo's names) where given, else the checkpoint its config.json names as its
    source, read from the run's checkpoints (an export of harness.export lies in <out_dir>/export/<tag>). Never
    the export read back through training/checkpoints/hf.py: a wrong name on the way out would be read back alike
    and the two forwards would agree."""
    with open(os.path.join(folder, "config.json")) as f:
        record = json.load(f)["megalite"]
    cfg = model_config(record["model"], folder)
    if weights is None:
        source = record["source"]
        tag_dir = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(folder))), "checkpoints", source["tag"])
        assert os.path.isdir(tag_dir) and _fingerprint(tag_dir) == source["sha256"], f"{folder}'s checkpoint"
        weights = consolidated_state_dict(tag_dir)
    ours = build_model(cfg)
    ours.load_state_dict(weights)
    theirs = load_in_transformers(folder)
    idx = torch.randint(0, cfg.vocab_size, (2, min(tokens, cfg.block_size)), generator=torch.Generator().manual_seed(0))
    expected = ours.eval()(idx)[..., : cfg.vocab_size]
    got = theirs(idx).logits
    assert got.shape == expected.shape
    assert (got - expected).abs().max().item() <= 1e-5, (got - expected).abs().max().item()


def transformers_model(cfg: ModelConfig, folder, max_shard_size: str | None = None, seed: int = 7,
                       sliding_window: int | None = None) -> torch.nn.Module:
    """What transformers itself builds for this shape (its own init, then randomized norms), saved; a Mistral's where
    `sliding_window` is given (0: none)."""
    import transformers

    torch.manual_seed(seed)
    if cfg.arch == "gpt":
        config = transformers.GPT2Config(vocab_size=cfg.vocab_size, n_positions=cfg.block_size, n_embd=cfg.n_embd,
                                         n_layer=cfg.n_layer, n_head=cfg.n_head,
                                         activation_function=HF_GELU[cfg.activation])
        model = transformers.GPT2LMHeadModel(config)
    else:
        shared = dict(vocab_size=cfg.vocab_size, hidden_size=cfg.n_embd, num_hidden_layers=cfg.n_layer,
                      num_attention_heads=cfg.n_head, num_key_value_heads=cfg.kv_heads, head_dim=cfg.head_width,
                      max_position_embeddings=cfg.block_size, rms_norm_eps=cfg.norm_eps,
                      tie_word_embeddings=cfg.tie_embeddings,
                      rope_parameters=hf_config(cfg, {})["rope_parameters"])
        arch = architecture(cfg)
        if cfg.n_experts and cfg.qk_norm:
            config = transformers.Qwen3MoeConfig(
                **shared, intermediate_size=arch.mlp_hidden(cfg), moe_intermediate_size=arch.expert_hidden(cfg),
                num_experts=cfg.n_experts, num_experts_per_tok=cfg.experts_per_token,
                decoder_sparse_step=cfg.moe_every, norm_topk_prob=cfg.experts_per_token > 1)
            model = transformers.Qwen3MoeForCausalLM(config)
        elif cfg.n_shared_experts:
            config = transformers.Qwen2MoeConfig(
                **shared, intermediate_size=arch.mlp_hidden(cfg), moe_intermediate_size=arch.expert_hidden(cfg),
                shared_expert_intermediate_size=arch.shared_hidden(cfg), num_experts=cfg.n_experts,
                num_experts_per_tok=cfg.experts_per_token, decoder_sparse_step=cfg.moe_every, norm_topk_prob=True,
                qkv_bias=cfg.qkv_bias)
            model = transformers.Qwen2MoeForCausalLM(config)
        elif cfg.n_experts:
            config = transformers.MixtralConfig(
                **shared, intermediate_size=arch.expert_hidden(cfg), num_local_experts=cfg.n_experts,
                num_experts_per_tok=cfg.experts_per_token)
            model = transformers.MixtralForCausalLM(config)
        elif cfg.qk_norm:
            config = transformers.Qwen3Config(**shared, intermediate_size=arch.mlp_hidden(cfg))
            model = transformers.Qwen3ForCausalLM(config)
        elif sliding_window is not None:
            config = transformers.MistralConfig(**shared, intermediate_size=arch.mlp_hidden(cfg),
                                                sliding_window=sliding_window or None)
            model = transformers.MistralForCausalLM(config)
        elif cfg.qkv_bias:
            config = transformers.Qwen2Config(**shared, intermediate_size=arch.mlp_hidden(cfg))
            model = transformers.Qwen2ForCausalLM(config)
        else:
            config = transformers.LlamaConfig(**shared, intermediate_size=arch.mlp_hidden(cfg))
            model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:  # norms about 1, biases (transformers' zeros) about 0
                p.normal_(0.0 if name.endswith("bias") else 1.0, 0.2)
    model.save_pretrained(folder, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    return model.eval()
