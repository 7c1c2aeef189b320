"""The kernel graded is the kernel compiled: a kernel may not depend on where it runs.

The CPU tier runs a student's ``@cuda.jit`` kernel in numba's simulator and compiles
the same source for real GPUs (``course.gpu_compile``). A kernel that asks whether
it is simulated (``numba.config.ENABLE_CUDASIM``, ``NUMBA_ENABLE_CUDASIM``,
``numba.cuda.simulator``), which tier grades it (``course.tier``, ``K2C_TIER``) or
anything else of its environment (``os.environ``), directly or through a module
constant set from one, can run one thing in the simulator and compile another: numba
prunes the branch it does not take. ``environment_dependence`` reads the
submission's source in the grader (never running it) and names such a kernel, with
the line, so that the checks refuse it.
"""
from __future__ import annotations

import ast
from pathlib import Path

# What code reads to learn where it runs: attribute and variable names, and strings.
MARKERS = ("ENABLE_CUDASIM", "NUMBA_ENABLE_CUDASIM", "simulator", "environ", "getenv", "K2C_TIER", "current_tier",
           "gpu_available", "is_available")
ENV_MODULES = ("os", "numba.config", "course.tier", "numba.cuda.simulator")


def _mentions(node: ast.AST) -> str | None:
    """The first marker this expression or statement mentions, if any."""
    for sub in ast.walk(node):
        if isinstance(sub, ast.Attribute) and sub.attr in MARKERS:
            return sub.attr
        if isinstance(sub, ast.Name) and sub.id in MARKERS:
            return sub.id
        if isinstance(sub, ast.Constant) and isinstance(sub.value, str) and any(m in sub.value for m in MARKERS[:2] + ("K2C_TIER",)):
            return sub.value
    return None


def _is_kernel(node: ast.AST) -> bool:
    """A function decorated with ``cuda.jit`` (a kernel or a device function)."""
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return False
    for decorator in node.decorator_list:
        target = decorator.func if isinstance(decorator, ast.Call) else decorator
        text = ast.unparse(target)
        if text in ("cuda.jit", "numba.cuda.jit", "jit") or text.endswith("cuda.jit"):
            return True
    return False


def _tainted(tree: ast.Module) -> dict[str, str]:
    """{module-level name: why it depends on the environment}: names imported from the
    environment's modules, or assigned (at module level) from an expression that mentions a
    marker or another such name, until nothing changes."""
    found: dict[str, str] = {}
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module and any(
                node.module == m or node.module.startswith(m + ".") for m in ENV_MODULES):
            for alias in node.names:
                found[alias.asname or alias.name] = f"imported from {node.module} (line {node.lineno})"
        elif isinstance(node, ast.ImportFrom) and node.module in ("numba", "numba.cuda"):
            for alias in node.names:
                if alias.name in ("config", "simulator"):
                    found[alias.asname or alias.name] = f"numba's {alias.name} (line {node.lineno})"
    changed = True
    while changed:
        changed = False
        for node in _module_level(tree):
            if not isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)) or node.value is None:
                continue
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names = [target.id for target in targets if isinstance(target, ast.Name)]
            names += [t.id for target in targets if isinstance(target, (ast.Tuple, ast.List))
                      for t in target.elts if isinstance(t, ast.Name)]
            marker = _mentions(node.value)
            uses = next((n.id for n in ast.walk(node.value) if isinstance(n, ast.Name) and n.id in found), None)
            why = (f"set from {marker} (line {node.lineno})" if marker
                   else f"set from {uses} (line {node.lineno}), which is {found[uses]}" if uses else None)
            for name in names:
                if why and name not in found:
                    found[name] = why
                    changed = True
    return found


def _module_level(tree: ast.Module):
    """The module's statements, inside its ifs, trys and withs too, but not inside functions or classes."""
    todo = list(tree.body)
    while todo:
        node = todo.pop(0)
        yield node
        if isinstance(node, (ast.If, ast.Try, ast.With, ast.For, ast.While)):
            todo.extend(child for field in ("body", "orelse", "finalbody", "handlers")
                        for child in getattr(node, field, []) or [])
        elif isinstance(node, ast.ExceptHandler):
            todo.extend(node.body)


def environment_dependence(path: Path, kernel: str) -> str:
    """Why kernel ``kernel`` of the module at ``path`` depends on where it runs ("" when it
    does not, or the source cannot be read: its checks say so themselves)."""
    try:
        tree = ast.parse(Path(path).read_text(errors="replace"))
    except (OSError, SyntaxError, ValueError):
        return ""
    kernels = {node.name: node for node in ast.walk(tree) if _is_kernel(node)}
    tainted = _tainted(tree)
    seen, todo = set(), [kernel]
    while todo:  # the kernel and the device functions it calls
        name = todo.pop()
        if name in seen or name not in kernels:
            continue
        seen.add(name)
        for node in ast.walk(kernels[name]):
            if node is kernels[name]:
                continue
            line = getattr(node, "lineno", kernels[name].lineno)
            if isinstance(node, ast.Name) and node.id in tainted:
                return (f"{kernel} reads {node.id} (line {line}), {tainted[node.id]}: a kernel that depends on where "
                        "it runs can run one thing in the simulator and compile another. The kernel graded must be "
                        "the kernel compiled: the same code, simulated or not")
            if isinstance(node, (ast.Attribute, ast.Name)) and _mentions(node):
                return (f"{kernel} asks where it runs ({_mentions(node)}, line {line}): the kernel graded in the "
                        "simulator must be the kernel compiled for the GPU, the same code either way")
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                todo.append(node.func.id)
    return ""
