"""A sharded checkpoint's files, read in one process with no ranks: the
whole state as a plain state_dict (`load_full_state_dict`), what each file holds
(`checkpoint_bytes`), and the helpers sharded_checkpoint.py loads with. DCP
writes one file per rank (__r_0.distcp) and .metadata, each tensor chunk in
torch.save's container (about 1.5 kB of zip framing around the elements).
"""

from __future__ import annotations

import json
import math
import os
import re
import warnings
from dataclasses import dataclass

import torch


def _dcp():
    import torch.distributed.checkpoint as dcp

    return dcp



def _is_tensor(m) -> bool:
    """A TensorStorageMetadata (the other kind, BytesStorageMetadata, is a
    pickled value: the step, a hyperparameter)."""
    return hasattr(m, "chunks")



def load_full_state_dict(path) -> dict:
    """The checkpoint at `path`, read in one process (no process group):
    {"model": {every name: the whole tensor in the parameter's shape}, "optim":
    torch's full optimizer state_dict keyed by names, if saved, "step": int}."""
    md = _metadata(path)
    flat = {k: torch.empty(m.size, dtype=m.properties.dtype) if _is_tensor(m)
            else None for k, m in md.state_dict_metadata.items()}
    _load_here(path, flat)
    tree = _nest(flat, md)
    if "layout" in tree:  # labkit's flat shards: each in its own shape again
        layout = json.loads(tree.pop("layout"))
        shapes = layout["shapes"]

        def shaped(name, v):
            flat_one = v.dim() == 1 and v.numel() == math.prod(shapes[name])
            return v.view(shapes[name]) if flat_one else v

        tree["model"] = {n: shaped(n, v) for n, v in tree["model"].items()}
        tree["model"].update({a: tree["model"][n] for a, n in layout["tied"].items()})
        for name, st in tree.get("optim", {}).get("state", {}).items():
            st.update({k: shaped(name, v) for k, v in st.items() if torch.is_tensor(v)})
    return tree



@dataclass(frozen=True)
class FileBytes:
    """A file DCP wrote: its size on disk; from .metadata, the bytes its items
    take, how many of them are tensors' elements (numel x element size), and
    how many tensor chunks and other (pickled) values it holds."""

    name: str
    size: int
    listed: int
    tensor_bytes: int
    tensors: int
    objects: int

    @property
    def framing(self) -> int:
        """torch.save's containers and the pickled values: not tensor elements."""
        return self.size - self.tensor_bytes



@dataclass(frozen=True)
class CheckpointBytes:
    files: list    # FileBytes of each rank's data file, in rank order
    metadata: int  # .metadata's size

    @property
    def tensor_bytes(self) -> int:
        return sum(f.tensor_bytes for f in self.files)



def checkpoint_bytes(path) -> CheckpointBytes:
    """What the checkpoint at `path` holds, file by file (see FileBytes)."""
    md = _metadata(path)
    rows: dict[str, list] = {}  # file -> [listed, tensor bytes, tensors, objects]
    for idx, info in md.storage_data.items():
        row = rows.setdefault(info.relative_path, [0, 0, 0, 0])
        row[0] += info.length
        m = md.state_dict_metadata[idx.fqn]
        if not _is_tensor(m):
            row[3] += 1
        else:
            chunk = next(c for c in m.chunks if c.offsets == idx.offset)
            row[1] += math.prod(chunk.sizes) * m.properties.dtype.itemsize
            row[2] += 1
    root = os.fspath(path)
    files = [FileBytes(f, os.path.getsize(os.path.join(root, f)), *rows[f])
             for f in sorted(rows, key=lambda f: [int(x) for x in re.findall(r"\d+",
                                                                            f)])]
    return CheckpointBytes(files, os.path.getsize(os.path.join(root, ".metadata")))



def _metadata(path):
    p = os.fspath(path)
    if not os.path.isdir(p):
        raise FileNotFoundError(f"no checkpoint at {p!r}: no such directory "
                                "(save_sharded makes one)")
    if not os.path.exists(os.path.join(p, ".metadata")):
        raise FileNotFoundError(
            f"{p!r} has no .metadata: not a torch.distributed.checkpoint directory, "
            "or its save did not finish (.metadata is written last)")
    md = _dcp().FileSystemReader(p).read_metadata()
    paths = md.planner_data or {}  # DCP's flattened key -> path in the saved tree
    md.planner_data = {k: tuple(paths.get(k, (k,))) for k in md.state_dict_metadata}
    return md



def _objects(path, md) -> dict:
    """The values that are not tensors (step, layout, hyperparameters)."""
    flat = {k: None for k, m in md.state_dict_metadata.items()
            if not _is_tensor(m)}
    if flat:
        _load_here(path, flat)
    return flat



def _flat_planner():
    """DCP's planner for a dict keyed as DCP flattened it. Non-tensor values go
    into the dict dcp.load copies back to ours (without flattening, the default
    planner puts them into a copy of its own, and they are lost)."""

    class Flat(_dcp().DefaultLoadPlanner):
        def load_bytes(self, read_item, value) -> None:
            self.original_state_dict[read_item.dest_index.fqn] = torch.load(
                value, weights_only=False)

    return Flat(flatten_state_dict=False)



def _load_here(path, flat: dict) -> None:
    """Fill `flat` from `path` in this process alone."""
    with warnings.catch_warnings():  # "assuming ... a single process": yes
        warnings.filterwarnings("ignore", message=".*single process")
        _dcp().load(flat, checkpoint_id=os.fspath(path), no_dist=True,
                    planner=_flat_planner())



def _nest(flat: dict, md) -> dict:
    """DCP's flattened keys back into the saved tree (lists where it had lists)."""
    root: dict = {}
    for key, value in flat.items():
        *parents, last = md.planner_data[key]
        node = root
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = value
    return _lists(root)



def _lists(node):
    if not isinstance(node, dict):
        return node
    out = {k: _lists(v) for k, v in node.items()}
    return [out[i] for i in sorted(out)] if out and all(
        isinstance(k, int) for k in out) else out
