"""Under nbval (``make test``), keep what each lecture printed and drew.

nbval runs a lecture's cells as test items and collects each cell's outputs
(``item.test_outputs``) but throws them away. Here they are put back into the
notebook, and a lecture whose every cell passed is saved executed
(``course.executed``), so the docs build shows these outputs instead of
running every lecture a second time.
"""
import copy

import pytest

_lectures = {}  # path -> {"nb": the notebook nbval read, "cells": passed cells, "failed": bool}


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    report = (yield).get_result()
    cell, notebook = getattr(item, "cell", None), getattr(item.parent, "nb", None)
    if cell is None or notebook is None or report.when != "call":
        return
    entry = _lectures.setdefault(str(item.parent.fspath), {"nb": notebook, "cells": 0, "failed": False})
    if report.passed and getattr(item, "test_outputs", None) is not None:
        entry["cells"] += 1
        cell.outputs = copy.deepcopy(item.test_outputs)
        cell.execution_count = entry["cells"]
        for output in cell.outputs:
            if output.get("output_type") == "execute_result":
                output["execution_count"] = entry["cells"]
    else:
        entry["failed"] = True


def pytest_sessionfinish(session):
    import nbformat

    from course import executed

    for path, entry in _lectures.items():
        notebook = entry["nb"]
        code_cells = sum(1 for cell in notebook.cells if cell.cell_type == "code")
        if entry["failed"] or entry["cells"] != code_cells:
            continue  # a lecture that failed, or was run in part, keeps no copy
        try:
            nbformat.validate(notebook)
        except nbformat.ValidationError as exc:  # the docs build will run this lecture itself
            print(f"not keeping the executed {path}: {str(exc).splitlines()[0]}")
            continue
        executed.save(nbformat.from_dict(notebook), path)
