"""Import a module of an earlier lab from a later lab's file.

Lab 13 builds on the student's own modules 07-10. When it is graded, the grader
copies those files next to the lab's own (``uses`` in its ``lab.toml``), so a
plain ``import ddp`` works. Outside the grader (a handout, a lecture, the
``solutions/`` folder) the earlier lab sits beside this lab's folder instead:
``labs/08-data-parallel/ddp.py`` next to ``labs/13-hybrid-parallel/``.
"""
import importlib
import sys
from pathlib import Path


def import_lab_module(here, lab, name):
    """The module ``name`` (``"ddp"``): the one beside ``here`` (the file asking)
    when there is one, else the one in the sibling folder ``lab``
    (``"08-data-parallel"``) of ``here``'s folder."""
    folder = Path(here).resolve().parent
    if not (folder / f"{name}.py").is_file():
        sibling = folder.parent / lab
        if not (sibling / f"{name}.py").is_file():
            raise ImportError(f"this lab uses lab {lab}'s {name}.py, which is neither beside {folder.name}/ "
                              f"nor in {sibling}")
        if str(sibling) not in sys.path:
            sys.path.append(str(sibling))
    return importlib.import_module(name)
