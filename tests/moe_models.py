"""A mixture-of-experts language model written as a user would, in another style than Hugging Face's:
a sigmoid router with no renormalisation, and every expert's weight in ONE 3-d parameter, gathered
per (token, choice) and applied with einsum. Module level so the rank pool's workers can import it."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, SEQ, WIDTH, EXPERTS, TOP_K = 64, 8, 16, 4, 2
ROUTER_AUX = "+router-aux"  # a zoo case's name with this suffix: its own load-balancing loss on, weight 0.5


# more Hugging Face mixture-of-experts families, tiny (4 experts, top-2), for the planner's detection only: the two
# whose routing differs most from Mixtral's (Qwen3-MoE and OLMoE have Qwen2-MoE's form, which trains under ep)
_TINY = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64,
             num_experts_per_tok=2, pad_token_id=0, bos_token_id=1, eos_token_id=2)
MORE_MOE_FAMILIES: dict[str, dict] = {
    "deepseek_v3": dict(_TINY, num_key_value_heads=4, n_routed_experts=4, moe_intermediate_size=32, n_group=1,
                        topk_group=1, first_k_dense_replace=0, q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=8,
                        qk_nope_head_dim=8, v_head_dim=8),
    "gpt_oss": dict(_TINY, num_key_value_heads=2, head_dim=8, num_local_experts=4, sliding_window=8),
}
# how each family's router scores its experts, as the planner reports it
ROUTER_SCORES = {"deepseek_v3": "sigmoid", "gpt_oss": "softmax of the chosen"}


class BatchedExperts(nn.Module):
    """Expert e maps x to gelu(x @ weight[e]); the outputs of a token's choices are summed by their weights."""

    def __init__(self, experts: int, width: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(experts, width, width) / width ** 0.5)

    def forward(self, hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        chosen = self.weight[index]  # (tokens, k, width, width)
        out = F.gelu(torch.einsum("td,tkde->tke", hidden, chosen))
        return (out * weights.unsqueeze(-1)).sum(1)


class SigmoidMoE(nn.Module):
    """Pre-norm residual mixture of experts: sigmoid scores, top-k, the chosen scores as weights."""

    def __init__(self, width: int = WIDTH, experts: int = EXPERTS, top_k: int = TOP_K):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.router = nn.Linear(width, experts, bias=False)
        self.experts = BatchedExperts(experts, width)
        self.top_k = top_k

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x).reshape(-1, x.shape[-1])
        weights, index = torch.topk(torch.sigmoid(self.router(h)), self.top_k, dim=-1)
        return x + self.experts(h, index, weights).reshape(x.shape)


class LoopedExperts(nn.Module):
    """Routing as SigmoidMoE's, but one Linear per expert, each run on every token and masked by the choices:
    a mixture of experts with no 3-d weight to shard (it trains with its experts replicated)."""

    def __init__(self, width: int = WIDTH, experts: int = EXPERTS, top_k: int = TOP_K):
        super().__init__()
        self.router = nn.Linear(width, experts, bias=False)
        self.experts = nn.ModuleList([nn.Linear(width, width) for _ in range(experts)])
        self.top_k = top_k

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, index = torch.topk(torch.softmax(self.router(x), dim=-1), self.top_k, dim=-1)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            gate = (weights * (index == e)).sum(-1, keepdim=True)
            out = out + gate * expert(x)
        return x + out


class MoELM(nn.Module):
    """Embedding, a stack of mixture-of-experts blocks, a head."""

    def __init__(self, vocab: int = VOCAB, width: int = WIDTH, depth: int = 2, experts: int = EXPERTS):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.Sequential(*[SigmoidMoE(width, experts) for _ in range(depth)])
        self.head = nn.Linear(width, vocab)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.embed(input_ids)))


# ----------------------------------------------------------------------------- rank-pool functions

def _model_and_data(name: str, build: str):
    """A zoo case (tests/zoo_models.py) by name, or "user:moe" (MoELM on random tokens)."""
    if name == "user:moe":
        g = torch.Generator().manual_seed(0)
        data = [{"input_ids": t[:-1], "labels": t[1:]} for t in torch.randint(0, VOCAB, (32, SEQ + 1), generator=g)]
        if build == "meta":
            with torch.device("meta"):
                return MoELM(), data, None
        torch.manual_seed(0)
        return MoELM(), data, None
    from zoo_models import CASES, construct
    case = CASES[name]
    return construct(case, build), case.data(), case


