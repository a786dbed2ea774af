"""Going on without lost ranks: `autopar train --on-rank-loss shrink` (preemptible, unequal peers).

On a cluster whose devices come and go (spot instances, shared hosts), a rank that is preempted or
dies should not end the job while other whole replicas of the model are still there. The launcher
(launch.py) stops every rank, and asks `ShrinkOnRankLoss` what to start instead:

- the world: the largest multiple of one replica's ranks (tp * pp * cp: whole replicas only) that
  the surviving devices hold and with which the run still resolves (the global batch still splits);
- which devices: the lost ranks' devices are dropped; beyond the whole replicas, the slowest survivors
  (by the --cluster file's device speeds; the highest slots first when all are alike) stay idle; the
  others keep their order, so new rank i runs on the i-th kept device (LOCAL_RANK = its slot);
- the layout: the run resumed from its newest complete checkpoint as `autopar train --resume RUN --nproc W`
  would (checkpoints reshard): a layout set by hand keeps tp, pp and cp and re-derives dp (the global batch
  is the run's, so the result still equals one process); a `--strategy auto` run searches again for W
  (elastic_plan.replan_on_resume; plan.json keeps earlier_plans and notes replanned);
- a mixed cluster: the plan sees the kept devices' own [[devices]] entries and links (RUN/cluster_change_K.toml,
  passed as --cluster), so `--dp-shares auto` and speed-balanced cuts are recomputed for the survivors.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

from .config import JobConfig, Strategy
from .data.shares import AUTO, EVEN
from .errors import ConfigError
from .launch import RankLoss, Relaunch
from .search.cluster import resolve_cluster
from .search.hetero_cluster import device_speed, surviving_cluster

FLAG = "--on-rank-loss shrink"
# args -> (the ranks' command, the strategy they resolve to): the CLI's own preparation of a start
RestartCommand = Callable[[list[str]], tuple[list[str], Strategy]]


def replica_ranks(strategy: Strategy, world: int) -> int:
    """Ranks one data-parallel replica spans (tp * pp * cp, or the stages' tp sum): world / dp."""
    return world // strategy.dp


def kept_devices(survivors: list[int], world: int, speeds: Callable[[int], float]) -> tuple[int, ...]:
    """The `world` devices, of the surviving device slots, that run on: the fastest (ties: the lower slot), in
    slot order."""
    fastest = sorted(survivors, key=lambda d: (-speeds(d), d))[:world]
    return tuple(sorted(fastest))


def check_can_shrink(job: JobConfig, strategy: Strategy, nproc: int) -> None:
    """Refuse, before any rank starts, a job that could not go on after losing a replica."""
    dp = strategy.dp
    if job.launch.max_restarts < 1:
        raise ConfigError(f"{FLAG} goes on with fewer ranks at most --max-restarts times, and --max-restarts is "
                          f"{job.launch.max_restarts}; add --max-restarts N (N >= 1: how many ranks may be lost)")
    if dp < 2:
        replica = replica_ranks(strategy, nproc)
        raise ConfigError(f"{FLAG} needs stage replicas to go on with (dp >= 2), and this layout has dp={dp} "
                          f"(tp={strategy.tp} pp={strategy.pp} cp={strategy.cp} on {nproc} ranks): losing any "
                          f"rank leaves no whole replica; use --nproc {2 * replica} (dp=2) or more, or "
                          f"--on-rank-loss restart")
    if job.train.checkpoint_interval == 0:
        raise ConfigError(f"{FLAG} resumes the smaller job from the run's newest checkpoint, and --checkpoint-every "
                          f"0 writes one only at the end or on a stop signal; use --checkpoint-every N (N > 0)")
    if job.strategy.replicas.shares not in (EVEN, AUTO):
        raise ConfigError(f"{FLAG} with --dp-shares {job.strategy.replicas.shares}: the weights are one per replica "
                          f"of {dp} and cannot follow a change of dp; use --dp-shares auto (speeds from the "
                          f"--cluster file, recomputed for the survivors) or even")
    # the layout resumed on fewer replicas must resolve for some count (the rules of a resumed run, the batch)
    from .strategies import resolve
    check = dataclasses.replace(strategy, dp=None, dp_shares=EVEN, cluster=None, search="manual", plan=None)
    resumed = dataclasses.replace(job.train, resume=job.train.out or "RUN")
    replica, refusals = replica_ranks(strategy, nproc), []
    for fewer in range(dp - 1, 0, -1):
        try:
            resolve(check, resumed, fewer * replica)
            return
        except ConfigError as exc:
            refusals.append(exc)
    raise ConfigError(f"{FLAG}: this job could not go on with fewer replicas; on {(dp - 1) * replica} ranks: "
                      f"{refusals[0]}")


class ShrinkOnRankLoss:
    """The launcher's `on_rank_loss` for `--on-rank-loss shrink`: the smaller world, its devices and command."""

    def __init__(self, job: JobConfig, strategy: Strategy, run_dir: str, restart_command: RestartCommand):
        check_can_shrink(job, strategy, job.launch.nproc)
        self.job, self.strategy, self.run_dir, self.restart_command = job, strategy, run_dir, restart_command
        spec = job.strategy.planning.cluster  # the devices the job started on, in rank order (device slots)
        self.cluster = resolve_cluster(spec) if spec else None
        self.described = self.cluster is not None and bool(self.cluster.devices or self.cluster.links)
        self.changes = 0

    def __call__(self, loss: RankLoss) -> Relaunch:
        if loss.resumes_from is None:
            raise ConfigError("no complete checkpoint yet to resume from; start the run again with fewer ranks "
                              "(--checkpoint-every N sooner lets a lost rank cost less)")
        replica = replica_ranks(self.strategy, loss.world)
        survivors = [d for r, d in enumerate(loss.devices) if r not in loss.lost]
        speeds = (lambda d: device_speed(self.cluster, d)) if self.described else (lambda d: 1.0)
        refused: list[str] = []
        for world in range(len(survivors) // replica * replica, 0, -replica):
            devices = kept_devices(survivors, world, speeds)
            try:
                command, strategy = self.restart_command(self._args(devices))
            except ConfigError as exc:
                refused.append(f"{world} ranks: {exc}")
                continue
            self.changes += 1
            self.strategy = strategy
            layout = {"dp": strategy.dp, "tp": strategy.tp, "pp": strategy.pp, "cp": strategy.cp}
            return Relaunch(command=command, devices=devices, record={"layout": layout},
                            says=" ".join(f"{k}={v}" for k, v in layout.items() if k == "dp" or v > 1))
        whole = f"the {len(survivors)} surviving rank(s) hold no whole replica of {replica} ranks"
        raise ConfigError("; ".join(refused) if refused else whole)

    def _args(self, devices: tuple[int, ...]) -> list[str]:
        """`autopar train --resume RUN --nproc W` for the kept devices (their own cluster entries, if described)."""
        args = ["train", "--resume", self.run_dir, "--nproc", str(len(devices))]
        if self.described:
            path = Path(self.run_dir) / f"cluster_change_{self.changes + 1}.toml"
            kept = surviving_cluster(self.cluster, devices)
            kept = kept.replace(name=f"{self.cluster.name}, devices {','.join(map(str, devices))}")
            path.write_text(kept.to_toml())
            args += ["--cluster", str(path)]
        if self.job.strategy.replicas.shares == AUTO:  # config.toml holds the weights auto gave the old replicas
            args += ["--dp-shares", AUTO]
        return args
