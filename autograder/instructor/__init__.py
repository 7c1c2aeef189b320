"""The instructor's tools: a whole class into a gradebook (``gradebook``, with its
SLURM path ``gradebook_slurm``), a Gradescope autograder (``gradescope``), the
student repository (``release``) and the starters made from the references (``sync``)."""
