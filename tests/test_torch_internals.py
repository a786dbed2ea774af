"""Every private torch API autopar uses lives in autopar/_torch_internals.py, and each one still exists.

The first part touches each function of that module on this torch and fails naming the private API
that is gone (the fallback would then run silently: slower, or a feature refused). The second part
reads src/ and fails naming file:line where a private torch name is used outside that module.
"""

from __future__ import annotations

import ast
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from autopar import _torch_internals as ti

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "autopar"


@pytest.fixture(scope="module")
def world_of_one():
    """A gloo world of one in this process (put back as found)."""
    if dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _present(path: str) -> bool:
    """Whether a dotted torch name resolves ('torch.utils._pytree.tree_leaves', 'torch.Tensor._version')."""
    parts = path.split(".")
    obj = None
    for i in range(len(parts), 0, -1):  # the longest importable module prefix, then attributes
        try:
            obj = __import__(".".join(parts[:i]), fromlist=["_"])
        except ImportError:
            continue
        rest = parts[i:]
        break
    for name in rest:
        if not hasattr(obj, name):
            return False
        obj = getattr(obj, name)
    return True


def _need(*paths: str) -> None:
    missing = [p for p in paths if not _present(p)]
    assert not missing, f"this torch lacks {', '.join(missing)}"


# ------------------------------------------------------------------ one touch per function

def touch_backend_options():
    _need("torch.distributed.ProcessGroupGloo._Options")
    options = ti.backend_options("gloo", 12.0)
    assert options is not None and options._timeout == timedelta(seconds=12), "Options._timeout is gone"


def touch_tcp_store():
    _need("torch.distributed.rendezvous._create_c10d_store")
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    store = ti.tcp_store("127.0.0.1", port, 0, 1, timedelta(seconds=10))
    store.set("k", "v")
    assert store.get("k") == b"v"


def touch_registered_process_groups():
    _need("torch.distributed.distributed_c10d._world")
    group = dist.new_group([0])
    try:
        groups = ti.registered_process_groups()
        assert dist.group.WORLD in groups and group in groups, "distributed_c10d._world.pg_map lists no groups"
    finally:
        dist.destroy_process_group(group)


def touch_default_store():
    _need("torch.distributed.distributed_c10d._get_default_store")
    store = ti.default_store()
    assert store is not None, "_get_default_store() gave nothing in an initialised world"
    store.set("internals", "1")
    assert store.get("internals") == b"1"


def touch_work_source_rank():
    _need("torch.distributed.Work._source_rank")
    work = dist.all_reduce(torch.ones(1), async_op=True)
    work.wait()
    assert ti.work_source_rank(work) is None  # not a receive: torch raises, the wrapper says None


def touch_clear_dtensor_caches():
    _need("torch.distributed.tensor._redistribute._gen_transform_infos",
          "torch.distributed.tensor._redistribute.clear_redistribute_planner_cache",
          "torch.distributed.tensor.debug._clear_sharding_prop_cache")
    ti.clear_dtensor_caches()


def touch_in_backward():
    _need("torch._C._current_autograd_node")
    seen = []
    x = torch.ones(2, requires_grad=True)
    y = x * 2
    y.register_hook(lambda g: seen.append(ti.in_backward()))
    assert not ti.in_backward()
    y.sum().backward()
    assert seen == [True], "_current_autograd_node() is None inside backward"


def touch_in_checkpointed_region():
    _need("torch._C._autograd._top_saved_tensors_default_hooks")
    import torch.utils.checkpoint
    seen = []

    def inside(x):
        seen.append(ti.in_checkpointed_region())
        return x.sin()

    torch.utils.checkpoint.checkpoint(inside, torch.ones(2, requires_grad=True), use_reentrant=False)
    assert seen[:1] == [True] and not ti.in_checkpointed_region(), \
        "checkpoint's saved-tensor hooks are no longer named _checkpoint_hook"


def touch_accumulate_grad_type():
    _need("torch._C._functions.AccumulateGrad")
    assert ti.accumulate_grad_type() is ti._accumulate_grad_by_graph()


def touch_input_metadata():
    x = torch.ones(3, requires_grad=True)
    node = (x * 2).grad_fn
    assert hasattr(node, "_input_metadata"), "autograd nodes lost _input_metadata"
    meta = ti.input_metadata(node)[0]
    assert tuple(meta.shape) == (3,) and meta.dtype == torch.float32


