import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))

# Without a GPU, Triton kernels run through the interpreter (must be set before triton loads).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
