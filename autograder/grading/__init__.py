"""Grading one lab: find the lab and the submission's files (``labs``), run the lab's
checks with pytest in the grader's process (``runner``, ``plugin``), call into the
student's code through the sandbox (``submission``), compare (``checking``) and
report (``report``)."""
