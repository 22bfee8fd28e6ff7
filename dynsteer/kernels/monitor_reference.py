"""Plain-torch reference of the in-graph monitor (the twin of the future Triton kernel; DESIGN §4).

Contract (shared by every implementation)::

    monitor_gate(x, row_index, probe, sharpness, threshold, is_decode) -> (score, gate)
      x:          [T, H] float32 | bfloat16 | float16 | float64, the residual at the monitor site
      row_index:  int32 [N >= T]; only the first T entries are used (monitor row per token)
      probe:      float32 [R, H]  probe direction per monitor row (row 0 = no monitor, zeros by convention)
      sharpness:  float32 [R]     0 marks "no monitor" (row 0 always)
      threshold:  float32 [R]
      is_decode:  bool [N >= T];  only the first T entries are used

    for every token t:  i = row_index[t]
      score[t] = dot(float32(x[t]), probe[i])                       (float32 accumulation)
      gate[t]  = sigmoid(sharpness[i] * (score[t] - threshold[i]))  if is_decode[t] and sharpness[i] != 0
               = 0                                                   otherwise (prefill tokens are never gated)

Both outputs are new float32 ``[T]`` tensors. The score is returned for every token (prefill included) so the sync
tier and capture can read it; only the gate is masked.
"""

from __future__ import annotations

import torch

__all__ = ["monitor_gate_reference"]


def monitor_gate_reference(
    x: torch.Tensor,
    row_index: torch.Tensor,
    probe: torch.Tensor,
    sharpness: torch.Tensor,
    threshold: torch.Tensor,
    is_decode: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token probe score and sigmoid gate.

    Free of data-dependent Python control flow (masking uses ``torch.where``), so it traces into
    ``torch.compile(fullgraph=True)`` graphs and is CUDA-graph safe.

    Args:
        x: ``[T, H]`` residual activations, any float dtype.
        row_index: int32 ``[N >= T]`` monitor-table row per token.
        probe: float32 ``[R, H]`` probe directions.
        sharpness: float32 ``[R]`` gate slopes (0: row has no monitor).
        threshold: float32 ``[R]`` gate thresholds.
        is_decode: bool ``[N >= T]``, True for generated (decode) tokens.

    Returns:
        ``(score, gate)``, float32 ``[T]`` each.

    Example:
        >>> import torch
        >>> x = torch.tensor([[3.0, 4.0], [3.0, 4.0], [3.0, 4.0]])
        >>> probe = torch.tensor([[0.0, 0.0], [0.6, 0.8]])
        >>> score, gate = monitor_gate_reference(
        ...     x, torch.tensor([1, 1, 0], dtype=torch.int32), probe, torch.tensor([0.0, 2.0]),
        ...     torch.tensor([0.0, 5.0]), torch.tensor([True, False, True]))
        >>> score.tolist(), gate.tolist()
        ([5.0, 5.0, 0.0], [0.5, 0.0, 0.0])
    """
    t = x.shape[0]
    rows = row_index[:t].long()
    xf = x.to(torch.float32)
    p = probe.to(torch.float32).index_select(0, rows)  # [T, H]
    score = (xf * p).sum(dim=-1)
    s = sharpness.to(torch.float32).index_select(0, rows)
    th = threshold.to(torch.float32).index_select(0, rows)
    gate = torch.sigmoid(s * (score - th))
    active = is_decode[:t].to(torch.bool) & (s != 0)
    gate = torch.where(active, gate, torch.zeros_like(gate))
    return score, gate
