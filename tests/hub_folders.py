"""What the tests of Hugging Face model folders share: a Qwen-style tokenizer's files, a folder as a Hub download
leaves it (transformers' model saved beside them), and a Qwen3 whose greedy answers are long and whose padding rows
would win unless sampling draws among the tokenizer's ids."""
import dataclasses
import json
import shutil

import torch

from chats import CHATML, chatml_folder
from hf_check import transformers_model
from model.config import ModelConfig

# 512 embedding rows for the tokenizer's 500 ids, as a Qwen's 151,936 rows hold its 151,669
LLAMA = ModelConfig(arch="llama", n_layer=2, n_head=4, n_kv_head=2, n_embd=32, ffn_hidden=64, block_size=32,
                    vocab_size=512, rope_theta=500.0, norm_eps=1e-5)
QWEN3_TIED = dataclasses.replace(LLAMA, qk_norm=True, head_dim=16, tie_embeddings=True, norm_eps=1e-6)
IM_END = "<|im_end|>"
# The embedding rows past the tokenizer's 500 ids, which transformers' greedy answers would always pick here
PADDING = list(range(500, 512))
ENDS = [499, 1]  # the decisive Qwen3's generation_config.json's eos_token_id


def hub_tokenizer(folder, shakespeare_path: str):
    """A Qwen-style tokenizer folder: a byte-level BPE with ChatML's tokens, CHATML in tokenizer_config.json, and
    its eos_token the end of turn."""
    folder = chatml_folder(folder, shakespeare_path)
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHATML, "eos_token": IM_END,
                                                              "tokenizer_class": "PreTrainedTokenizerFast"}))
    return folder


def hub_folder(folder, cfg: ModelConfig, tokenizer_folder, seed: int = 7):
    """A folder as a Hub download leaves it: transformers' model of `cfg` saved, the tokenizer's files beside it."""
    theirs = transformers_model(cfg, folder, seed=seed)
    (folder / "generation_config.json").unlink(missing_ok=True)  # GPT2Config's default ends: GPT-2's 50,256
    for path in tokenizer_folder.iterdir():
        shutil.copy(path, folder / path.name)
    return theirs


def decisive_qwen3(folder, tokenizer_folder, context: int = 64):
    """(folder, transformers' model): a tied Qwen3 whose rows past the tokenizer's ids have the largest logits (1,000
    times a hidden feature, of either sign): drawn among all rows, an answer would be those."""
    theirs = hub_folder(folder, dataclasses.replace(QWEN3_TIED, block_size=context), tokenizer_folder)
    with torch.no_grad():
        for p in theirs.parameters():  # weights far from transformers' small init: greedy answers of many tokens
            if p.dim() == 2:
                p.normal_(0.0, 0.5, generator=torch.Generator().manual_seed(p.numel()))
        rows = theirs.model.embed_tokens.weight[PADDING]
        rows.zero_()
        for i in range(len(PADDING)):
            rows[i, i // 2] = 1000.0 * (-1) ** i
        theirs.model.embed_tokens.weight[PADDING] = rows
    theirs.save_pretrained(folder)
    # more ends, as a Llama 3.1's generation config names its <|eom_id|> and <|end_of_text|> beside <|eot_id|>
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": ENDS}))
    return folder, theirs
