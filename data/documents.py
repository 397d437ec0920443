"""Where the documents of a packed window begin: each token's position within its document.

data.prepare ends every document with the end-of-text token, or starts it with begin-of-text for a tokenizer
that has only that (meta.json's `delimiter`); the delimiter belongs to the document it ends or starts. A
window that starts inside a document counts that document's positions from 0 at the window's start: the
model cannot see further back. A dataset without a delimiter (the character quickstart) is one document.
"""
import numpy as np


class Documents:
    """The delimiter of a prepared dataset, from its meta.json; `delimiter` None when it has none."""

    def __init__(self, meta: dict):
        self.delimiter = meta.get("delimiter")
        self.delimiter_id = meta.get("bos_id" if self.delimiter == "bos" else "eot_id") if self.delimiter else None

    def positions(self, tokens: np.ndarray) -> np.ndarray:
        """(rows, T) int64 position of each token of each window within its document."""
        rows, T = tokens.shape
        starts = np.zeros((rows, T), dtype=bool)
        starts[:, 0] = True
        if self.delimiter == "eot":  # the token after an end-of-text starts the next document
            starts[:, 1:] |= tokens[:, :-1] == self.delimiter_id
        elif self.delimiter == "bos":
            starts |= tokens == self.delimiter_id
        index = np.broadcast_to(np.arange(T, dtype=np.int64), (rows, T))
        return index - np.maximum.accumulate(np.where(starts, index, 0), axis=1)


def documents_seen(document_masking: bool, meta: dict) -> Documents | None:
    """Where a model sees documents begin when it generates: as it trained, at its dataset's delimiter under
    document masking; else None, a window being one document."""
    documents = Documents(meta)
    return documents if document_masking and documents.delimiter else None
