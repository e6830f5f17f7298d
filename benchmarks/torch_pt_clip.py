"""The script a PyTorch user writes to clip a ``torch.save`` file by its global norm (for the benchmarks).

    python torch_pt_clip.py IN.pt OUT.pt [CLIP]

Loads the state dict (torch.load, weights_only), computes the global norm
(torch.nn.utils.get_total_norm), scales in place (torch._foreach_mul_), saves
(torch.save) and waits for the disk (fsync), as tclip does before it renames its output.
"""

import os
import sys

import torch


def main() -> None:
    source, target = sys.argv[1], sys.argv[2]
    clip = float(sys.argv[3]) if len(sys.argv) > 3 else 1.0
    tensors = torch.load(source, weights_only=True)
    floats = [t for t in tensors.values() if t.is_floating_point()]
    total = torch.nn.utils.get_total_norm(floats)
    factor = torch.clamp(clip / (total + 1e-6), max=1.0)
    torch._foreach_mul_(floats, factor)
    with open(target, "wb") as out:
        torch.save(tensors, out)
        out.flush()
        os.fsync(out.fileno())


if __name__ == "__main__":
    main()
