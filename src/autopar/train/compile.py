"""--compile: torch.compile per repeated block (regional compilation), its cache folder, and its account.

Why per block, not the whole model: a transformer is n copies of one block, so the compiler's work
is one block's graph (inductor's cache serves the other n - 1 from the first), the code outside
the blocks (embeddings, loss, the engine's hooks and collectives) stays eager and debuggable, and
each engine keeps the module it drives: a compiled block replaces only its `forward`, so its
parameters, names, state_dict and the hooks engines put on modules (FSDP2's, BatchNorm recording)
are untouched. A pipeline stage's pieces (one traced graph per block) are compiled the same way
(pipeline/engine.py); their backward runs through AOTAutograd's compiled graph. The optimizer update
is not compiled: --compile runs it as torch's fused kernel (train/optim.py), faster than inductor's
compiled step and with no compile time.

Equal to eager within fp32 tolerance, not bitwise: the compiler fuses element-wise chains and may
reassociate reductions (layer norm, softmax sums), a few ulps per op. Dropout masks are exact: the
per-sample keys are one custom operator reading the step and the dropout's number at run time
(dropout/compiled.py: with the number a constant, each block with dropout would be a graph of its own), and the
per-element hash is integer arithmetic, which fusion cannot change.

Compile time is paid in the first steps of a run and cached across runs in inductor's folder under
autopar's cache folder ($AUTOPAR_CACHE_DIR, else $XDG_CACHE_HOME/autopar, else ~/.cache/autopar),
unless TORCHINDUCTOR_CACHE_DIR is set. What torch.compile did (graph breaks, with torch's reason,
reported once; frames compiled after the first step, i.e. recompilations; compile seconds; cache
hits) is counted by `CompileAccount` for the banner, metrics.jsonl and summary.json.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .._torch_internals import allow_compiled_regions, compile_counters
from ..dropout import compiled_region

INDUCTOR_CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"


def inductor_cache_dir() -> Path:
    """Where compiled kernels are kept between runs: the user's choice for inductor, else autopar's cache."""
    if os.environ.get(INDUCTOR_CACHE_ENV):
        return Path(os.environ[INDUCTOR_CACHE_ENV])
    if os.environ.get("AUTOPAR_CACHE_DIR"):
        base = Path(os.environ["AUTOPAR_CACHE_DIR"])
    else:
        base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "autopar"
    return base / "inductor"


def use_inductor_cache() -> Path:
    """Point inductor at its folder (read when it first compiles, so set before any compilation)."""
    folder = inductor_cache_dir()
    os.environ[INDUCTOR_CACHE_ENV] = str(folder)
    return folder


def repeated_blocks(module: nn.Module, prefix: str = "") -> list[tuple[str, nn.Module]]:
    """The outermost runs of repeated blocks: children of a ModuleList / Sequential that are all of one
    class (at least two of them). A model without any is one region: itself."""
    found: list[tuple[str, nn.Module]] = []
    for name, child in module.named_children():
        path = f"{prefix}{name}"
        children = list(child.children()) if isinstance(child, (nn.ModuleList, nn.Sequential)) else []
        if len(children) >= 2 and len({type(c) for c in children}) == 1:
            found += [(f"{path}.{n}", c) for n, c in child.named_children()]
        else:
            found += repeated_blocks(child, f"{path}.")
    if not prefix and not found:
        return [("(whole model)", module)]
    return found


def compile_forward(module: nn.Module, backend: str = "inductor") -> None:
    """The module's forward, compiled; hooks, parameters and names stay the module's own. Its dropouts are numbered
    when it runs (dropout.compiled_region), so every copy of a block compiles to the same graph."""
    module.forward = compiled_region(torch.compile(module.forward, backend=backend))


def compile_regions(regions: list[tuple[str, nn.Module]], backend: str = "inductor") -> list[str]:
    """Compile each region's forward; returns their names (for the banner)."""
    allow_compiled_regions(len(regions))
    for _, module in regions:
        compile_forward(module, backend)
    return [name for name, _ in regions]


