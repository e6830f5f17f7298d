"""The script a PyTorch user writes to see the norms of a safetensors file (for the benchmarks).

    python torch_report.py FILE.safetensors [--float64]

Loads every tensor (safetensors.torch.load_file) and prints each floating
tensor's L2 norm (torch.linalg.vector_norm) and the global norm. --float64
accumulates in float64, as tclip does (slower; without it the norms of 16-bit
tensors come back in their own dtype).
"""

import math
import sys

import torch
from safetensors.torch import load_file


def main() -> None:
    path = sys.argv[1]
    wide = "--float64" in sys.argv[2:]
    tensors = load_file(path)
    total = 0.0
    for name, tensor in tensors.items():
        if not tensor.is_floating_point():
            continue
        norm = torch.linalg.vector_norm(tensor, dtype=torch.float64 if wide else None).item()
        total += norm * norm
        print(f"{name}\t{norm:.6g}")
    print(f"global\t{math.sqrt(total):.6g}")


if __name__ == "__main__":
    main()
