"""A sharded checkpoint's files, read in one process with no ranks: the
whole state as a plain state_dict (`load_full_state_dict`), what each file holds
(`checkpoint_bytes`), and the helpers sharded_checkpoint.py saves and loads with.
DCP writes one file per rank (__r_0.distcp) and .metadata, each tensor chunk in
torch.save's container (`checkpoint_bytes` tells the framing from the elements).

A save goes to DIR.saving beside DIR; DCP's coordinator, once every rank has
written, adds COMPLETE (each file's size) and renames it to DIR (an old DIR goes
to DIR.replaced first, then away). So DIR is always one whole save, and a folder
without COMPLETE, or whose files are not those sizes, is refused on load.
"""

from __future__ import annotations

import json
import math
import os
import re
import warnings
from dataclasses import dataclass

import torch

COMPLETE = ".labkit-complete"  # written last, in the temporary folder
SAVING, REPLACED = ".saving", ".replaced"  # DIR + these: the folders beside DIR
_DCP_FILE = re.compile(r"(__\d+_\d+\.distcp|(__\d+)?\.metadata(\.tmp)?)")
_DAMAGED = ("Copy the checkpoint again from where it was saved, or use another "
            "one (a copy cut short, or a full disk, leaves files so)")


def _dcp():
    import torch.distributed.checkpoint as dcp

    return dcp



def is_tensor_entry(m) -> bool:
    """A TensorStorageMetadata (the other kind, BytesStorageMetadata, is a
    pickled value: the step, a hyperparameter)."""
    return hasattr(m, "chunks")



def load_full_state_dict(path) -> dict:
    """The checkpoint at `path`, read in one process (no process group):
    {"model": {every name: the whole tensor in the parameter's shape}, "optim":
    torch's full optimizer state_dict keyed by names, if saved, "step": int}."""
    md = read_metadata(path)
    flat = {k: torch.empty(m.size, dtype=m.properties.dtype) if is_tensor_entry(m)
            else None for k, m in md.state_dict_metadata.items()}
    _load_here(path, flat)
    tree = nest(flat, md)
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
    md = read_metadata(path)
    rows: dict[str, list] = {}  # file -> [listed, tensor bytes, tensors, objects]
    for idx, info in md.storage_data.items():
        row = rows.setdefault(info.relative_path, [0, 0, 0, 0])
        row[0] += info.length
        m = md.state_dict_metadata[idx.fqn]
        if not is_tensor_entry(m):
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



def read_metadata(path):
    """.metadata of the checkpoint at `path`, once its save is known to have
    finished and its files to be whole; else an error naming the folder or file."""
    p = os.fspath(path)
    if not os.path.isdir(p):
        old = os.path.normpath(p) + REPLACED
        raise FileNotFoundError(
            f"no checkpoint at {p!r}: no such directory (save_sharded makes one)"
            + (f"; a save cut short left {old!r}, the checkpoint before it, whole: "
               f"rename it to {os.path.basename(os.path.normpath(p))!r} to load "
               "it, or save again" if os.path.isdir(old) else ""))
    if os.path.normpath(p).endswith(SAVING):
        raise ValueError(
            f"{p!r} is the temporary folder of a save_sharded that did not finish "
            f"(renamed to {os.path.normpath(p)[:-len(SAVING)]!r} only once every "
            "rank has written): load that checkpoint, or save again")
    if not os.path.exists(os.path.join(p, ".metadata")):
        raise FileNotFoundError(
            f"{p!r} has no .metadata: not a torch.distributed.checkpoint directory, "
            "or its save did not finish (.metadata is written last)")
    if not os.path.exists(os.path.join(p, COMPLETE)):
        raise ValueError(
            f"{p!r} has no {COMPLETE}, which save_sharded writes last: its save "
            "did not finish, or it was written in place (by dcp.save, or an older "
            "labkit), so its files may mix two saves. Save again; only if you know "
            f"its save finished, create an empty {COMPLETE} in it to load it")
    _check_sizes(p)
    try:
        md = _dcp().FileSystemReader(p).read_metadata()
    except Exception as e:  # noqa: BLE001 (pickle raises many kinds)
        raise ValueError(
            f"{os.path.join(p, '.metadata')!r} cannot be read ({type(e).__name__}: "
            f"{e}): the file is damaged. {_DAMAGED}") from None
    for name, need in _extents(md).items():
        f = os.path.join(p, name)
        size = os.path.getsize(f) if os.path.exists(f) else None
        if size is None or size < need:
            raise ValueError(
                f"{f!r} is " + ("missing" if size is None else f"{size:,} B") +
                f", but .metadata lists {need:,} B in it: it is truncated. "
                f"{_DAMAGED}")
    paths = md.planner_data or {}  # DCP's flattened key -> path in the saved tree
    md.planner_data = {k: tuple(paths.get(k, (k,))) for k in md.state_dict_metadata}
    return md



def _check_sizes(p: str) -> None:
    """Each file as large as COMPLETE says it was when its save finished (an
    empty COMPLETE, made by hand, says nothing)."""
    try:
        with open(os.path.join(p, COMPLETE), encoding="utf-8") as f:
            sizes = json.loads(f.read() or "{}").get("files", {})
    except (ValueError, AttributeError):
        raise ValueError(f"{os.path.join(p, COMPLETE)!r} is damaged. "
                         f"{_DAMAGED}") from None
    for name, was in sizes.items():
        f = os.path.join(p, name)
        size = os.path.getsize(f) if os.path.exists(f) else None
        if size != was:
            raise ValueError(
                f"{f!r} is " + ("missing" if size is None else f"{size:,} B") +
                f", but was {was:,} B when its save finished: it is truncated or "
                f"was changed since. {_DAMAGED}")