def touch_saved():
    """The names split backward reads (pipeline/split_backward.py), on the nodes it reads them from."""
    x, w, b = (torch.randn(2, 3, requires_grad=True), torch.randn(3, 4, requires_grad=True),
               torch.randn(4, requires_grad=True))
    addmm = torch.addmm(b, x, w).grad_fn
    mm = (x @ w).grad_fn
    norm = nn.functional.layer_norm(x, (3,), torch.ones(3, requires_grad=True),
                                    torch.zeros(3, requires_grad=True)).grad_fn
    cases = [(addmm, "AddmmBackward0", ("alpha", "beta", "mat1", "mat2")), (mm, "MmBackward0", ("self", "mat2")),
             (norm, "NativeLayerNormBackward0",
              ("input", "normalized_shape", "result1", "result2", "weight", "bias"))]
    for node, kind, names in cases:
        assert type(node).__name__ == kind, f"{kind} is now {type(node).__name__}"
        missing = [n for n in names if not hasattr(node, "_saved_" + n)]
        assert not missing, f"{kind} no longer saves {missing}"
    assert ti.saved(addmm, "mat2") is w or torch.equal(ti.saved(addmm, "mat2"), w)


def touch_engine_grad():
    _need("torch.autograd.graph._engine_run_backward")
    x = torch.randn(3, requires_grad=True)
    y = x.square()
    (g,) = ti.engine_grad([y], [torch.ones(3)], [x])
    assert torch.equal(g, 2 * x.detach())


def touch_engine_backward():
    _need("torch.autograd.graph._engine_run_backward")
    x = torch.randn(3, requires_grad=True)
    ti.engine_backward([x.square()], [torch.ones(3)], [x])
    assert torch.equal(x.grad, 2 * x.detach())


def touch_tensor_version():
    t = torch.zeros(2)
    before = ti.tensor_version(t)
    t.add_(1)
    assert ti.tensor_version(t) == before + 1


def touch_parameter_table():
    lin = nn.Linear(2, 2)
    plain = torch.zeros(2, 2)
    ti.parameter_table(lin)["weight"] = plain
    assert lin.weight is plain, "Module._parameters no longer backs attribute lookup"


def touch_own_parameter_table():
    import copy
    lin = nn.Linear(2, 2)
    view = copy.copy(lin)
    view.__dict__ = dict(lin.__dict__)
    ti.own_parameter_table(view)
    ti.parameter_table(view)["weight"] = nn.Parameter(torch.zeros(1, 2))
    assert view.weight.shape == (1, 2) and lin.weight.shape == (2, 2), "a shallow copy's slots are still shared"


def touch_buffer_table():
    norm = nn.BatchNorm1d(2)
    fresh = torch.ones(2)
    ti.buffer_table(norm)["running_mean"] = fresh
    assert norm.running_mean is fresh and "running_mean" in norm.state_dict()


def touch_private_reset():
    assert ti.private_reset(nn.MultiheadAttention(4, 2)) is not None, "MultiheadAttention lost _reset_parameters"
    assert ti.private_reset(nn.Linear(2, 2)) is None


def touch_foreach_norm():
    _need("torch._foreach_norm")
    tensors = [torch.randn(3), torch.randn(2, 2)]
    assert all(torch.allclose(a, torch.linalg.vector_norm(t)) for a, t in zip(ti.foreach_norm(tensors), tensors))


def touch_foreach_copy_():
    _need("torch._foreach_copy_")
    targets, sources = [torch.zeros(2), torch.zeros(3)], [torch.ones(2), torch.full((3,), 2.0)]
    ti.foreach_copy_(targets, sources)
    assert all(torch.equal(t, s) for t, s in zip(targets, sources))


def touch_safe_softmax():
    _need("torch.ops.aten._safe_softmax")
    scores = torch.tensor([[0.0, 1.0], [float("-inf"), float("-inf")]])
    assert torch.equal(ti.safe_softmax(scores, -1)[1], torch.zeros(2))


def touch_op_schema():
    schema = ti.op_schema(torch.ops.aten.add_.Tensor)
    assert schema is not None, "OpOverload._schema is gone"
    assert schema.name == "aten::add_" and schema.arguments[0].alias_info.is_write


def touch_decomposes():
    _need("torch._C.DispatchKey.CompositeImplicitAutograd")
    assert ti.decomposes(torch.ops.aten.linear.default), "aten.linear (a composite) is not seen as one"
    assert not ti.decomposes(torch.ops.aten.addmm.default), "aten.addmm (a kernel) is seen as a composite"
    assert not ti.decomposes(torch.ops.aten.add.Tensor), "aten.add (a kernel) is seen as a composite"


