"""The folders around a DCP checkpoint: Megatron-Core's ``metadata.json`` and ``common.pt``,
NeMo 2's ``<checkpoint>/weights/`` and Accelerate's ``pytorch_model_fsdp_0/``.

Megatron-Core (``torch_dist``, its one distributed format) writes, beside ``.metadata`` and the
``__R_K.distcp`` files, ``metadata.json`` (``{"sharded_backend": "torch_dist",
"sharded_backend_version": 1, ...}``: which backend holds the sharded tensors) and, before 2026,
``common.pt``: a ``torch.save`` of the state every rank shares (``args``, ``iteration``,
``checkpoint_version``, a scheduler's state). Megatron puts every model and optimizer tensor in
the sharded part; what ``common.pt`` holds is bookkeeping (rng states, counters), so its items
are listed as not tensors -- its tensors with their shape and dtype, its plain values with their
value -- and never measured. It is read by the ``.pt`` reader (its allowlist; nothing is run);
one that reader refuses (a real one pickles ``argparse.Namespace`` for ``args``) is listed as one
item not read, with why: the weights are still read, and nothing is measured that was not.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

from ...core.dtypes import dtype_name
from ...errors import FormatError, TclipError, UnsupportedError
from ..base import OtherObject, TensorReader

MEGATRON_CONFIG = "metadata.json"
COMMON_STATE = "common.pt"
NEMO_WEIGHTS = "weights"            # NeMo 2: <checkpoint>/weights/ beside <checkpoint>/context/
ACCELERATE_MODEL = "pytorch_model_fsdp_"  # Accelerate: <checkpoint>/pytorch_model_fsdp_0/, optimizer_0/
_BACKEND = "torch_dist"
_MAX_CONFIG = 1 << 20
_MAX_KEYS = 64


def sniff_config(head: bytes) -> bool:
    """A Megatron ``metadata.json``: a JSON object naming ``sharded_backend`` near its start."""
    start = head[:256].lstrip()
    return start.startswith(b"{") and b'"sharded_backend"' in start


def is_megatron_folder(folder: Path) -> bool:
    """A folder holding a Megatron ``metadata.json`` and no ``.metadata`` (a zarr checkpoint,
    or a torch_dist one missing its ``.metadata``): its reader says which."""
    from . import METADATA_NAME

    try:
        if (folder / METADATA_NAME).exists() or not (folder / MEGATRON_CONFIG).is_file():
            return False
        with open(folder / MEGATRON_CONFIG, "rb") as handle:
            return sniff_config(handle.read(256))
    except OSError:
        return False


def megatron_config(folder: Path) -> dict[str, Any]:
    """The ``metadata.json`` of a Megatron folder as metadata (``megatron.<key>``); empty when
    there is none. Refused: a file that is not a JSON object, a ``sharded_backend`` other than
    ``torch_dist`` (zarr, removed from Megatron in 2026), keys of the wrong type."""
    path = folder / MEGATRON_CONFIG
    raw = _small_file(path, folder)
    if raw is None:
        return {}
    where = MEGATRON_CONFIG
    try:
        config = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as error:
        raise FormatError(f"{where}: not valid JSON ({str(error)[:100]})", folder) from None
    if not isinstance(config, dict):
        raise FormatError(f"{where}: a JSON {type(config).__name__}, expected an object", folder)
    if "sharded_backend" not in config:
        return {}  # another tool's metadata.json: not Megatron's, and not tclip's business
    backend = config["sharded_backend"]
    if not isinstance(backend, str):
        raise FormatError(f"{where}: sharded_backend is a JSON {type(backend).__name__}, expected a string", folder)
    if backend != _BACKEND:
        raise UnsupportedError(f"{where}: a Megatron checkpoint with sharded_backend {backend[:40]!r}; tclip reads "
                               f"the {_BACKEND!r} backend (PyTorch Distributed Checkpoint) only", folder)
    common = config.get("common_backend", "torch")
    if common != "torch":
        raise UnsupportedError(f"{where}: common_backend {str(common)[:40]!r}; tclip reads 'torch' (common.pt) only",
                               folder)
    for key in ("sharded_backend_version", "common_backend_version"):
        if key in config and (type(config[key]) is not int):
            raise FormatError(f"{where}: {key} is a JSON {type(config[key]).__name__}, expected an integer", folder)
    if len(config) > _MAX_KEYS:
        raise FormatError(f"{where}: {len(config)} keys; Megatron writes a handful", folder)
    return {f"megatron.{key}": value for key, value in config.items()}


def _small_file(path: Path, folder: Path) -> bytes | None:
    """A regular file's bytes (None when absent), refusing anything else or a file over 1 MiB."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        return None
    except OSError as error:
        raise TclipError(f"{path.name}: cannot read ({error.strerror or error})", folder) from None
    with os.fdopen(fd, "rb") as handle:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise FormatError(f"{path.name}: not a regular file", folder)
        if st.st_size > _MAX_CONFIG:
            raise FormatError(f"{path.name}: {st.st_size} bytes, larger than a Megatron metadata.json "
                              f"({_MAX_CONFIG} at most)", folder)
        return handle.read(_MAX_CONFIG + 1)


