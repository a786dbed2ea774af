"""Study 2: peak memory per rank, every variant in a fresh pair of processes: RSS over a baseline run,
and the most bytes autograd's saved tensors hold during a step."""

from __future__ import annotations

import resource

import torch
import torch.distributed as dist

from pipeline.common import MEMORY, Setup, make_variant, mib

# ----------------------------------------------------------------------------- saved-tensor counter (part 2)


class SavedBytes:
    """Live bytes of the storages autograd's saved-tensor hooks hold (weights excluded), and their peak.

    A saved tensor is wrapped in a handle; autograd drops the handle when it frees the graph
    node, which releases the count. Storages saved several times are counted once.
    """

    def __init__(self, weights):
        self.exclude = {w.untyped_storage().data_ptr() for w in weights}
        self.live: dict[int, list[int]] = {}
        self.now = self.peak = 0

    def pack(self, t: torch.Tensor):
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr in self.exclude or storage.nbytes() == 0:
            return t
        entry = self.live.get(ptr)
        if entry is None:
            self.live[ptr] = [1, storage.nbytes()]
            self.now += storage.nbytes()
            self.peak = max(self.peak, self.now)
        else:
            entry[0] += 1
        return _Saved(self, ptr, t)

    @staticmethod
    def unpack(value):
        return value.tensor if isinstance(value, _Saved) else value

    def release(self, ptr: int) -> None:
        entry = self.live[ptr]
        entry[0] -= 1
        if entry[0] == 0:
            self.now -= entry[1]
            del self.live[ptr]

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)


class _Saved:
    __slots__ = ("owner", "ptr", "tensor")

    def __init__(self, owner: SavedBytes, ptr: int, tensor: torch.Tensor):
        self.owner, self.ptr, self.tensor = owner, ptr, tensor

    def __del__(self):
        self.owner.release(self.ptr)


def memory_run(setup: Setup, label: str, blocks: dict | None) -> dict:
    a = setup.args
    if label == "baseline":  # the same stage, the same data and a group; no step
        stage = setup.stage(dist.get_rank())
        setup.new_group()
        setup.batches(0)
        dist.barrier(setup.world)
        del stage
        return {"rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "saved": 0, "blocks": None}
    variant = make_variant(setup, label, blocks)
    for step in range(a.mem_steps):
        dist.barrier(setup.world)
        variant.step(setup.batches(step))
        variant.finish()
    weights = [p for _, p in variant.named_params()] + [b for s in variant.stages.values() for b in s.buffers()]
    counter = SavedBytes(weights)
    dist.barrier(setup.world)
    with counter.hooks():
        variant.step(setup.batches(a.mem_steps))
    variant.finish()
    leftover = counter.now
    dist.barrier(setup.world)
    plan = getattr(variant, "plan", None)
    return {"rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "saved": counter.peak,
            "leftover": leftover, "blocks": plan["blocks"] if plan else None}


def report_part2(mem: dict, args) -> str:
    base = mem["baseline"]
    lines = ["== 2. peak memory per rank (each variant in a fresh pair of processes) ==",
             f"RSS - base = ru_maxrss of the run (after {args.mem_steps} + 1 steps) minus ru_maxrss of a run that only "
             "builds the same stage; includes allocator caching, gloo buffers and code pages touched by the first "
             "step.",
             "saved peak = most bytes autograd's saved tensors held at once during one step (saved-tensor hooks, "
             "unique storages, weights excluded): activations only; stashed stage inputs and receive buffers are "
             "not saved tensors, nor are the tensors a checkpointed block rebuilds inside backward.",
             f"baseline ru_maxrss: rank 0 {mib(base[0]['rss'])} MiB, rank 1 {mib(base[1]['rss'])} MiB", ""]
    header = (f"{'variant':<26} | {'RSS-base r0':>11} {'RSS-base r1':>11} | {'saved peak r0':>13} "
              f"{'saved peak r1':>13} | blocks recomputed")
    lines += [header + "", "-" * len(header)]
    for label in MEMORY[1:]:
        if label not in mem:
            continue
        r = mem[label]
        blocks = "-"
        if r[0]["blocks"] is not None:
            blocks = ", ".join(f"stage {s}: {k}" for rr in r for s, k in sorted((rr["blocks"] or {}).items()))
        lines.append(f"{label:<26} | {mib(r[0]['rss'] - base[0]['rss']):>11} {mib(r[1]['rss'] - base[1]['rss']):>11} "
                     f"| {mib(r[0]['saved']):>13} {mib(r[1]['saved']):>13} | {blocks}")
    leftover = max(rr.get("leftover", 0) for label in MEMORY[1:] if label in mem for rr in mem[label])
    lines += ["(MiB; saved bytes still held after the step: "
              f"{leftover} B, i.e. every graph was freed)", ""]
    return "\n".join(lines)
