"""The body of the HDF5 structure check's child process (see :mod:`tclip.formats._h5probe`).

It walks what tclip would read of a file -- every group, link, attribute, dataset
header, the chunk index of every chunked dataset and the first element of every
tensor -- under limits on memory and CPU time; the parent refuses the file when
this process dies from a signal, runs out of time (exit by SIGXCPU) or of memory
(exit status 3).
"""

from __future__ import annotations

import sys
from pathlib import Path

from ._h5probe import PROBE_MEMORY_BYTES, PROBE_SECONDS
from .hdf5 import Hdf5Reader, import_h5py


def _walk(path: str) -> None:
    h5py = import_h5py()
    reader = Hdf5Reader(Path(path), probe=False)  # the same walk tclip does: links, attributes, types
    try:
        for name, info in reader.tensors.items():
            if info.refused:
                continue
            dataset = reader.file[name]
            if dataset.chunks is not None:
                dataset.id.get_num_chunks()  # walks the whole chunk index
            if info.size:
                dataset[(0,) * len(info.shape)] if info.shape else dataset[()]
        for other in reader.others:
            obj = reader.file.get(other.name)
            if isinstance(obj, h5py.Dataset) and obj.chunks is not None:
                obj.id.get_num_chunks()
    finally:
        reader.close()


def main() -> int:
    try:
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (PROBE_MEMORY_BYTES, PROBE_MEMORY_BYTES))
        resource.setrlimit(resource.RLIMIT_CPU, (PROBE_SECONDS, PROBE_SECONDS + 5))
    except (ImportError, ValueError, OSError):
        pass
    try:
        _walk(sys.argv[1])
    except MemoryError:
        return 3
    except Exception:  # an ordinary error: tclip's own open reports it
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
