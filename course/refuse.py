"""Refuse a library's own implementation of what a lab asks students to build.

    from course import refuse
    refuse.install(["torch.nn.parallel.distributed:DistributedDataParallel", "torch.distributed.pipelining"],
                   why="lab 08 builds data parallelism from all_reduce")

A module (``torch.distributed.pipelining``) can no longer be imported, nor
anything below it. An object (``module:name``, named in the module that
defines it) is replaced, in that module and in every module that bound it
(``torch.nn.parallel.DistributedDataParallel``, ``torch.nn.DataParallel`` …),
by a stand-in that raises when it is called (a subclass too) or looked into; a
class's method (``module:Class.method``, ``torch._tensor:Tensor.softmax``) is
replaced on that class, so its instances and subclasses get the stand-in. A
module not imported yet gets it as soon as it has run, before anything can
import the name from it, so nothing has to be imported up front. Either way the error is
:class:`LibraryRefused`, with ``why`` in its message. ``isinstance`` against a
refused class still works (and is False), so torch's own code keeps running.

The grader refuses what a lab's ``lab.toml`` lists (``refuse``): every sandboxed
call, and every MPI rank or torch worker it starts, installs the list from
``K2C_REFUSE`` before it imports any student code (``install_from_env``).
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import json
import os
import sys

ENV = "K2C_REFUSE"


class LibraryRefused(ImportError):
    pass


def _message(name: str, why: str) -> str:
    return f"{name} is refused here: {why}"


def _stand_in(name: str, why: str, original):
    message = _message(name, why)

    class Meta(type):
        def __getattr__(cls, attr):
            raise LibraryRefused(message)

    if isinstance(original, type):
        def refuse(*args, **kwargs):
            raise LibraryRefused(message)

        # A class: making one raises, and so does making one of a subclass (torch itself
        # subclasses some at import); isinstance and issubclass are simply False.
        return Meta(original.__name__, (), {"__new__": refuse, "__doc__": message, "__module__": original.__module__})

    def refused(*args, **kwargs):
        raise LibraryRefused(message)
    refused.__name__, refused.__doc__ = getattr(original, "__name__", "refused"), message
    return refused


def _replace_everywhere(original, stand_in) -> None:
    for module in list(sys.modules.values()):
        namespace = getattr(module, "__dict__", None)
        if not isinstance(namespace, dict):
            continue
        for key, value in list(namespace.items()):
            if value is original:
                namespace[key] = stand_in


class _Finder(importlib.abc.MetaPathFinder):
    """Refuses whole modules; patches a watched module's refused objects once it has run."""

    def __init__(self, modules: dict, objects: dict):
        self.modules, self.objects = modules, objects  # name -> why; module name -> {attr: why}

    def find_spec(self, fullname, path, target=None):
        for refused, why in self.modules.items():
            if fullname == refused or fullname.startswith(refused + "."):
                raise LibraryRefused(_message(refused, why))
        if fullname not in self.objects:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        run, attrs = spec.loader.exec_module, self.objects[fullname]

        def exec_module(module):
            run(module)
            _refuse_objects(module, attrs)
        spec.loader.exec_module = exec_module
        return spec


def _refuse_objects(module, attrs: dict) -> None:
    for attr, why in attrs.items():
        owner_path, _, name = attr.rpartition(".")
        owner = module
        for part in filter(None, owner_path.split(".")):
            owner = getattr(owner, part, None)
        original = getattr(owner, name, None)
        if original is None:
            continue
        stand_in = _stand_in(f"{module.__name__}.{attr}", why, original)
        if owner_path:  # a method: no module binds it, its class does
            setattr(owner, name, stand_in)
        else:
            _replace_everywhere(original, stand_in)


def install(names, why: str) -> None:
    """Refuse each name: a module (``a.b``), an object in the module defining it (``a.b:C``),
    or a method of a class there (``a.b:C.m``)."""
    modules, objects = {}, {}
    for name in names:
        module, _, attr = name.partition(":")
        if attr:
            objects.setdefault(module, {})[attr] = why
        else:
            modules[module] = why
    for name in list(sys.modules):
        if any(name == m or name.startswith(m + ".") for m in modules):
            del sys.modules[name]
    sys.meta_path.insert(0, _Finder(modules, objects))
    for parent, attrs in objects.items():
        if parent in sys.modules:
            _refuse_objects(sys.modules[parent], attrs)


def install_from_env() -> None:
    """Install what ``K2C_REFUSE`` (``{"names": [...], "why": "..."}``) lists, if anything."""
    spec = os.environ.get(ENV)
    if spec:
        data = json.loads(spec)
        install(data["names"], data["why"])
