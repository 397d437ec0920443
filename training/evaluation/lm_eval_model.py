"""lm-evaluation-harness's model interface (lm_eval.api.model.LM) over this repo's model and tokenizer: any
checkpoint scores on the harness's tasks whatever its tokenizer (char, tiktoken, tokenizer.json), where the
harness's own HFLM reads only Hugging Face tokenizers. One process, the weights whole (training/checkpoints/export.py).

- loglikelihood: each (context, continuation) on one row, by the rule of the training loop's multiple-choice
  score (training/evaluation/multiple_choice.py), with whether greedy decoding would produce the continuation.
- loglikelihood_rolling: a text's log-likelihood in windows of the model's context, every token predicted
  once with as much context as fits (the harness's rolling windows), after the document delimiter.
- generate_until: greedy decoding until a stop string, the end of a document, or max_gen_toks.
"""
import torch
from lm_eval.api.model import LM
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from data.tasks import context_ids, pair_ids
from data.token_data import IGNORE
from data.tokenizers import delimiter_id
from model.generate import decoder_for
from training.evaluation.multiple_choice import Row, batches, choice_row, row_losses

DEFAULT_MAX_GEN_TOKS = 256  # the harness's own default


class RequestError(ValueError):
    """A request the model cannot take (text outside a char vocabulary, a continuation longer than its context)."""


class CheckpointLM(LM):
    def __init__(self, model: torch.nn.Module, block_size: int, vocab_size: int, tokenizer, device: str,
                 batch_size: int = 16, documents=None):
        """documents: where the model sees documents begin as it generates (data/documents.py's documents_seen)."""
        super().__init__()
        self.model = model.to(device).eval()
        self.block_size, self.vocab_size, self.tokenizer = block_size, vocab_size, tokenizer
        self.batch_size, self._device, self.documents = batch_size, torch.device(device), documents
        # The document delimiter: rolling windows start after it, generation stops at it (None: a one-document model).
        self.delimiter = delimiter_id(tokenizer)

    def loglikelihood(self, requests) -> list[tuple[float, bool]]:
        return self._score([self._row(*request.args) for request in requests])

    def loglikelihood_rolling(self, requests) -> list[float]:
        out = []
        for request in requests:
            ids = self._encoded(request.args[0], lambda: self.tokenizer.encode(request.args[0]))
            prefix = self.delimiter
            if prefix is None:  # a char dataset with no delimiter: its first token is context only
                prefix, ids = (ids[0], ids[1:]) if ids else (0, [])
            windows = map(make_disjoint_window, get_rolling_token_windows(ids, prefix, self.block_size, 1))
            out.append(sum(loglik for loglik, _ in self._score([Row((ctx + cont)[-(self.block_size + 1):], len(cont))
                                                                 for ctx, cont in windows])))
        return out

    @torch.no_grad()
    def generate_until(self, requests) -> list[str]:
        decoder = decoder_for(self.model, self.block_size, self.vocab_size, documents=self.documents)
        out = []
        for request in requests:
            context, options = request.args
            until = options.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            ids = self._encoded(context, lambda: context_ids(self.tokenizer, context))
            new, text = [], ""
            slot, logits = decoder.start(ids)
            for _ in range(options.get("max_gen_toks", DEFAULT_MAX_GEN_TOKS)):
                token = int(logits.argmax())
                if token == self.delimiter:
                    break
                new.append(token)
                text = self.tokenizer.decode(new)
                if any(stop in text for stop in until):
                    break
                logits = decoder.step({slot: [token]})[slot]
            decoder.release(slot)
            for stop in until:
                text = text.split(stop)[0]
            out.append(text)
        return out

    def _row(self, context: str, continuation: str) -> Row:
        ids = self._encoded(context + continuation, lambda: pair_ids(self.tokenizer, context, continuation))
        try:
            return choice_row(*ids, self.block_size)
        except ValueError as e:
            raise RequestError(f"the continuation {continuation[:60]!r}: {e}; fix: score tasks whose choices fit the "
                               f"model's context") from None

    def _encoded(self, text: str, encode):
        """encode(), or a RequestError naming `text` for a character outside a char tokenizer's vocabulary."""
        try:
            return encode()
        except ValueError as e:
            raise RequestError(f"the {self.tokenizer.name} tokenizer cannot encode the request {text[:60]!r}: {e}; "
                               f"a char model scores only tasks written in its training text's characters") from None

    @torch.no_grad()
    def _score(self, rows: list[Row]) -> list[tuple[float, bool]]:
        """(log-likelihood of the scored tokens, whether each is the most likely next token) of each row."""
        out = []
        for inputs, targets in batches(rows, self.batch_size):
            inputs, targets = inputs.to(self._device), targets.to(self._device)
            logits = self.model(inputs)
            greedy = ((logits[..., :self.vocab_size].argmax(dim=-1) == targets) | (targets == IGNORE)).all(dim=-1)
            losses = row_losses(logits, targets, self.vocab_size)
            out += [(-loss, is_greedy) for loss, is_greedy in zip(losses.tolist(), greedy.tolist())]
        return out
