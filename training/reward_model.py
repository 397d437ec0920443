"""A reward model's export (train.objective=reward, then python -m scripts.export), loaded to score sequences:
what online RL reads with rl.reward_model=EXPORT, and what any caller can use.

    reward_model = load_reward_model("out/reward_export", "cpu")
    ids = reward_model.encode([{"role": "user", "content": "Reverse: king crown"}],
                              [{"role": "assistant", "content": "crown king"}])
    reward_model.score([ids, other_ids])          # tensor([2.31, -1.87]): float32, on the CPU

The model is this repo's own, built from the export (fp32, eval mode), so its scores are the training run's and,
to rounding, transformers' *ForSequenceClassification's of the same folder: each read at the sequence's last token
that is not the pad id (config.json's pad_token_id; training/objectives/reward.py score_positions).
"""
import torch

from data.chat import recorded_template
from data.prepare_preference import text_encoder
from training.checkpoints.export import load_trained
from training.checkpoints.hf import score_pad_id
from training.objectives.reward import score_positions


class RewardModel:
    """A loaded reward model: `score` of token-id sequences, and `encode` of a (prompt, completion) as its training
    pairs were tokenized. Attributes: `tokenizer` (this repo's: encode, decode, eot_id), `chat_template` (the
    template its conversational pairs were rendered with, data/chat.py ChatTemplate; None for text pairs),
    `pad_id`, `block_size` (the most tokens a sequence may have), `meta` (its dataset's tokenizer record)."""

    def __init__(self, cfg, model: torch.nn.Module, tokenizer, meta: dict, device: torch.device):
        self.model, self.tokenizer, self.meta, self.device = model, tokenizer, meta, device
        self.block_size, self.pad_id = cfg.block_size, score_pad_id(meta)
        self.chat_template = recorded_template(meta["chat"]) if "chat" in meta else None
        # data.prepare --format preference appends the end of text to each text answer where the tokenizer has one
        self.appends_eos = meta.get("preference", {}).get("eos_appended", False)

    @torch.no_grad()
    def score(self, sequences: list[list[int]], batch_size: int = 16) -> torch.Tensor:
        """Each sequence's score (float32, on the CPU), scored `batch_size` at a time, right-padded with pad_id. A
        sequence must hold 1 to block_size tokens (ValueError otherwise)."""
        for i, ids in enumerate(sequences):
            if not 1 <= len(ids) <= self.block_size:
                raise ValueError(f"sequence {i} holds {len(ids):,} tokens; the reward model scores 1 to "
                                 f"{self.block_size:,} (its model.block_size): cut it, keeping its end")
        scores = []
        for first in range(0, len(sequences), batch_size):
            chunk = sequences[first:first + batch_size]
            lengths = torch.tensor([len(ids) for ids in chunk], device=self.device)
            tokens = torch.full((len(chunk), int(lengths.max())), self.pad_id, dtype=torch.long, device=self.device)
            for row, ids in enumerate(chunk):
                tokens[row, :len(ids)] = torch.tensor(ids, dtype=torch.long)
            outputs = self.model(tokens)[..., 0]
            scores.append(outputs[torch.arange(len(chunk)), score_positions(tokens, lengths, self.pad_id)].float())
        return torch.cat(scores).cpu() if scores else torch.zeros(0)

    def encode(self, prompt, completion) -> list[int]:
        """The ids of a prompt and its completion as data.prepare --format preference tokenized the pairs the model
        learned: lists of turns ({"role", "content"}) rendered by its chat template for a model of conversational
        pairs; strings, the end of text appended as there, for a model of text pairs."""
        if self.chat_template is not None:
            if not (isinstance(prompt, list) and isinstance(completion, list)):
                raise ValueError("this reward model learned conversations: pass the prompt and the completion as "
                                 "lists of turns ({'role': ..., 'content': ...})")
            text, _ = self.chat_template.render(prompt + completion)
            return self.tokenizer.encode_with_offsets(text)[0]
        if not (isinstance(prompt, str) and isinstance(completion, str)):
            raise ValueError("this reward model learned text pairs: pass the prompt and the completion as strings")
        text = prompt + completion
        if self.appends_eos and self.tokenizer.eot_id is not None:
            eos = self.tokenizer.decode([self.tokenizer.eot_id])
            text = text if text.endswith(eos) else text + eos
        return text_encoder(self.tokenizer)(text)


def load_reward_model(folder: str, device: str | torch.device = "cpu") -> RewardModel:
    """The reward model of an export folder (python -m scripts.export of a train.objective=reward run), on `device`
    in fp32 and eval mode. A folder of another model, or none, raises common.checks.ConfigError with its fix."""
    cfg, model, tokenizer, meta = load_trained(None, None, folder, head="score")
    device = torch.device(device)
    return RewardModel(cfg, model.to(device, torch.float32).eval(), tokenizer, meta, device)
