"""The k2c autograder: runs per-lab checks against a submission.

Student code never runs in the grader's process: every call into it happens in
a sandboxed child (``autograder.sandbox``) and only plain data comes back
(``autograder.sandbox.codec``). The checks themselves run here, with pytest, and
compare what came back with independent oracles.
"""