class CompileAccount:
    """What torch.compile did in this run: counted from the process's compiler counters, reported in the
    banner, every metrics record (recompilations, graph breaks) and summary.json."""

    def __init__(self, regions: list[str], cache_dir: Path):
        self.regions, self.cache_dir = regions, cache_dir
        self.optimizer_kernel = "foreach"  # "fused" once the trainer built a fused update (train/optim.py)
        self.start = compile_counters()
        self.after_first: dict[str, Any] | None = None  # counters at the end of the first step that compiled
        self.breaks_reported = False

    def _since_start(self) -> dict[str, Any]:
        now = compile_counters()
        if not now:
            return {}
        breaks = {reason: count - self.start["graph_breaks"].get(reason, 0)
                  for reason, count in now["graph_breaks"].items()}
        return {**{k: now[k] - self.start[k] for k in ("frames", "cache_hits", "cache_misses", "seconds")},
                "graph_breaks": {r: c for r, c in breaks.items() if c > 0}}

    def step_fields(self) -> dict[str, Any]:
        """Fields of a step's metrics record: recompilations (frames compiled after the first step that
        compiled: a changed shape or mode; the first evaluation compiles the eval forward once), graph
        breaks and compile seconds so far. A whole model's first step runs eagerly when its dropout is
        checked op by op (dropout/__init__.py), so its regions compile in the second."""
        now = self._since_start()
        if not now:
            return {}
        if self.after_first is None and now["frames"]:  # (the run's first step is eager: dropout/__init__.py)
            self.after_first = now
        first = self.after_first or now
        return {"compile_recompiles": now["frames"] - first["frames"],
                "compile_graph_breaks": sum(now["graph_breaks"].values()),
                "compile_s": round(now["seconds"], 3)}

    def graph_break_report(self) -> str | None:
        """Once per run: where the compiled regions were broken into pieces, with torch's explanation."""
        if self.breaks_reported:
            return None
        breaks = self._since_start().get("graph_breaks", {})
        if not breaks:
            return None
        self.breaks_reported = True
        lines = [f"--compile: {sum(breaks.values())} graph break(s) (the region runs as several graphs, with "
                 f"eager code between them):"]
        lines += [f"  {count}x {_first_line(reason)}" for reason, count in sorted(breaks.items(), key=lambda x: -x[1])]
        return "\n".join(lines)

    def banner_line(self) -> str:
        names = self.regions if len(self.regions) <= 4 else [*self.regions[:2], "...", self.regions[-1]]
        update = "one fused kernel" if self.optimizer_kernel == "fused" else "foreach (no fused kernel here)"
        return (f"compile: torch.compile per block, {len(self.regions)} region(s) ({', '.join(names)}); "
                f"compiled in the first steps, kernels cached in {self.cache_dir}; optimizer update: {update}")

    def summary(self) -> dict[str, Any]:
        now = self._since_start()
        first = self.after_first or now
        return {"regions": len(self.regions), "optimizer_kernel": self.optimizer_kernel, "compile_s": round(now.get("seconds", 0.0), 3),
                "cache_dir": str(self.cache_dir), "cache_hits": now.get("cache_hits", 0),
                "cache_misses": now.get("cache_misses", 0),
                "recompiles": now.get("frames", 0) - first.get("frames", 0),
                "graph_breaks": {_first_line(r): c for r, c in now.get("graph_breaks", {}).items()}}


def _first_line(reason: str) -> str:
    """torch's graph-break text summarised: its headline and its explanation."""
    lines = [line.strip() for line in reason.splitlines() if line.strip()]
    explanation = next((line for line in lines if line.startswith("Explanation:")), "")
    return " ".join(filter(None, [lines[0] if lines else reason, explanation]))[:300]
