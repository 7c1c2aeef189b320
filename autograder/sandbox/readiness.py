"""Can this machine grade? The proof that runs before any grading.

A grade is only as good as the machine that gave it. A machine that cannot run
the student's code (the sandbox's user cannot read this Python, its packages or
the checkout) would otherwise fail every check, and the student would get the
zero. So before grading, ``prove`` starts what each call will be: a *fresh*
interpreter, in the sandbox's isolation layer, as the user student code runs as,
which imports the toolkit, the sandbox's server and every module the lab's calls
need. A fresh interpreter matters: the server imports numpy or torch as the
grader's user before it forks a call's child, and modules already loaded prove
nothing about what that user can read.

When the proof fails, grading stops (exit 2) with ``Unready``'s one message: the
cause (the first folder on the way that the user cannot enter, found from outside
by a child that has become that user) and the remedy.
"""
from __future__ import annotations

import functools
import grp
import importlib.util
import os
import pwd
import stat
import subprocess
import sys
import sysconfig
import tempfile

from autograder.sandbox import isolation

PROOF_TIMEOUT_S = 120  # importing torch on a busy 2-core machine takes seconds; a hung import is an answer too
# What every call imports, whatever the lab: the arrays, the toolkit and the sandbox's server.
BASE_MODULES = ("numpy", "course", "autograder.sandbox.child")
# Run in the fresh interpreter: import each module named on its command line; on the first
# that fails, say which and why on the last line, and exit 3.
PROOF = ("import importlib, sys\n"
         "for name in sys.argv[1:]:\n"
         "    try:\n"
         "        importlib.import_module(name)\n"
         "    except BaseException as exc:\n"
         "        print(f'cannot import {name}: {type(exc).__name__}: {exc}', file=sys.stderr)\n"
         "        sys.exit(3)\n")
REMEDY = ("install bubblewrap (Debian/Ubuntu, as root: apt-get install bubblewrap; `make grade` does it), which shows "
          "Python and the checkout to the sandbox whatever their folders' modes, or put Python and the checkout "
          "where {user} can read them (a Python under /usr or /opt, a checkout under /srv or /opt)")


class Unready(RuntimeError):
    """This machine cannot grade: the message names the cause and the remedy."""


def prove(layer: isolation.Isolation, modules: tuple[str, ...] = ()) -> None:
    """Raise ``Unready`` unless a fresh interpreter in ``layer``, as its user, imports
    ``BASE_MODULES`` and ``modules``. Proven once per process for each (layer, modules)."""
    why = _proof(layer, tuple(dict.fromkeys((*BASE_MODULES, *modules))))
    if why:
        raise Unready(why)


