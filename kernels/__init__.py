"""Fused Triton kernels with pure-torch twins (decode attention, fused norms). Triton is imported lazily inside
each kernel module so that importing this package never needs a GPU or triton."""