def megatron_parts(reader: TensorReader, config: dict[str, Any], values: dict[str, Any]) -> None:
    """A Megatron folder's ``metadata.json`` (``config``) as the reader's metadata, its
    ``common.pt`` as not tensors (their plain values into ``values``, by name)."""
    reader.metadata.update(config)
    if config:
        others, found = common_state(reader.path)
        reader.others += [o for o in others if o.name not in reader.tensors]
        values.update(found)


def common_state(folder: Path) -> tuple[list[OtherObject], dict[str, Any]]:
    """``common.pt``'s items as not tensors named ``common.pt/<name>``, and their plain values
    by name (for ``diff``); nothing when the folder has no ``common.pt``."""
    path = folder / COMMON_STATE
    try:
        st = os.stat(path)
    except OSError:
        return [], {}
    if not stat.S_ISREG(st.st_mode):
        return [OtherObject(COMMON_STATE, "Megatron common state", "not read: not a regular file")], {}
    from ..torch.reader import TorchReader

    try:
        reader = TorchReader(path)
    except TclipError as error:
        return [OtherObject(COMMON_STATE, "Megatron common state", f"not read: {error.detail}")], {}
    with reader:
        others = [OtherObject(f"{COMMON_STATE}/{t.name}", "common.pt tensor",
                              "Megatron's common state, not a weight: not measured", t.shape,
                              t.dtype_label or dtype_name(t.dtype))
                  for t in reader.tensors.values()]
        others += [OtherObject(f"{COMMON_STATE}/{o.name}", o.kind, o.reason, o.shape, o.dtype) for o in reader.others]
        values = {f"{COMMON_STATE}/{name}": value for name, value in reader._values.items()}
    return others, values


def inner_checkpoint(folder: Path) -> tuple[Path, list[Path]] | None:
    """The DCP folder a NeMo 2 or Accelerate checkpoint folder stands for, and the DCP folders
    beside it left out (Accelerate's ``optimizer_0/``); None for any other folder.

    NeMo 2 keeps its weights (and optimizer state) in ``weights/`` beside ``context/``;
    Accelerate's FSDP ``save_state`` writes the model to ``pytorch_model_fsdp_0/`` and its
    optimizer to ``optimizer_0/``: the model's folder stands for the checkpoint, as a Hugging
    Face folder's ``model.safetensors`` does beside a Trainer's ``optimizer.pt``."""
    from . import is_dcp_folder

    weights = folder / NEMO_WEIGHTS
    if is_dcp_folder(weights):
        return weights, []
    try:
        models = sorted(p for p in folder.iterdir() if p.name.startswith(ACCELERATE_MODEL) and is_dcp_folder(p))
    except OSError:
        return None
    if len(models) != 1:
        return None  # none, or several models: each its own input
    others = sorted(p for p in folder.iterdir() if p != models[0] and p.is_dir() and is_dcp_folder(p))
    return models[0], others
