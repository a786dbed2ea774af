"""This machine's calibration, measured once and kept: what `--strategy auto` prices on without a --cluster.

The rough `cpu-local` figures are not this machine: a search priced on them picks layouts that run slower
than the default. So a search with no cluster given measures this machine the first time (calibrate.py over
the group sizes the search can form, and the step model's level from one small model's step, reference_step.py:
12-28 s at 4-8 ranks on 2 cores at load 15-48 before that level was added, ~2 s of CPU more) and keeps them,
one entry per

    calibration format, host name, CPU model, cores this process may use, GPU models, torch version, process count

under the cache folder ($AUTOPAR_CACHE_DIR, else $XDG_CACHE_HOME/autopar, else ~/.cache/autopar). The file is
named by a hash of that key and holds the key, so a changed machine, torch or process count reads as absent
and is measured again, and a folder shared between hosts (a network home) keeps one entry per host. An entry
that cannot be read is measured again with a warning. An entry measured under load (other jobs held more than
BUSY_SHARE of the cores: its figures are scaled to a quiet machine, machine_load.py) is measured again once the
machine is quiet (load average under the cores); one a run found far off (its measured step time more than
STALE_ERROR from the prediction: `mark_stale`) is measured again by the next search. `autopar calibrate --nproc N`
rewrites the entry;
`--cluster cpu-local` (or any preset or file; or $AUTOPAR_CLUSTER, its default) skips all of this.

Not measured, and priced on cpu-local instead, where measuring is wrong: inside the ranks of a running job
(each rank would measure its own figures and plans must agree; the same reason keeps the cached entry out:
hosts differ), with one process (no links to measure), with more ranks than max_ranks() unless
`autopar calibrate` wrote their entry, or when the measurement fails (the warning says why). Two searches
started at once measure once: the second waits on a lock file, then reads the entry.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import socket
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ..errors import AutoparError
from .cluster import Cluster, cluster_from_dict, preset, resolve_cluster, sized

FORMAT = 8  # bump when what is measured, or how, changes: entries of older formats are measured again
# (2: reduce-scatter and all-gather wall times per group size; 3: the reference step's level, time_shared_scale;
# 4: the sharing probe and the reference step scaled to a quiet machine, quickest round kept; 5: the reference
# priced with the update it runs, step_probe.reference_profile; 6: the reference initialised as GPT-2 is (its
# saturated start measured denormal arithmetic) and updated by the trainer's fused AdamW; 7: wait_idle_table;
# 8: the reference step's median round of five, not its quickest of three)
BUSY_SHARE = 0.25  # other jobs held more than this share of the cores while measuring: "under load"
STALE_ERROR = 0.30  # a run whose step time was further than this from its prediction marks the entry stale
CACHE_ENV = "AUTOPAR_CACHE_DIR"
CLUSTER_ENV = "AUTOPAR_CLUSTER"  # a preset or file to price on when --cluster is not given (cpu-local: never measure)


def max_ranks() -> int:
    """The most ranks measured without being asked: a few per core (8 on a small machine) keeps it in seconds."""
    return max(8, _cpus())


def cache_dir() -> Path:
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "autopar"


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _cpus() -> int:
    """The cores this process may run on (its affinity: a container's or taskset's limit), else the machine's."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _gpu_models() -> list[str]:
    """GPU models from the NVIDIA driver's /proc files: no CUDA context is created (the launcher forks later)."""
    root = Path("/proc/driver/nvidia/gpus")
    models = []
    try:
        for info in sorted(root.glob("*/information")):
            for line in info.read_text().splitlines():
                if line.startswith("Model:"):
                    models.append(line.split(":", 1)[1].strip())
    except OSError:
        pass
    return models


def cache_key(nproc: int) -> dict:
    """What the figures depend on: a change in any of it means measuring again."""
    import torch
    return {"format": FORMAT, "host": socket.gethostname(), "cpu": _cpu_model(), "cpus": _cpus(),
            "gpus": _gpu_models(), "torch": torch.__version__, "nproc": nproc}


