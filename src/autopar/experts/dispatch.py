"""Tokens sent to the rank that holds their expert, run there, and sent back: the expert-parallel forward.

Each rank of an ep group holds E/ep consecutive experts of a layer. For the (token, choice) pairs of
this rank's micro-batch, sorted by expert: the counts per expert are exchanged first (every rank learns
how many rows it receives from each other rank, for each of its experts), then the hidden rows and
their router weights travel with one all-to-all of variable splits, the model's own experts module runs
on what arrived (its rows only, each row routed to one local expert with its weight), and the weighted
outputs travel back and are summed per token. Nothing is dropped: every choice the router made is
computed, as on one process. Backward is the same exchange reversed (autograd through both
all-to-alls), so the experts' gradients on a rank sum the contributions of every rank's tokens.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist


class _AllToAll(torch.autograd.Function):
    """all_to_all_single with variable splits; its gradient is the reverse exchange."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, send: list[int], receive: list[int], group) -> torch.Tensor:
        ctx.send, ctx.receive, ctx.group = send, receive, group
        out = x.new_empty((sum(receive), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), output_split_sizes=receive, input_split_sizes=send, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        back = grad.new_empty((sum(ctx.send), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), output_split_sizes=ctx.send, input_split_sizes=ctx.receive,
                               group=ctx.group)
        return back, None, None, None


def all_to_all_variable(x: torch.Tensor, send: list[int], receive: list[int], group) -> torch.Tensor:
    """Rows of `x` split by `send` go one block per rank of `group`; returns the `receive`-split blocks that came."""
    return _AllToAll.apply(x, send, receive, group)


class ExpertParallelForward:
    """Replaces an experts module's forward: dispatch, the module's own forward on local rows, combine.

    `local_forward` is the module's original forward, run with this rank's rows of the expert weights
    (the module's attribute naming the expert count is set to the local count by shard.py). The
    tokens each expert got since the last `reset_counts` are kept for the metrics.
    """

    def __init__(self, local_forward: Callable, *, num_experts: int, group, ep_rank: int, ep: int):
        self.local_forward, self.num_experts, self.group = local_forward, num_experts, group
        self.ep_rank, self.ep, self.local = ep_rank, ep, num_experts // ep
        self.reset_counts()

    def reset_counts(self) -> None:
        """Start counting anew (the engine calls it at each step's start)."""
        self.tokens_per_expert = torch.zeros(self.num_experts, dtype=torch.long)  # this rank's choices, per expert
        self.received_per_expert = torch.zeros(self.local, dtype=torch.long)  # rows its own experts ran
        self.rows_sent_away = 0  # (token, choice) rows this rank sent to other ranks' experts
        self.rows_from_others = 0  # rows other ranks sent to this rank's experts

    def __call__(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, *args,
                 **kwargs) -> torch.Tensor:
        shape = hidden.shape
        hidden = hidden.reshape(-1, shape[-1])
        k = top_k_index.shape[-1]
        experts = top_k_index.reshape(-1)
        order = torch.argsort(experts, stable=True)
        counts = torch.bincount(experts, minlength=self.num_experts)  # per expert, this rank's choices
        # how many rows every rank sends me, for each of my experts: one equal-split exchange of the counts
        incoming = torch.empty_like(counts)
        dist.all_to_all_single(incoming, counts, group=self.group)
        incoming = incoming.view(self.ep, self.local)
        send = counts.view(self.ep, self.local).sum(1).tolist()
        receive = incoming.sum(1).tolist()
        self.tokens_per_expert += counts.detach().cpu()
        self.received_per_expert += incoming.sum(0).detach().cpu()
        self.rows_sent_away += sum(send) - send[self.ep_rank]
        self.rows_from_others += sum(receive) - receive[self.ep_rank]

        rows = hidden[order // k]
        weights = top_k_weights.reshape(-1)[order]
        local_ids = (experts[order] % self.local).to(top_k_index.dtype)
        rows_in = all_to_all_variable(rows, send, receive, self.group)
        weights_in = all_to_all_variable(weights.unsqueeze(-1), send, receive, self.group)
        ids_in = torch.empty(sum(receive), 1, dtype=local_ids.dtype, device=local_ids.device)
        dist.all_to_all_single(ids_in, local_ids.unsqueeze(-1).contiguous(), output_split_sizes=receive,
                               input_split_sizes=send, group=self.group)
        if rows_in.shape[0]:
            out_in = self.local_forward(rows_in, ids_in, weights_in, *args, **kwargs)
        else:  # nothing came: still part of the graph, so this rank joins every exchange's backward
            out_in = rows_in * 0 + weights_in * 0
        out = all_to_all_variable(out_in.reshape(sum(receive), hidden.shape[-1]), receive, send, self.group)
        combined = torch.zeros_like(hidden, dtype=out.dtype).index_add(0, order // k, out)
        return combined.to(hidden.dtype).reshape(shape)
