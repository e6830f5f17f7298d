"""The same job written with the safetensors NumPy API (for the benchmarks).

    python numpy_clip.py IN.safetensors OUT.safetensors [CLIP]

safetensors.numpy.load_file holds every tensor in memory; the norm is taken in
float64, the scaling rounds once to each tensor's dtype. (The NumPy API cannot
hold bfloat16 files.)
"""

import sys

import numpy as np
from safetensors.numpy import load_file, save_file


def main() -> None:
    source, target = sys.argv[1], sys.argv[2]
    clip = float(sys.argv[3]) if len(sys.argv) > 3 else 1.0
    tensors = load_file(source)
    floats = {k: v for k, v in tensors.items() if np.issubdtype(v.dtype, np.floating)}
    total = np.sqrt(sum(float(np.dot(v.ravel().astype(np.float64), v.ravel().astype(np.float64)))
                        for v in floats.values()))
    factor = min(1.0, clip / total) if total > 0 else 1.0
    for k, v in floats.items():
        tensors[k] = (v.astype(np.float64) * factor).astype(v.dtype)
    save_file(tensors, target)


if __name__ == "__main__":
    main()