def entry_path(nproc: int, key: dict | None = None) -> Path:
    key = key or cache_key(nproc)
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return cache_dir() / f"calibration-{nproc}-{digest}.json"


def _warn(message: str) -> None:
    print(f"autopar: warning: {message}", file=sys.stderr, flush=True)


def lookup(nproc: int) -> tuple[Cluster, dict] | None:
    """The cached figures for `nproc` ranks on this machine and this torch, with their record (_record); None if
    absent. An entry that is unreadable, of another key or not a valid cluster is reported and treated as absent.
    A stale entry (mark_stale) is returned with the record's `stale` saying why."""
    key = cache_key(nproc)
    path = entry_path(nproc, key)
    if not path.exists():
        return None
    try:
        entry = json.loads(path.read_text())
        if entry.get("key") != key:
            raise ValueError(f"it was measured for {entry.get('key')!r}, not {key!r}")
        cluster = cluster_from_dict(entry["cluster"])
        if not cluster.measured_at:
            raise ValueError("it has no measurement time")
    except (OSError, ValueError, KeyError, TypeError, AttributeError, AutoparError) as exc:
        _warn(f"calibration cache {path} cannot be used ({type(exc).__name__}: {exc}); measuring again")
        return None
    record = _record(cluster, path, entry.get("load"), entry.get("others_cores"))
    if entry.get("stale"):
        record["stale"] = entry["stale"]
    return cluster, record


def _record(cluster: Cluster, path: Path | None, load: float | None, others_cores: float | None = None) -> dict:
    """plan.json's search.calibration for this machine's figures: when, where kept, and the load they were
    measured under when other jobs held cores a quiet machine would give (`others_cores`, what the calibration
    saw; else, for entries without it, a load average above the cores)."""
    record = {"cluster": cluster.name, "measured_at": cluster.measured_at,
              "cache": str(path) if path else "not written"}
    busy = others_cores > BUSY_SHARE * _cpus() if others_cores is not None else load is not None and load > _cpus()
    if busy:
        record["busy"] = {"load": round(load, 1) if load is not None else None, "cores": _cpus(),
                          "nproc": cluster.num_devices}
        if others_cores is not None:
            record["busy"]["others_cores"] = round(others_cores, 1)
    return record


def store(cluster: Cluster, nproc: int, *, seconds: float | None = None, load: float | None = None,
          others_cores: float | None = None) -> Path:
    """Write `cluster` as this machine's entry for `nproc` ranks (atomically: a reader never sees half a file);
    `load`: the machine's load average when the measurement began; `others_cores`: the cores other jobs took
    while it measured (calibrate's details)."""
    key = cache_key(nproc)
    path = entry_path(nproc, key)
    path.parent.mkdir(parents=True, exist_ok=True)
    entry = {"key": key, "seconds": seconds, "load": load, "others_cores": others_cores, "cluster": cluster.to_dict()}
    _write(path, entry)
    return path


def _write(path: Path, entry: dict) -> None:
    partial = path.with_name(f".{path.name}.{os.getpid()}")
    partial.write_text(json.dumps(entry, indent=1) + "\n")
    os.replace(partial, path)


def mark_stale(record: dict | None, error: float, nproc: int) -> bool:
    """After a run priced on this machine's cached entry (`record`: plan.json's search.calibration) measured its
    step `error` away from the prediction (measured / predicted - 1) on `nproc` ranks: beyond STALE_ERROR, mark the
    entry stale so
    that the next search measures again. Only the entry that priced the run (same measurement time); True when
    marked. A run slower than predicted while other jobs load the machine (load average above the run's ranks
    plus the cores) says nothing of the quiet machine the figures describe: not marked. A cache that cannot be
    written is left as it is."""
    if not record or abs(error) <= STALE_ERROR or not record.get("measured_at"):
        return False
    load = _load()
    if error > 0 and load is not None and load > nproc + _cpus():
        return False
    path = Path(record.get("cache") or "")
    try:
        entry = json.loads(path.read_text())
        if entry["cluster"].get("measured_at") != record["measured_at"]:
            return False
        entry["stale"] = {"error": round(error, 3), "at": round(time.time(), 1)}
        _write(path, entry)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False
    return True


