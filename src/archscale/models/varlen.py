"""Variable-length (document-masked) training: documents are separated by EOS inside a packed sequence.

A token belongs to the document that its preceding EOS tokens delimit; the EOS itself closes its document
(it is the last token of it). `document_ids` gives every token its document index within the row, and
`document_positions` the position inside its document (for `--reset_position_ids`).
"""

from __future__ import annotations

import torch


def document_ids(idx: torch.Tensor, eos_id: int) -> torch.Tensor:
    """(B, T) token ids -> (B, T) int64 document index: the number of EOS tokens strictly before each token."""
    is_eos = (idx == eos_id).long()
    return is_eos.cumsum(dim=1) - is_eos


def document_positions(doc_ids: torch.Tensor) -> torch.Tensor:
    """(B, T) document ids -> (B, T) position of every token inside its document (0 at each document start)."""
    B, T = doc_ids.shape
    t = torch.arange(T, device=doc_ids.device).expand(B, T)
    new_doc = torch.ones_like(doc_ids, dtype=torch.bool)
    new_doc[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    start = torch.where(new_doc, t, torch.zeros_like(t)).cummax(dim=1).values
    return t - start
