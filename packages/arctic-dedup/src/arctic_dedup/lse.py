"""Log-sum-exp algebra of partial attention states: the one merge every torch path uses.

A partial state is the attention of some queries over a subset of their keys: the output ``[rows, H, D]`` and the
log-sum-exp ``[rows, H]`` of the scores over that subset. Two partials over disjoint key sets give the attention
over their union exactly: ``lse = logaddexp(lse_a, lse_b)`` and ``out = out_a * exp(lse_a - lse) + out_b *
exp(lse_b - lse)``. (The Triton combine kernel of forest decode merges its partials the same way, inside the
kernel.)
"""

from __future__ import annotations

import torch

__all__ = ["merge_attention_states"]


def merge_attention_states(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Two partial attentions over disjoint keys -> the attention over both, in fp32.

    ``out_*`` ``[rows, H, D]`` (any float dtype), ``lse_*`` ``[rows, H]`` (natural log) -> (out ``[rows, H, D]``
    fp32, lse ``[rows, H]`` fp32). A row that saw no key in either part (both lse ``-inf``) gets output 0 and lse
    ``-inf``, never NaN; a part whose lse is ``-inf`` contributes nothing.
    """
    lse_a, lse_b = lse_a.float(), lse_b.float()
    total = torch.logaddexp(lse_a, lse_b)
    # Rows without any key: shift by 0 so both weights are exp(-inf) = 0 instead of exp(NaN).
    shift = torch.where(torch.isinf(total), 0.0, total)
    merged = out_a.float() * torch.exp(lse_a - shift).unsqueeze(-1)
    merged = merged + out_b.float() * torch.exp(lse_b - shift).unsqueeze(-1)
    return merged, total
