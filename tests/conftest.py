import os
import sys
from pathlib import Path

# Triton kernels run through the interpreter on machines without a GPU; it must be set before the first
# @triton.jit is evaluated.
if not os.path.exists("/dev/nvidiactl"):
    os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, str(Path(__file__).parent))
