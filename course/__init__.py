"""The toolkit that lectures, labs and the autograder share.

Small on purpose: which tier this machine is (``course.tier``), which array
module to use (``course.arrays``), how to time code (``course.timing``), how to
draw what we measure and how kernels are launched (``course.plots``,
``course.diagrams``), how to see a race in a ``prange`` loop whatever the
schedule (``course.races``) and what a CUDA kernel does to memory in the
simulator (``course.cuda_audit``), a recording stand-in for CUDA streams
(``course.streams``), and how the GPU tier times a kernel (``course.gpu_timing``,
on the devices of ``course.gpu_devices`` or the stand-ins of ``course.gpu_stand_in``).
"""
from course.tier import current_tier, gpu_available, use_simulator_if_no_gpu

__all__ = ["current_tier", "gpu_available", "use_simulator_if_no_gpu"]