def measure(nproc: int, details: dict | None = None) -> Cluster:
    """This machine for `nproc` ranks, over the group sizes the search forms: the divisors of nproc (its dp, tp
    and pp groups) and 2 (a tied weight's two stages); every size is `autopar calibrate`'s. `details`: as
    calibrate's."""
    from .calibrate import calibrate
    return calibrate(nproc, group_sizes=[n for n in range(2, nproc + 1) if nproc % n == 0 or n == 2],
                     details=details)


def _inside_ranks() -> bool:
    import torch.distributed as dist
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


@contextmanager
def _locked(nproc: int) -> Iterator[None]:
    """Hold this machine's lock for `nproc` ranks (none where the folder or file locks are unavailable)."""
    try:
        cache_dir().mkdir(parents=True, exist_ok=True)
        handle = open(cache_dir() / f".calibration-{nproc}.lock", "w")
    except OSError:
        yield
        return
    with handle:
        try:
            import fcntl
            fcntl.flock(handle, fcntl.LOCK_EX)
        except (ImportError, OSError):
            pass
        yield


def _measured(nproc: int) -> tuple[tuple[Cluster, dict] | None, str | None]:
    """Measure now and keep it: ((cluster, its record), None), or (None, why not) when the measurement failed.
    A cache that cannot be written is reported, and the figures serve this search alone."""
    print(f"autopar: calibrating this machine for {nproc} ranks, once per machine, torch version and process count "
          f"(--cluster cpu-local skips it) ...", file=sys.stderr, flush=True)
    began, load, details = time.perf_counter(), _load(), {}
    try:
        cluster = measure(nproc, details)
    except (AutoparError, OSError, ValueError, KeyError) as exc:  # ranks that failed, or their output unreadable
        _warn(f"calibrating this machine failed ({exc}); pricing on the cpu-local preset")
        return None, f"the measurement failed: {exc}"
    try:
        path = store(cluster, nproc, seconds=time.perf_counter() - began, load=load,
                     others_cores=details.get("others_cores"))
    except OSError as exc:
        _warn(f"cannot write the calibration cache in {cache_dir()} ({exc}); the figures serve this search only "
              f"(set {CACHE_ENV} to a writable folder)")
        path = None
    print(f"autopar: calibrated in {time.perf_counter() - began:.0f} s (cache: {path})", file=sys.stderr, flush=True)
    return (cluster, _record(cluster, path, load, details.get("others_cores"))), None


def _load() -> float | None:
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def this_machine(nproc: int) -> tuple[Cluster, dict]:
    """This machine's figures for `nproc` ranks (cached, or measured now and cached), and the record saying
    which; cpu-local where measuring is wrong (see the module docstring), the record saying why."""
    reason = None
    if _inside_ranks():
        reason = "searched inside the ranks; search before they start (autopar train, autopar.plan_auto) to measure"
    elif nproc < 2:
        reason = "one process has no links to measure"
    if reason is None:
        with _locked(nproc):  # two searches started at once: one measures, the other then reads its entry
            found = lookup(nproc)
            again = _measure_again(found[1]) if found is not None and nproc <= max_ranks() else None
            if again is not None:
                print(f"autopar: {again}; measuring again", file=sys.stderr, flush=True)
                found = None
            if found is None and nproc > max_ranks():  # an entry `autopar calibrate --nproc N` wrote is used
                reason = (f"{nproc} ranks is more than this machine measures without being asked ({max_ranks()}); "
                          f"run `autopar calibrate --nproc {nproc}` once")
            elif found is None:
                found, reason = _measured(nproc)
                if found is not None and again is not None:
                    found[1]["remeasured"] = again
        if found is not None:
            return found
    return preset("cpu-local"), {"cluster": "cpu-local", "preset": True, "not_measured": reason}


