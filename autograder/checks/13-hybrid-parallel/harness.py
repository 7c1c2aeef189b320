"""Grader code that runs next to the student's lab 13 modules in the sandbox.

``planner_answers(queries)`` answers every ``cost_model`` and ``search`` query of
the planner's checks in one call (importing the planner, and with it torch,
once). An answer is ``{"value": ...}`` (plain data), ``{"error": ...}`` when the
call raised, or for a search ``{"hung": seconds}`` when it ran past its limit
(a search that takes too long costs only its own check); every search answer
also says how many ``seconds`` it took, and one that is a plan the student's own
``cost_model`` of it (``cost``). A function that is still a stub
answers ``{"not_implemented": message}`` for all its queries.

The run_plan and SLURM checks' grader code lives in ``harness_hybrid.py`` (the
rank functions of run_plan's rank jobs) and ``harness_cluster.py``, re-exported
here: a lab has one harness module.
"""
import time

from autograder.grading.checking import TooLong, plain, within

SEARCH_LIMIT_S = 10  # per search query; the reference takes well under a second on the small ones


def _answers(function, calls, limit=None):
    out = []
    for args in calls:
        start = time.perf_counter()
        try:
            value = within(limit, function, *args) if limit else function(*args)
            answer = {"value": plain(value, tuples=False)}
        except TooLong:
            answer = {"hung": limit}
        except NotImplementedError as exc:
            return {"not_implemented": str(exc) or f"{function.__name__} is not implemented yet"}
        except Exception as exc:  # the check says what the call raised
            answer = {"error": f"{type(exc).__name__}: {exc}"[:400]}
        answer["seconds"] = time.perf_counter() - start
        out.append(answer)
    return out


def planner_answers(queries):
    """{"cost_model": [...], "search": [...]}: the answers to the queries, in order.
    A search query is (model, cluster, budget, limit in seconds). A search answer that
    is a plan also holds ``cost``: the answer of ``cost_model`` on that plan, by which
    the public checks time and size it."""
    import planner

    searches = []
    for model, cluster, budget, limit in queries["search"]:
        answer = _answers(planner.search, [(model, cluster, budget)], limit=limit)
        if isinstance(answer, list) and "value" in answer[0]:
            cost = _answers(planner.cost_model, [(answer[0]["value"], model, cluster)], limit=limit)
            answer[0]["cost"] = cost if isinstance(cost, dict) else cost[0]
        searches.append(answer)
    return {"cost_model": _answers(planner.cost_model, queries["cost_model"]), "search": searches}


# --- the grader code of run_plan (harness_hybrid.py) and of the SLURM functions (harness_cluster.py) ---
from autograder.grading.checking import load_beside as _load_beside  # noqa: E402

_hybrid, _cluster = _load_beside(__file__, "harness_hybrid"), _load_beside(__file__, "harness_cluster")
hybrid_cases_rank, hybrid_measure_rank, cost_model_times = (
    _hybrid.hybrid_cases_rank, _hybrid.hybrid_measure_rank, _hybrid.cost_model_times)
cluster_answers = _cluster.cluster_answers
