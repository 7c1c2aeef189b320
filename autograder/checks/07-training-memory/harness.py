"""The sandboxed side of lab 07's checks: it calls the student's ``memory_budget`` and
returns what it gave. It knows no answer: every configuration, model and batch comes
from the grader, and the grader compares (``oracles.py``, in its own process).

- ``student_answers``: the student's functions on every configuration asked, in one
  call, a value or why there is none per call (the small models in one call, the
  models too large to run in another);
- ``estimates_rank``: the estimates for the 1-7B models again, in a rank job of one
  rank, so that the launcher counts, from outside the process, the CPU seconds of
  three phases: building the same models on the meta device, running their forward
  passes there (with the building, what a traced run costs), and the student's
  estimates;
- ``profile_runs``: the student's ``profile_step`` on a TinyGPT with the weights and
  batch the grader sent, without and with checkpointing; the parameters after it
  go back to the grader, which replays the same step.
"""
import numpy as np
import torch

from autograder.sandbox import ranks
from course.models import GPTConfig, TinyGPT

torch.set_num_threads(1)  # tiny models: one thread is as fast, and steadier on a shared machine
STUDENT_FUNCTIONS = ("count_parameters", "activation_bytes_per_layer", "estimate_train_memory")
TIMED = ("estimate_train_memory", "activation_bytes_per_layer")  # the estimates a traced run would take the place of


def _attempt(fn, *args):
    """{"status": "ok", "value": ...} or why there is no value, as plain data."""
    try:
        return {"status": "ok", "value": fn(*args)}
    except NotImplementedError as exc:
        return {"status": "not_implemented", "message": str(exc)}
    except Exception as exc:  # noqa: BLE001 - the student's error is reported, not raised
        return {"status": "raised", "message": f"{type(exc).__name__}: {exc}"}


def _per_parameter(student):
    return {f"{p}/{o}": _attempt(student.state_bytes_per_parameter, p, o)
            for p in ("fp32", "mixed") for o in ("adam", "sgd", "sgd_momentum")}


def student_answers(configs):
    """Per configuration, each of the student's functions' answer (see ``_attempt``)."""
    import memory_budget as student

    answers = [{name: _attempt(getattr(student, name), dict(config)) for name in STUDENT_FUNCTIONS}
               for config in configs]
    return {"per_config": answers, "per_parameter": _per_parameter(student)}


# --- models too large to run: the estimates, and what they cost ----------------------

def _meta_model(config):
    shape = GPTConfig(vocab=config["vocab"], seq=config["seq"], hidden=config["hidden"], heads=config["heads"],
                      layers=config["layers"], dropout=config["dropout"])
    with torch.device("meta"):
        model = TinyGPT(shape, checkpointing=config["checkpointing"])
        return model.to(torch.float32 if config["precision"] == "fp32" else torch.bfloat16).train()


def _run_on_meta(model, config):
    """A forward pass on the meta device: what a traced run costs, without its answer."""
    with torch.device("meta"):
        tokens = torch.zeros(config["batch"], config["seq"], dtype=torch.long)
    model(tokens, tokens)


def estimates_rank(configs):
    """A rank job of one rank, whose CPU seconds the launcher counts by each mark: "built"
    (the models built on the meta device), "ran" (their forward passes run there), then
    "estimated" (the student's module imported and its estimates made). Returns the estimates."""
    ranks.mark("start")
    models = [_meta_model(config) for config in configs]
    ranks.mark("built")
    for model, config in zip(models, configs):
        _run_on_meta(model, config)
    ranks.mark("ran")
    del models
    import memory_budget as student

    answers = [{name: _attempt(getattr(student, name), dict(config)) for name in TIMED} for config in configs]
    ranks.mark("estimated")
    return {"per_config": answers}


# --- profile_step --------------------------------------------------------------------------

def profile_runs(runs):
    """``profile_run`` for each of ``{"plain": ..., "checkpointed": ...}``, in one process."""
    return {name: profile_run(**run) for name, run in runs.items()}


def profile_run(config, weights, tokens, targets):
    """The student's ``profile_step`` on a TinyGPT with ``weights`` and the batch: what it
    returned, and the parameters after it."""
    import memory_budget as student

    model = TinyGPT(GPTConfig(vocab=config["vocab"], seq=config["seq"], hidden=config["hidden"],
                              heads=config["heads"], layers=config["layers"], dropout=config["dropout"]),
                    checkpointing=config["checkpointing"]).train()
    model.load_state_dict({name: torch.from_numpy(np.array(value)) for name, value in weights.items()})
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    result = student.profile_step(model, torch.from_numpy(np.array(tokens)), torch.from_numpy(np.array(targets)),
                                  optimizer)
    return {"result": result, "parameters": {name: p.detach().numpy() for name, p in model.named_parameters()}}
