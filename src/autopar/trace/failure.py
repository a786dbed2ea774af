"""Where in the user's model a failure happened: the graph node, its module path and source line.

A traced model runs as generated code (torch.fx writes one Python function per graph piece), so
the traceback of an op that fails at run time ends in lines like `index = torch.ops.aten.index...`,
far from the user's code. Every graph node keeps what tracing recorded about it: the module it ran
in (`nn_module_stack`) and the user's source lines (`stack_trace`). From a traceback we find the
generated line that failed, hence the node, hence the user's construct; failing that, the
innermost frame of the user's own code (outside torch and autopar), and the module it belongs to.
"""

from __future__ import annotations

import linecache
import os
import re
import sysconfig
import types
from typing import Any

import torch
from torch import fx, nn

from .._torch_internals import is_fx_generated

_ASSIGNED = re.compile(r"^\s*([A-Za-z_]\w*)\s*(?::[^=]*)?=")
_TORCH = os.path.dirname(torch.__file__) + os.sep
_STDLIB = sysconfig.get_paths()["stdlib"] + os.sep
_AUTOPAR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def _is_library(path: str) -> bool:
    """torch, autopar, Python's own modules or generated code: not the model's (transformers' files are)."""
    in_stdlib = path.startswith(_STDLIB) and not any(d in path for d in ("site-packages", "dist-packages"))
    return in_stdlib or path.startswith((_TORCH, _AUTOPAR, "<"))


def _frames(tb: types.TracebackType | None) -> list[tuple[types.FrameType, int]]:
    found = []
    while tb is not None:
        found.append((tb.tb_frame, tb.tb_lineno))
        tb = tb.tb_next
    return found


def failing_node(exc: BaseException) -> fx.Node | None:
    """The graph node whose generated line raised `exc` (the innermost one), or None outside graph code.

    Relies on torch.fx naming its generated code '<eval_with_key>.N' and writing one `name = op(...)`
    line per node (torch 2.13); where that changes, this finds nothing and messages name no node."""
    for frame, line in reversed(_frames(exc.__traceback__)):
        if not is_fx_generated(frame.f_code.co_filename):
            continue
        module = frame.f_locals.get("self")
        match = _ASSIGNED.match(linecache.getline(frame.f_code.co_filename, line))
        if isinstance(module, fx.GraphModule) and match:
            node = next((n for n in module.graph.nodes if n.name == match.group(1)), None)
            if node is not None:
                return node
    return None


def _last_user_line(stack_trace: str) -> str | None:
    """'file:line: code' of the innermost user frame in a node's recorded stack trace."""
    entries = re.findall(r'File "([^"]+)", line (\d+), in \w+\n\s*(.*)', stack_trace or "")
    if not entries:
        return None
    user = [e for e in entries if not _is_library(e[0])] or entries
    path, line, code = user[-1]
    return f"{path}:{line}: {code.strip()}"


def describe_node(node: fx.Node) -> str:
    """'layers.3.offsets (Embedding) of LM, at model.py:41: return x + self.offsets(ids) (graph node embedding_1,
    embedding.default)': what the user recognises of one graph node."""
    def short(kind: Any) -> str:
        return kind.rsplit(".", 1)[-1] if isinstance(kind, str) else getattr(kind, "__name__", str(kind))

    stack = list((node.meta.get("nn_module_stack") or {}).values())
    text = "the model"
    if stack:
        path, kind = stack[-1]
        model = short(stack[0][1]) if not stack[0][0] else None  # the outermost entry: the model itself
        text = f"{path or model or 'the model'} ({short(kind)})"
        if path and model:
            text += f" of {model}"
    where = _last_user_line(node.meta.get("stack_trace", ""))
    if where:
        text += f", at {where}"
    target = getattr(node.target, "__name__", str(node.target)) if node.op == "call_function" else node.op
    return f"{text} (graph node {node.name}, {target})"


def _module_path(module: nn.Module, roots: list[nn.Module]) -> str | None:
    """`module`'s path from the outermost of `roots` that holds it (the longest path found)."""
    unique = {id(root): root for root in roots}.values()
    paths = [path for root in unique for path, sub in root.named_modules(remove_duplicate=False) if sub is module]
    return max(paths, key=len) or "the model" if paths else None


def describe_user_frame(exc: BaseException, model: nn.Module | None = None) -> str | None:
    """'layers.3 (TableBlock.reset_parameters) at model.py:17: torch.load(path)': the innermost frame of the
    user's own code in `exc`'s traceback, and the module path of its `self` when it is part of `model` (or of
    a copy of it that a frame on the way holds); None when the traceback never enters user code."""
    frames = _frames(exc.__traceback__)
    user = [(f, line) for f, line in frames if not _is_library(f.f_code.co_filename)]
    if not user:
        return None
    frame, line = user[-1]
    owner = frame.f_locals.get("self")
    label = frame.f_code.co_name
    if isinstance(owner, nn.Module):
        roots = [model] if model is not None else []
        roots += [v for f, _ in frames for v in f.f_locals.values() if isinstance(v, nn.Module) and v is not owner]
        path = _module_path(owner, roots)
        label = f"{type(owner).__name__}.{label}"
        label = f"{path} ({label})" if path else label
    code = linecache.getline(frame.f_code.co_filename, line).strip()
    return f"{label} at {frame.f_code.co_filename}:{line}: {code}"