def touch_dispatch_mode_base():
    base = ti.dispatch_mode_base()
    assert base is not None, "torch.utils._python_dispatch.TorchDispatchMode is gone"
    seen = []

    class Record(base):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    with Record():
        torch.ones(2) + 1
    assert torch.ops.aten.add.Tensor in seen


def touch_fake_tensor_mode():
    mode = ti.fake_tensor_mode()
    assert mode is not None, "torch._subclasses.fake_tensor.FakeTensorMode is gone"
    with mode:
        t = torch.empty(1000, 1000)
    assert type(t).__name__ == "FakeTensor"


def touch_tree_leaves():
    _need("torch.utils._pytree.tree_leaves")
    assert ti.tree_leaves({"a": (1, [2, 3]), "b": 4}) == [1, 2, 3, 4]


def touch_tree_unflatten():
    _need("torch.utils._pytree.tree_flatten", "torch.utils._pytree.tree_unflatten")
    from torch.utils._pytree import tree_flatten
    tree = {"a": (1, [2, 3]), "b": 4}
    leaves, spec = tree_flatten(tree)
    assert ti.tree_unflatten(iter(leaves), spec) == tree


def touch_fsdp_unsharded_tensors():
    from torch.distributed.fsdp import FSDPModule, fully_shard
    _need("torch.distributed.fsdp.FSDPModule._get_fsdp_state")
    model = nn.Sequential(nn.Linear(4, 4))
    fully_shard(model)
    assert isinstance(model, FSDPModule)
    model(torch.randn(2, 4))
    group = model._get_fsdp_state()._fsdp_param_group
    assert group is not None and all(hasattr(fp, "_unsharded_inner_tensors") for fp in group.fsdp_params), \
        "FSDP2's param group or FSDPParam._unsharded_inner_tensors is gone"
    assert ti.fsdp_unsharded_tensors(model), "no FSDP2 gathered tensors found"


def touch_is_fx_generated():
    graph = torch.fx.symbolic_trace(nn.Linear(2, 2))
    assert ti.is_fx_generated(graph.forward.__code__.co_filename), \
        f"torch.fx now names its generated code {graph.forward.__code__.co_filename!r}"
    assert not ti.is_fx_generated(__file__)


def touch_compile_counters():
    _need("torch._dynamo.utils.counters", "torch._dynamo.utils.calculate_time_spent")
    before = ti.compile_counters()
    assert set(before) == {"frames", "graph_breaks", "cache_hits", "cache_misses", "seconds"}
    torch.compile(lambda x: x + 1, backend="eager")(torch.ones(2))
    assert ti.compile_counters()["frames"] == before["frames"] + 1, "dynamo's frame counter did not move"


def touch_allow_compiled_regions():
    _need("torch._dynamo.config.recompile_limit")
    from torch._dynamo import config
    before = config.recompile_limit
    try:
        ti.allow_compiled_regions(before)
        assert config.recompile_limit == 2 * before, "torch._dynamo.config.recompile_limit is not read back"
    finally:
        config.recompile_limit = before


TOUCHES = {name[len("touch_"):]: fn for name, fn in dict(globals()).items() if name.startswith("touch_")}


def test_every_wrapped_api_has_a_touch():
    assert set(TOUCHES) == set(ti.APIS), (f"untouched: {sorted(set(ti.APIS) - set(TOUCHES))}; "
                                          f"stale touches: {sorted(set(TOUCHES) - set(ti.APIS))}")


@pytest.mark.parametrize("name", sorted(ti.APIS))
def test_private_api_is_there(name, world_of_one):
    api = ti.APIS[name]
    try:
        TOUCHES[name]()
        failure = None
    except AssertionError as exc:
        failure = str(exc).splitlines()[0]
    if failure:
        pytest.fail(f"{api.private}, wrapped by autopar/_torch_internals.py:{name} (checked on torch "
                    f"{', '.join(api.checked_on)}), is gone or changed on torch {torch.__version__}: {failure}. "
                    f"autopar now runs its fallback ({api.fallback}): update the module and the torch range "
                    f"in pyproject.toml", pytrace=False)


def test_fallbacks_agree_with_the_private_calls():
    """The public fallbacks give what the private calls give (they run where torch lacks the private name)."""
    scores = torch.tensor([[0.5, -1.0, float("-inf")], [float("-inf")] * 3])
    fallback = torch.softmax(scores, -1).masked_fill(scores.isneginf().all(-1, keepdim=True), 0.0)
    assert torch.equal(ti.safe_softmax(scores, -1), fallback)
    tensors = [torch.randn(5), torch.randn(2, 3)]
    assert all(torch.equal(a, torch.linalg.vector_norm(t)) for a, t in zip(ti.foreach_norm(tensors), tensors))


