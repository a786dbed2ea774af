"""What to suggest when dp x tp x pp does not fill the processes.

A suggestion the next check would refuse is worse than none, so the numbers alone only ever suggest
what holds for any model: every process a data-parallel replica (dp = nproc, tp = pp = 1), or a process
count the given tp x pp fills. Splitting a model over tp or pp ranks depends on its heads, width,
vocabulary and blocks; suggestions of that kind come from `layouts` the caller has checked on the traced
model (`autopar train` does, before any process starts: preflight.layouts_for).
"""

from __future__ import annotations

from collections.abc import Sequence

from ..errors import ConfigError

MAX_SUGGESTIONS = 4


class DegreesDoNotFit(ConfigError):
    """dp * tp * pp differs from the number of processes; carries the values so a caller that knows the
    model can say which layouts would run it."""

    def __init__(self, world: int, dp: int | None, tp: int, pp: int,
                 layouts: Sequence[tuple[int, int, int]] | None = None, model: str | None = None):
        self.world, self.dp, self.tp, self.pp = world, dp, tp, pp
        super().__init__(degrees_message(world, dp, tp, pp, layouts, model))


def factorisations(world: int) -> list[tuple[int, int, int]]:
    """Every (dp, tp, pp) whose product is `world`."""
    return [(world // (tp * pp), tp, pp) for tp in range(1, world + 1) if world % tp == 0
            for pp in range(1, world // tp + 1) if (world // tp) % pp == 0]


def closest_first(layouts: Sequence[tuple[int, int, int]], tp: int, pp: int) -> list[tuple[int, int, int]]:
    """Layouts that keep the typed tp or pp first, then the ones nearest to them."""
    return sorted(layouts, key=lambda l: (l[1] != tp and l[2] != pp, abs(l[1] - tp) + abs(l[2] - pp), l[1], l[2]))


def degrees_message(world: int, dp: int | None, tp: int, pp: int,
                    layouts: Sequence[tuple[int, int, int]] | None = None, model: str | None = None) -> str:
    seen = (f"dp*tp*pp = {dp if dp is not None else '?'}*{tp}*{pp} does not equal the number of processes "
            f"({world})")
    if layouts is not None:  # checked on the model: only layouts it runs
        return f"{seen}; {layouts_text(layouts, world, tp, pp, model)}"
    if world % (tp * pp) == 0:  # only dp is wrong: leaving it unset fills the rest
        return (f"{seen}; use dp={world // (tp * pp)} tp={tp} pp={pp} (leave --dp unset to fill the processes), "
                f"or change --nproc")
    return (f"{seen}; tp*pp = {tp * pp} does not divide {world}: use dp={world} tp=1 pp=1 (data parallelism "
            f"runs any model), degrees whose product is {world} that divide the model's heads and blocks, or a "
            f"--nproc that is a multiple of {tp * pp}")


def layouts_text(layouts: Sequence[tuple[int, int, int]], world: int, tp: int, pp: int, model: str | None) -> str:
    """The layouts a model runs on `world` processes (checked by the caller), nearest to tp and pp first."""
    if not layouts:
        return f"no layout of {model or 'this model'} fills {world} processes: change --nproc"
    shown = ", ".join(f"dp={d} tp={t} pp={p}" for d, t, p in closest_first(layouts, tp, pp)[:MAX_SUGGESTIONS])
    return f"{model or 'this model'} runs on {world} processes as {shown}"