def _extents(md) -> dict[str, int]:
    """file -> the bytes .metadata says it holds (the end of its last item)."""
    out: dict[str, int] = {}
    for info in md.storage_data.values():
        out[info.relative_path] = max(out.get(info.relative_path, 0),
                                      info.offset + info.length)
    return out


def dcp_load(path, state: dict, **kw) -> None:
    """dcp.load, a failure said as the checkpoint's (DCP's own names no file)."""
    dcp = _dcp()
    try:
        dcp.load(state, checkpoint_id=os.fspath(path), **kw)
    except dcp.CheckpointException as e:
        rank, (exc, _) = next(iter(e.failures.items()))
        raise ValueError(
            f"reading the checkpoint at {os.fspath(path)!r} failed on rank(s) "
            f"{sorted(e.failures)} (rank {rank}: {type(exc).__name__}: {exc}): a "
            f"file in it may be damaged. {_DAMAGED}") from e


# -- saving: into DIR.saving, then renamed to DIR ------------------------------------


def _ours(name: str) -> bool:
    """A file a save writes (DCP's, COMPLETE)."""
    return name == COMPLETE or _DCP_FILE.fullmatch(name) is not None


def _check_target(target: str) -> None:
    """Refuse, on every rank before any writing, a path save_sharded must not
    replace: it replaces the whole folder, so only a checkpoint's."""
    name = os.path.basename(target)
    if name.endswith((SAVING, REPLACED)):
        raise ValueError(f"{target!r}: names ending {SAVING} or {REPLACED} are "
                         "save_sharded's own folders beside a checkpoint: choose "
                         "another name")
    for folder in (target, target + SAVING, target + REPLACED):
        if os.path.lexists(folder) and not os.path.isdir(folder):
            raise ValueError(f"{folder!r} exists and is not a folder: save_sharded "
                             "would replace it; choose another path, or move it")
        foreign = sorted(f for f in os.listdir(folder) if not _ours(f)) \
            if os.path.isdir(folder) else []
        if foreign:
            raise ValueError(
                f"{folder!r} holds what no checkpoint holds ({', '.join(foreign[:4])}"
                f"{' ...' if len(foreign) > 4 else ''}); save_sharded replaces the "
                "whole folder, so it saves only into a new folder or over a "
                "checkpoint: choose another path, or move those out")


def _remove(folder: str) -> None:
    """A folder of a save's files (checked by _check_target), and them."""
    if os.path.isdir(folder):
        for f in os.listdir(folder):
            if _ours(f):
                os.remove(os.path.join(folder, f))
        os.rmdir(folder)  # fails, and says so, if anything else came in since


def _fsync_dir(folder: str) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:  # a platform that cannot open folders: rename is still atomic
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _writer(target: str):
    """DCP's FileSystemWriter into target + SAVING; its coordinator empties
    that folder before any rank writes (a save cut short may have left files),
    and after .metadata adds COMPLETE and renames the folder to target."""

    class Writer(_dcp().FileSystemWriter):
        def _metadata_exists(self) -> bool:  # a stale .metadata: we replace it
            return False

        def prepare_global_plan(self, plans):
            tmp = os.fspath(self.path)
            for f in os.listdir(tmp):  # every rank has made it; none has written
                if _ours(f):  # all are (_check_target): a save cut short left them
                    os.remove(os.path.join(tmp, f))
            return super().prepare_global_plan(plans)

        def finish(self, metadata, results) -> None:
            super().finish(metadata, results)  # .metadata, via .metadata.tmp
            tmp = os.fspath(self.path)
            sizes = {f: os.path.getsize(os.path.join(tmp, f)) for f in os.listdir(tmp)}
            with open(os.path.join(tmp, COMPLETE), "w", encoding="utf-8") as f:
                json.dump({"saved_by": "labkit.parallel.save_sharded",
                           "files": sizes}, f)
                f.flush()
                os.fsync(f.fileno())
            _fsync_dir(tmp)
            if os.path.isdir(target):
                _remove(target + REPLACED)  # older still: a save cut short left it
                os.rename(target, target + REPLACED)
            os.rename(tmp, target)  # (no target: .replaced, if any, is kept till now)
            _fsync_dir(os.path.dirname(target))
            try:  # the save is done: a file that came in since keeps the folder
                _remove(target + REPLACED)
            except OSError:
                pass

    return Writer(target + SAVING)


def dcp_save(path, state: dict, group) -> None:
    """dcp.save of `state` into `path`, whole or not at all (see the top)."""
    dcp, target = _dcp(), os.path.abspath(os.fspath(path))
    _check_target(target)
    try:
        with warnings.catch_warnings():  # "assuming ... a single process": yes
            warnings.filterwarnings("ignore", message=".*single process")
            dcp.save(state, storage_writer=_writer(target), process_group=group)
    except dcp.CheckpointException as e:
        rank, (exc, _) = next(iter(e.failures.items()))
        raise RuntimeError(
            f"save_sharded to {target!r} failed on rank(s) {sorted(e.failures)} "
            f"(rank {rank}: {type(exc).__name__}: {exc}); the checkpoint there, if "
            "any, is as it was") from e


def read_values(path, md) -> dict:
    """The values that are not tensors (step, layout, hyperparameters)."""
    flat = {k: None for k, m in md.state_dict_metadata.items()
            if not is_tensor_entry(m)}
    if flat:
        _load_here(path, flat)
    return flat



def flat_planner():
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
        dcp_load(path, flat, no_dist=True, planner=flat_planner())



def nest(flat: dict, md) -> dict:
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