# ------------------------------------------------------------------ nothing else in src/ touches a private name

# Underscore names of other libraries, not torch: namedtuple's, sys' and os' own, and transformers'
# model initialiser convention.
NOT_TORCH = {"_asdict", "_current_frames", "_exit", "_init_weights"}
# torch members autopar may also use as its own attribute names: always torch's on a foreign object.
TORCH_MEMBERS = {"_parameters", "_buffers", "_modules", "_version", "_input_metadata", "_schema", "_timeout",
                 "_forward_hooks", "_backward_hooks", "_forward_pre_hooks", "_backward_pre_hooks", "_base"}
ACCESSORS = {"getattr", "hasattr", "setattr", "delattr"}


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def autopar_private_names(trees: list[ast.Module]) -> set[str]:
    """Underscore names autopar defines itself: functions, classes, `self._x` attributes, module/class globals."""
    ours: set[str] = set()
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                ours.add(node.name)
            elif (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
                  and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                ours.add(node.attr)
            if isinstance(node, (ast.Module, ast.ClassDef)):
                for statement in node.body:
                    targets = (statement.targets if isinstance(statement, ast.Assign) else
                               [statement.target] if isinstance(statement, ast.AnnAssign) else [])
                    ours |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
    return {n for n in ours if _private(n)} - TORCH_MEMBERS


def private_torch_uses(tree: ast.Module, ours: set[str]) -> list[tuple[int, str]]:
    """(line, what) for each private torch name `tree` uses: an import of a private torch module or name,
    `obj._name` or getattr(obj, "_name") of a name autopar does not define. aten operator identifiers
    (`aten._to_copy.default`, the traced graph's own vocabulary, matched by identity) are not uses."""
    def foreign(name: str) -> bool:
        return _private(name) and name not in NOT_TORCH and (name not in ours or name.startswith("_saved_"))

    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "torch":
            if any(map(_private, node.module.split("."))) or any(_private(a.name) for a in node.names):
                found.append((node.lineno, f"from {node.module} import {', '.join(a.name for a in node.names)}"))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, f"import {a.name}") for a in node.names
                      if a.name.split(".")[0] == "torch" and any(map(_private, a.name.split(".")))]
        elif isinstance(node, ast.Attribute) and foreign(node.attr):
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls", "aten"):
                continue
            found.append((node.lineno, ast.unparse(node)))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ACCESSORS
              and len(node.args) > 1 and isinstance(node.args[1], ast.Constant)
              and isinstance(node.args[1].value, str) and foreign(node.args[1].value)):
            found.append((node.lineno, ast.unparse(node)))
    return found


def _scan(root: Path) -> list[str]:
    files = sorted(p for p in root.rglob("*.py") if p.name != "_torch_internals.py")
    trees = {p: ast.parse(p.read_text(), str(p)) for p in files}
    ours = autopar_private_names(list(trees.values()))
    return [f"{p.relative_to(root.parent.parent)}:{line}: {what}"
            for p, tree in trees.items() for line, what in sorted(private_torch_uses(tree, ours))]


def test_no_private_torch_name_outside_the_internals_module():
    uses = _scan(SRC)
    assert not uses, ("private torch APIs used outside src/autopar/_torch_internals.py (wrap each there, with its "
                      "fallback and the versions it was checked on):\n" + "\n".join(uses))


def test_the_scan_finds_each_kind_of_use():
    """The scan above is not vacuous: each way of reaching a private torch name is reported."""
    code = """
import torch
import torch._dynamo
from torch.utils._pytree import tree_leaves
from torch.distributed.distributed_c10d import _get_default_store
aten = torch.ops.aten


class Ours:
    def __init__(self):
        self._cache = {}
        self._version = 0

    def step(self, module, node, op, t, other):
        self._cache.clear()
        other._cache.clear()
        norms = torch._foreach_norm([t])
        module._parameters["w"] = t
        bias = node._saved_bias
        schema = getattr(op, "_schema", None)
        matched = op is aten._to_copy.default
        return t._version, self._version
"""
    tree = ast.parse(code)
    found = sorted(what for _, what in private_torch_uses(tree, autopar_private_names([tree])))
    assert found == sorted(["import torch._dynamo", "from torch.utils._pytree import tree_leaves",
                     "from torch.distributed.distributed_c10d import _get_default_store", "torch._foreach_norm",
                     "module._parameters", "node._saved_bias", "getattr(op, '_schema', None)", "t._version"]), found