def _measure_again(record: dict) -> str | None:
    """Why a cached entry is measured again rather than used (None: use it): a run found it far off, or it was
    measured under load and the machine is quiet now."""
    stale = record.get("stale")
    if stale:
        return (f"the cached calibration ({record.get('cache')}) predicted a run's step time "
                f"{stale.get('error', 0):+.0%} off")
    busy, now = record.get("busy"), _load()
    if busy and now is not None and now < _cpus():
        held = (f"other jobs held {busy['others_cores']:g} of {busy['cores']} cores" if "others_cores" in busy else
                f"load {busy.get('load')}")
        return f"the cached calibration was measured under load ({held}) and the machine is quiet now (load {now:.1f})"
    return None


def search_cluster(spec: str | None, *, nproc: int, memory_per_device_gb: float | None = None
                   ) -> tuple[Cluster, dict]:
    """The cluster a search for `nproc` processes prices on, resized as resolve_cluster does, with the record
    (plan.json's search.calibration) that says which calibration it is: the preset or file given, else this
    machine (this_machine). $AUTOPAR_CLUSTER, when set, stands for a --cluster not given."""
    given_by = "--cluster" if spec else None
    if not spec and os.environ.get(CLUSTER_ENV):
        spec, given_by = os.environ[CLUSTER_ENV], CLUSTER_ENV
    if spec:
        cluster = resolve_cluster(spec, nproc=nproc, memory_per_device_gb=memory_per_device_gb)
        if cluster.measured_at:
            record = {"cluster": cluster.name, "measured_at": cluster.measured_at, "file": spec}
        elif spec == cluster.name:
            record = {"cluster": cluster.name, "preset": True}
        else:
            record = {"cluster": cluster.name, "file": spec}
        return cluster, {**record, "given_by": given_by}
    cluster, record = this_machine(nproc)
    return sized(cluster, nproc=nproc, memory_per_device_gb=memory_per_device_gb), record


def age(seconds: float) -> str:
    if seconds < 60:
        return "just now"
    if seconds < 3600:
        return f"{seconds / 60:.0f} min ago"
    if seconds < 48 * 3600:
        return f"{seconds / 3600:.0f} h ago"
    return f"{seconds / 86400:.0f} days ago"


def note(record: dict | None, now: float | None = None) -> str | None:
    """The banner's words for a search.calibration record: which calibration, and how old."""
    if not record:
        return None
    now = time.time() if now is None else now
    if record.get("measured_at"):
        when = age(max(0.0, now - record["measured_at"]))
        if record.get("cache"):
            text = f"calibrated on this machine {when} (cache: {record['cache']})"
            busy = record.get("busy")
            if busy and "others_cores" in busy:
                text += (f", under load (other jobs held {busy['others_cores']:g} of {busy['cores']} cores; figures "
                         f"scaled to a quiet machine; measured again once it is quiet)")
            elif busy:
                text += (f", while busy (load {busy['load']:g} on {busy['cores']} cores; `autopar calibrate --nproc "
                         f"{busy['nproc']}` measures again)")
            if record.get("remeasured"):
                text += f"; re-measured: {record['remeasured']}"
            return text
        text = f"calibrated {when} (file: {record.get('file')})"
    elif record.get("preset"):
        why = record.get("not_measured")
        measured = "datasheet figures" if record["cluster"] != "cpu-local" else "not measured"
        text = f"preset {record['cluster']} ({measured}{': ' + why if why else ''})"
    else:
        text = f"cluster file {record.get('file')} (not measured here)"
    return text + (f", from ${CLUSTER_ENV}" if record.get("given_by") == CLUSTER_ENV else "")