def train_moe(jobs: list[tuple[str, str]], out: str, *, strategy: dict | None = None, micro_batch_size: int = 8,
              steps: int = 2, checkpoint_every: int = 0, resume_from: str | None = None,
              resume_checkpoint: str = "") -> dict:
    """Train each (case, build) of `jobs` on every rank of the pool; per job: losses, whole parameters, this
    rank's expert rows, the metrics records and the banner's expert line."""
    import json
    import traceback
    from pathlib import Path

    import autopar
    from helpers import whole_parameters

    results = {}
    for index, (name, build) in enumerate(jobs):
        run = str(Path(out) / str(index))
        try:
            model, data, case = _model_and_data(name.removesuffix(ROUTER_AUX), build)
            if name.endswith(ROUTER_AUX):
                model.config.output_router_logits, model.config.router_aux_loss_coef = True, 0.5
            config = autopar.TrainConfig(steps=steps, global_batch_size=8, micro_batch_size=micro_batch_size, lr=1e-3,
                                         warmup_steps=0, adam_eps=1e-6, out=run, progress=False, timeout_s=60,
                                         checkpoint_every=checkpoint_every,
                                         resume=str(Path(resume_from) / str(index) / resume_checkpoint) if resume_from else None)
            trainer = autopar.Trainer(model, data, strategy=autopar.Strategy(**(strategy or {})), config=config,
                                      loss_fn=case.loss_fn if case else None,
                                      init_fn=case.meta_init if case and build == "meta" else None)
            try:
                result = trainer.train()
                records = [json.loads(line) for line in (Path(run) / "metrics.jsonl").read_text().splitlines()]
                results[name, build] = {
                    "losses": result.losses, "params": whole_parameters(trainer), "records": records,
                    "expert_rows": {k: v.shape[0] for k, v in trainer.model.named_parameters()
                                    if k in _expert_rows(trainer.engine.sliced_state)},
                    "banner": trainer.engine.banner_lines()}
            finally:
                trainer.close()
        except Exception as exc:  # the test reports it
            results[name, build] = {"error": f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"}
    return results


def _expert_rows(sliced) -> dict:
    """Expert weight name -> whole row count, from what the engine's checkpoints slice (experts alone, or beside tp)."""
    experts = getattr(sliced, "experts", sliced)
    return getattr(experts, "rows", {})


def dispatch_against_whole(skew: bool) -> dict:
    """On every rank of a 2-rank pool: BatchedExperts with 4 experts, sharded 2 + 2, run through the dispatch on
    this rank's own tokens, against the whole module on the same tokens: outputs and every gradient. With
    `skew`, every token of every rank picks experts 0 and 1, so rank 1's experts receive no row at all."""
    import torch.distributed as dist

    from autopar.experts import ExpertLayer, ExpertPlan, shard_experts

    torch.manual_seed(0)
    whole = BatchedExperts(EXPERTS, WIDTH)
    local = BatchedExperts(EXPERTS, WIDTH)
    local.load_state_dict(whole.state_dict())
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(10 + rank)
    hidden = torch.randn(6, WIDTH, generator=g)
    if skew:
        index = torch.tensor([[0, 1]] * 6)
    else:
        index = torch.stack([torch.randperm(EXPERTS, generator=g)[:TOP_K] for _ in range(6)])
    weights = torch.rand(6, TOP_K, generator=g)
    plan = ExpertPlan(layers=[ExpertLayer("experts", "router", EXPERTS, TOP_K, "sigmoid", False, ("experts.weight",))])
    holder = nn.Module()
    holder.experts = local
    sharded = shard_experts(holder, plan, dist.group.WORLD, ep=2, ep_rank=rank)
    results = {}
    for name, module in (("whole", whole), ("ep", local)):
        x, w = hidden.clone().requires_grad_(), weights.clone().requires_grad_()
        out = module(x, index, w)
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        weight_grad = module.weight.grad if module.weight.grad is not None else torch.zeros_like(module.weight)
        results[name] = {"out": out.detach(), "x": x.grad, "w": w.grad, "weight": weight_grad}  # no row: no gradient
    whole_grads = [torch.empty_like(results["whole"]["weight"]) for _ in range(2)]
    dist.all_gather(whole_grads, results["whole"]["weight"])  # one process's expert gradient: both ranks' tokens
    results["whole"]["weight"] = sum(whole_grads)[rank * 2:(rank + 1) * 2]
    results["received"] = sharded.forwards["experts"].received_per_expert.tolist()
    return results
