"""Document masking in one process: where documents begin in a window (data/documents.py), a packed window
computing what its documents compute alone (model/documents.py), and the loader's batches."""
import numpy as np
import pytest
import torch

from data.documents import Documents
from data.token_data import TokenData
from model import build_model
from model.config import ModelConfig
from model.documents import dense_document_mask, document_kernel
from training.topology import Layout

EOT, BOS = 65, 64
CPU = torch.device("cpu")
ENDED = Documents({"delimiter": "eot", "eot_id": EOT})  # delimiter at each document's end
STARTED = Documents({"delimiter": "bos", "bos_id": BOS, "eot_id": None})  # at each document's start
MODELS = {"gpt": ModelConfig(n_layer=2, n_head=4, n_embd=32, block_size=32, vocab_size=66, document_masking=True),
          "llama": ModelConfig(arch="llama", n_layer=2, n_head=4, n_kv_head=2, n_embd=32, ffn_hidden=64,
                               block_size=32, vocab_size=66, document_masking=True)}


def positions(documents: Documents, *rows: list[int]) -> list[list[int]]:
    return documents.positions(np.array(rows)).tolist()


def test_positions_restart_after_each_end_of_text():
    # The end-of-text belongs to the document it ends: the token after it is position 0.
    assert positions(ENDED, [1, 2, EOT, 3, 4, 5, EOT, 6]) == [[0, 1, 2, 0, 1, 2, 3, 0]]


def test_a_document_crossing_the_window_start_counts_from_the_window():
    assert positions(ENDED, [7, 7, 7, EOT, 1, 2]) == [[0, 1, 2, 3, 0, 1]]


def test_a_window_inside_one_document_is_one_document():
    assert positions(ENDED, [3, 1, 4, 1, 5, 9]) == [[0, 1, 2, 3, 4, 5]]


def test_a_delimiter_at_the_last_position_ends_its_document_there():
    assert positions(ENDED, [1, 2, 3, EOT]) == [[0, 1, 2, 3]]
    assert positions(STARTED, [1, 2, 3, BOS]) == [[0, 1, 2, 0]]


def test_begin_of_text_starts_its_document_and_rows_are_independent():
    assert positions(STARTED, [BOS, 1, 2, BOS, 3], [4, BOS, BOS, 5, 6]) == [[0, 1, 2, 0, 1], [0, 0, 0, 1, 2]]


def test_a_dataset_without_delimiter_is_one_document():
    assert positions(Documents({"delimiter": None}), [EOT, 1, EOT, 2]) == [[0, 1, 2, 3]]


def test_the_dense_mask_is_causal_within_documents():
    mask = dense_document_mask(torch.tensor([[0, 1, 0, 1, 2]]))[0, 0].int().tolist()
    assert mask == [[1, 0, 0, 0, 0],
                    [1, 1, 0, 0, 0],
                    [0, 0, 1, 0, 0],
                    [0, 0, 1, 1, 0],
                    [0, 0, 1, 1, 1]]


def packed_window(generator) -> tuple[torch.Tensor, list[slice]]:
    """[A | B | start of C] in 32 tokens, A and B each ended by an end-of-text; the slices of A and B."""
    a, b, c = (torch.randint(0, EOT, (n,), generator=generator) for n in (9, 12, 9))
    eot = torch.tensor([EOT])
    return torch.cat([a, eot, b, eot, c])[None], [slice(0, 10), slice(10, 23)]


@pytest.mark.parametrize("arch", MODELS)
def test_a_packed_window_gives_each_document_the_logits_and_gradients_it_has_alone(arch):
    model = build_model(MODELS[arch], seed=3)
    window, documents = packed_window(torch.Generator().manual_seed(0))
    weights = torch.randn(1, 32, model(window).size(-1), generator=torch.Generator().manual_seed(1))

    packed = model((window, torch.from_numpy(ENDED.positions(window.numpy()))))
    sum((packed[:, d] * weights[:, d]).sum() for d in documents).backward()  # C's tokens left out
    packed_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    alone = [model(window[:, d]) for d in documents]  # each document alone, as a plain window
    sum((logits * weights[:, d]).sum() for logits, d in zip(alone, documents)).backward()

    for logits, d in zip(alone, documents):
        torch.testing.assert_close(packed[:, d], logits, rtol=0, atol=1e-5)
    for name, p in model.named_parameters():
        # 1e-5 of the tensor's largest entry: its entries sum hundreds of terms of the weighted logits.
        torch.testing.assert_close(packed_grads[name], p.grad, rtol=0, atol=1e-5 * p.grad.abs().max().item())
    # Without the mask the second document sees the first: the check can fail.
    assert not torch.allclose(model(window)[:, documents[1]], alone[1], atol=1e-3)


@pytest.mark.parametrize("arch", MODELS)
def test_one_document_windows_compute_the_unmasked_model(arch):
    model = build_model(MODELS[arch], seed=3)
    window = torch.randint(0, EOT, (2, 32), generator=torch.Generator().manual_seed(0))
    one_document = torch.arange(32).expand(2, 32)
    torch.testing.assert_close(model((window, one_document)), model(window), rtol=0, atol=1e-5)


@pytest.mark.parametrize("arch", MODELS)
def test_checkpointed_blocks_pass_the_positions_with_equal_gradients(arch):
    window, _ = packed_window(torch.Generator().manual_seed(0))
    inputs = (window, torch.from_numpy(ENDED.positions(window.numpy())))
    grads = []
    for interval in (0, 1):
        model = build_model(MODELS[arch], seed=3, checkpoint_interval=interval)
        model(inputs).square().mean().backward()
        grads.append([p.grad for p in model.parameters()])
    for plain, checkpointed in zip(*grads):
        torch.testing.assert_close(checkpointed, plain, rtol=0, atol=1e-6)


def test_the_kernel_is_flex_on_cuda_without_dropout_else_dense():
    assert document_kernel("cuda", 0.0) == "flex"
    assert document_kernel("cuda", 0.1) == "dense"  # FlexAttention has no dropout
    assert document_kernel("cpu", 0.0) == "dense"  # nor a backward on the CPU


def test_the_loader_gives_each_token_its_position_in_its_document(speech_data):
    data = TokenData(speech_data, None, 64, document_masking=True)
    layout = Layout(1, 1, micro_batch=4, grad_accum=2)
    batches = data.step_batches(5, 3, 0, layout, CPU)
    assert len(batches) == 2
    for (tokens, positions), targets in batches:
        assert tokens.shape == positions.shape == targets.shape == (4, 64)
        assert torch.equal(torch.from_numpy(ENDED.positions(tokens.numpy())), positions)
        assert (positions == 0).sum() > 4  # speeches are short: documents begin inside the windows
    plain = TokenData(speech_data, None, 64).step_batches(5, 3, 0, layout, CPU)
    for ((tokens, _), targets), (plain_tokens, plain_targets) in zip(batches, plain):
        assert torch.equal(tokens, plain_tokens) and torch.equal(targets, plain_targets)


def test_validation_batches_carry_positions_too(speech_data):
    data = TokenData(speech_data, None, 64, document_masking=True)
    (tokens, positions), targets = next(data.eval_batches("val", 5, 0, Layout(1, 1, 4, 1), CPU))
    assert torch.equal(torch.from_numpy(ENDED.positions(tokens.numpy())), positions)


def test_single_document_data_gets_no_positions(char_data):
    data = TokenData(char_data, "char", 16, document_masking=True)
    assert data.documents is None
    inputs, _ = data.train_batch(0, 1, 0, 0, Layout(1, 1, 2, 1), CPU)
    assert isinstance(inputs, torch.Tensor)

