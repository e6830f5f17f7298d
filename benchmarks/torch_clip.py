"""The script a PyTorch user writes to clip a gradient file by its global norm (for the benchmarks).

    python torch_clip.py IN.safetensors OUT.safetensors [CLIP]

Loads every tensor (safetensors.torch.load_file), computes the global norm
(torch.nn.utils.get_total_norm), scales in place (torch._foreach_mul_) and saves.
"""

import sys

import torch
from safetensors.torch import load_file, save_file


def main() -> None:
    source, target = sys.argv[1], sys.argv[2]
    clip = float(sys.argv[3]) if len(sys.argv) > 3 else 1.0
    tensors = load_file(source)
    floats = [t for t in tensors.values() if t.is_floating_point()]
    total = torch.nn.utils.get_total_norm(floats)
    factor = torch.clamp(clip / (total + 1e-6), max=1.0)
    torch._foreach_mul_(floats, factor)
    save_file(tensors, target)


if __name__ == "__main__":
    main()