@functools.cache
def _proof(layer: isolation.Isolation, modules: tuple[str, ...]) -> str:
    with tempfile.TemporaryDirectory(prefix="k2c-proof-") as scratch:
        if layer.uid is not None:
            os.chown(scratch, layer.uid, layer.gid)
        os.chmod(scratch, 0o711)  # bubblewrap, without capabilities, must enter it
        env = layer.child_env(scratch)
        # The fresh interpreter starts as the student's user: the server's (root's) modules are not there.
        fresh = [sys.executable, "-P", "-s", "-c", PROOF, *modules]
        inner = fresh if not env["K2C_RUN_AS"] else \
            [sys.executable, "-P", "-s", "-m", "autograder.sandbox.reaper", "--exec-as", env["K2C_RUN_AS"], "--", *fresh]
        env = dict(os.environ, **env,
                   PYTHONPATH=os.pathsep.join(filter(None, [isolation.PACKAGE_ROOT, os.environ.get("PYTHONPATH")])))
        try:
            done = subprocess.run(layer.command(inner, scratch, isolation.needed_paths(), devices=False),
                                  cwd=scratch, env=env, capture_output=True, timeout=PROOF_TIMEOUT_S,
                                  stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            return (f"a fresh Python in the {layer.layer.value} layer, as {layer.user}, did not import "
                    f"{', '.join(modules)} within {PROOF_TIMEOUT_S} s")
        except OSError as exc:
            return f"the {layer.layer.value} layer did not start: {exc}"
    if done.returncode == 0:
        return ""
    said = (done.stderr.decode(errors="replace").strip().splitlines() or [f"exit status {done.returncode}"])[-1]
    blocked = first_unreadable(_paths_needed(modules), layer.uid, layer.gid) \
        if layer.uid is not None and layer.layer is isolation.Layer.SUBREAPER else ""
    if blocked:
        return (f"student code runs as {layer.user}, who {blocked}, so a call cannot start ({said}). "
                "Remedy: " + REMEDY.format(user=_name(layer.uid)))
    if layer.layer is isolation.Layer.BUBBLEWRAP:
        return (f"a fresh Python in the bubblewrap layer, as {layer.user}, failed: {said}. The sandbox shows only "
                "the system, this Python and its environment, and the course toolkit: install what grading needs "
                "into this environment (`k2c doctor` lists it)")
    return (f"a fresh Python in the {layer.layer.value} layer, as {layer.user}, failed: {said}. "
            "Remedy: " + REMEDY.format(user=_name(layer.uid) if layer.uid is not None else "the grader's user"))


def _paths_needed(modules: tuple[str, ...]) -> list[tuple[str, str]]:
    """(path, what it is) for what a call reads: this Python, its library and packages,
    the checkout's toolkit and grader, and where each of ``modules`` is found from here."""
    paths = [(os.path.realpath(sys.executable), "this Python"), (sys.prefix, "this Python's environment"),
             (sysconfig.get_paths()["stdlib"], "Python's standard library"),
             *((p, "Python's packages") for p in sys.path if "-packages" in p),
             (os.path.join(isolation.PACKAGE_ROOT, "course"), "the course toolkit"),
             (os.path.join(isolation.GRADER_ROOT, "sandbox"), "the grader's sandbox")]
    for name in modules:
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            spec = None
        if spec and spec.origin and os.path.isabs(spec.origin):
            paths.append((spec.origin, f"the module {name}"))
    return [(p, what) for p, what in paths if p and os.path.exists(p)]


def first_unreadable(paths: list[tuple[str, str]], uid: int, gid: int) -> str:
    """How the first of ``paths`` that user ``uid`` cannot reach is blocked, as the end of a
    sentence ("cannot enter /root (drwx------ root), which holds this Python (/root/...)");
    "" when every one is readable. Asked of a forked child that has become that user."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: become the user, look, answer, leave
        try:
            os.close(read)
            os.setgroups([])
            os.setresgid(gid, gid, gid)
            os.setresuid(uid, uid, uid)
            os.write(write, _blocked(paths).encode()[:60000])
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as answer:
        said = answer.read().decode()
    os.waitpid(pid, 0)
    return said


def _blocked(paths: list[tuple[str, str]]) -> str:
    for path, what in paths:
        steps = path.rstrip("/").split("/")
        for depth in range(1, len(steps) + 1):
            step = "/".join(steps[:depth]) or "/"
            is_folder = depth < len(steps) or os.path.isdir(step)
            if not os.access(step, (os.R_OK | os.X_OK) if is_folder else os.R_OK):
                verb = "cannot enter" if is_folder else "cannot read"
                return f"{verb} {step} ({_mode(step)}), which holds {what} ({path})" if step != path \
                    else f"{verb} {what} ({path}, {_mode(step)})"
    return ""


def _mode(path: str) -> str:
    try:
        info = os.stat(path)
    except OSError as exc:
        return exc.strerror or "unreadable"
    return f"{stat.filemode(info.st_mode)} {_name(info.st_uid)}:{_group(info.st_gid)}"


def _name(uid: int | None) -> str:
    if uid is None:
        return "the grader's user"
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"


def _group(gid: int) -> str:
    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return str(gid)
