"""Checkpoint reader: a local folder or a Hub repo id, validated up front, tensors read lazily.

Only ``*.safetensors`` and ``*.json`` files are ever read. Pickle checkpoints (``.bin``,
``.pt``...) are refused, never loaded, and so are the folders ``moetool shard`` writes (a rank
folder, a shard root): they are not models. Headers are parsed here (plain JSON) so that every
structural problem is found before any work starts; tensor data is then read one tensor (or
one expert slice) at a time with plain positioned reads into fresh buffers.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

from moetool.errors import JSON_ERRORS, MoetoolError
from moetool.memory import scratch as scratch_buffer
from moetool.read.manifest import MANIFEST_NAME, RANK_DIR_RE, read_json_object
from moetool.read.safetensors import TensorInfo, pread_exactly, read_safetensors_header, writable_bytes

if TYPE_CHECKING:
    import torch

    from moetool.model.families import MoELayerSpec

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")


def _check_relative(name: str, where: str) -> None:
    p = Path(name)
    if p.is_absolute() or ".." in p.parts or len(p.parts) != 1 or not name:  # shards sit next to the index
        raise MoetoolError(f"{where}: shard path {name!r} must be a plain relative file name")


class Checkpoint:
    """A validated safetensors checkpoint folder.

    ``tensors``: {name: TensorInfo} over all shards; ``config``: parsed config.json.
    Tensor data is read lazily with :meth:`get` / :meth:`get_rows`.
    """

    def __init__(self, root: Path, config: dict, tensors: dict[str, TensorInfo], files: list[str],
                 opened_as: dict[str, tuple[int, int, int, int]] | None = None):
        self.root = root
        self.config = config
        self.tensors = tensors
        self.files = files
        #: {file name: (size, mtime_ns, ctime_ns, inode)} of config.json and each shard, taken before
        #: they were read (:meth:`check_unchanged`)
        self.opened_as = opened_as or {}
        self._fds: dict[str, int] = {}
        #: read into page-locked buffers (set when tensors go on to a GPU)
        self.pin_memory = False
        self._suffix_index: dict[str, set[str]] | None = None

    def check_unchanged(self) -> None:
        """Raise unless config.json and every shard still have the size, modification and status
        change times and inode they had when the checkpoint was opened: an input rewritten while
        a conversion read it gives an output of neither version, which must not be marked
        complete."""
        for name, before in self.opened_as.items():
            try:
                now = file_identity(self.root / name)
            except OSError:
                now = None
            if now != before:
                raise MoetoolError(f"{self.root / name}: changed while moetool read it (size, modification or status "
                                   "change time, or inode); the output is left unfinished: re-run with --force to "
                                   "convert it again")

    # -- reading ---------------------------------------------------------------------------
    def suffixes(self, base: str, sep: str = ".") -> set[str]:
        """Suffixes stored for ``base``: ``base.weight``, ``base.weight_scale_inv``... -> {"weight",
        "weight_scale_inv"} (sep "."), or for a stacked base ``P.experts.w13`` the ``w13_*``
        tensors' suffixes (sep "_"). From an index built once, not a scan of every name."""
        if self._suffix_index is None:
            index: dict[str, set[str]] = {}
            for name in self.tensors:
                parent, _, last = name.rpartition(".")
                index.setdefault(parent, set()).add(last)
            self._suffix_index = index
        if sep == ".":
            return set(self._suffix_index.get(base, ()))
        parent, _, last = base.rpartition(".")
        head = last + sep
        return {s[len(head):] for s in self._suffix_index.get(parent, ()) if s.startswith(head)}

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def info(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise MoetoolError(f"{self.root}: tensor {name} not found in the checkpoint") from None

    def get(self, name: str, scratch: str | None = None) -> torch.Tensor:
        """Read one tensor into a fresh CPU tensor (plain reads, no memory map, so resident
        memory holds only the tensors in use, never a shard).

        ``scratch``: read into this thread's reusable buffer of that name instead
        (``moetool.memory.scratch``), for a tensor dropped before the thread reads into the
        same buffer again (an input that is converted, not written as it is)."""
        info = self.info(name)
        return self._read(info.file, info.begin, info.nbytes, scratch).view(info.dtype).reshape(info.shape)

    def get_rows(self, name: str, index: int) -> torch.Tensor:
        """``tensor[index]`` along dim 0, reading only that slice (fused expert tensors [E, ...])."""
        info = self.info(name)
        if not info.shape or not 0 <= index < info.shape[0]:
            raise MoetoolError(f"{name}: index {index} out of range for shape {list(info.shape)}")
        row = info.nbytes // info.shape[0]
        return self._read(info.file, info.begin + index * row, row).view(info.dtype).reshape(info.shape[1:])

    def _read(self, file: str, offset: int, nbytes: int, scratch: str | None = None) -> torch.Tensor:
        import torch

        fd = self._fds.get(file)
        if fd is None:
            # threads read one checkpoint at once (read-ahead, writers): one fd per file kept
            opened = os.open(self.root / file, os.O_RDONLY)
            fd = self._fds.setdefault(file, opened)
            if fd != opened:
                os.close(opened)
        if scratch is not None:
            buf = scratch_buffer(scratch, nbytes, torch.uint8, pin_memory=self.pin_memory)
        else:
            buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin_memory)
        pread_exactly(fd, writable_bytes(buf), offset, self.root / file)
        return buf

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __enter__(self) -> "Checkpoint":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def files_bytes(self) -> int:
        return sum((self.root / f).stat().st_size for f in self.files)

    def __repr__(self) -> str:
        return f"Checkpoint({self.root}, {len(self.tensors)} tensors in {len(self.files)} files)"


def resolve_source(source: str | os.PathLike, revision: str | None = None) -> Path:
    """A local folder as is, else a Hub repo id fetched (safetensors + json only) into the HF cache.

    Honours HF_HUB_OFFLINE and the local cache through huggingface_hub.
    """
    text = str(source)
    path = Path(os.path.expanduser(text)) if text.startswith("~") else Path(source)
    if path.exists():
        if not path.is_dir():
            raise MoetoolError(f"{path}: a checkpoint must be a folder (or a Hub repo id), not a file")
        if revision is not None:
            raise MoetoolError(f"--revision applies to Hub repo ids, but {path} is a local folder")
        return path
    if text.count("/") != 1 or text.startswith((".", "/", "~")) or text.endswith("/"):
        raise MoetoolError(f"{source}: no such folder, and not a Hub repo id of the form owner/name")
    if path.parent.is_dir():  # a mistyped local path (tiny/mixtrall), not a repo id: no Hub lookup
        raise MoetoolError(f"{source}: no such folder (the folder {path.parent} exists here, so this is "
                           "taken as a local path, not a Hub repo id)")
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError
    except ImportError as e:  # pragma: no cover - a runtime dependency
        raise MoetoolError(f"huggingface_hub is needed to fetch {source}: {e}") from None
    import huggingface_hub.errors as hf_errors

    offline = (LocalEntryNotFoundError,) + tuple(
        c for c in (getattr(hf_errors, "OfflineModeIsEnabled", None),) if c is not None)
    try:
        local = snapshot_download(text, revision=revision, allow_patterns=["*.safetensors", "*.json"])
    except offline:
        raise MoetoolError(f"{source}: not in the local Hugging Face cache and the Hub cannot be reached (HF_HUB_OFFLINE?)") from None
    except HfHubHTTPError as e:
        raise MoetoolError(f"{source}: Hub error: {str(e).splitlines()[0]}") from None
    except Exception as e:  # repository not found, revision not found, network...
        raise MoetoolError(f"{source}: cannot fetch from the Hub: {e.__class__.__name__}: {str(e).splitlines()[0] if str(e) else ''}") from None
    return Path(local)


# ------------------------------------------------------------------ outputs of ``moetool shard``
# They are not models: a rank folder holds one rank's experts renumbered from 0, a shard root
# holds only rank folders. Every command that reads a model refuses both here, in the one
# open path; ``verify`` and ``shard --merge`` read them through ``moetool.read.shards.EPShards``.

SHARD_COMMANDS = "`moetool verify` and `moetool shard --merge`"


class ShardOutputError(MoetoolError):
    """A folder written by ``moetool shard`` was given where a model is read. ``root``: the
    shard root (the folder given, or the parent of the rank folder given); ``rank``: the rank
    folder given, or None for a shard root."""

    def __init__(self, message: str, root: Path, rank: Path | None = None):
        super().__init__(message)
        self.root, self.rank = root, rank


def _shard_root_summary(root: Path) -> str | None:
    """'EP 4, finished' (or unfinished) for a folder written by ``moetool shard``, else None."""
    manifest = root / MANIFEST_NAME
    if manifest.is_file():
        data = read_json_object(manifest)
        if data is not None and data.get("kind") == "ep-shards":
            return f"EP {data.get('ep')}, finished"
    ranks = sorted(m.group(2) for p in root.iterdir() if p.is_dir() and (m := RANK_DIR_RE.fullmatch(p.name)))
    if ranks:
        return f"EP {int(ranks[0])}, unfinished: no {MANIFEST_NAME}"
    return None


def refuse_shard_output(root: Path, config: dict | None = None) -> None:
    """Raise ShardOutputError when ``root`` is a shard root, or (its ``config.json`` given) one
    rank folder of ``moetool shard``, which a command reading a model must not take."""
    if config is None:
        summary = _shard_root_summary(root)
        if summary is not None:
            raise ShardOutputError(
                f"{root}: is the output of moetool shard ({summary}), not a model; "
                f"{SHARD_COMMANDS} take it", root)
        return
    ep = config.get("moetool_ep")
    if ep is None:
        return
    ep = ep if isinstance(ep, dict) else {}
    parent = root.parent if RANK_DIR_RE.fullmatch(root.name) else None
    where = f"rank {ep.get('rank')} of {ep.get('ep')}" if "rank" in ep and "ep" in ep else "one rank"
    raise ShardOutputError(
        f"{root}: is one rank folder ({where}) of a moetool shard output, not a model: it holds only that "
        f"rank's experts, renumbered from 0; {SHARD_COMMANDS} take the shard folder"
        + (f" ({parent})" if parent is not None else ""), parent or root, root)


def file_identity(path: Path) -> tuple[int, int, int, int]:
    """(size, mtime_ns, ctime_ns, inode) of ``path``, through a link: what a rewrite in place
    or a file renamed over it changes (the status change time also when the old mtime is put
    back: ``cp -p``, ``touch -r``; moetool never links or renames an input)."""
    st = os.stat(path)
    return st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino


def open_checkpoint(source: str | os.PathLike, revision: str | None = None, *,
                    ep_rank: bool = False) -> Checkpoint:
    """Resolve ``source`` and validate it completely; see module docstring for what is checked.

    A shard root or (unless ``ep_rank``: the readers of shards, and ``inspect``) one rank
    folder of ``moetool shard`` output is refused with a :class:`ShardOutputError`."""
    root = resolve_source(source, revision)
    names = sorted(p.name for p in root.iterdir() if p.is_file())
    st_files = [n for n in names if n.endswith(".safetensors")]
    pickles = [n for n in names if n.endswith(PICKLE_SUFFIXES)]
    if not st_files:
        if pickles:
            raise MoetoolError(
                f"{root / pickles[0]}: pickle checkpoints are refused (never loaded); convert the model to safetensors first"
            )
        refuse_shard_output(root)
        raise MoetoolError(f"{root}: no .safetensors files found")
    config_path = root / "config.json"
    if not config_path.is_file():
        raise MoetoolError(f"{config_path}: not found (every checkpoint needs its config.json)")
    opened_as = {"config.json": file_identity(config_path)}
    try:
        config = json.loads(config_path.read_text())
    except JSON_ERRORS as e:
        raise MoetoolError(f"{config_path}: invalid JSON ({e})") from None
    if not isinstance(config, dict):
        raise MoetoolError(f"{config_path}: not a JSON object")
    for key in ("quantization_config", "text_config"):
        if config.get(key) is not None and not isinstance(config[key], dict):
            raise MoetoolError(f"{config_path}: {key} is {json.dumps(config[key])[:60]}, not a JSON object")
    if not ep_rank:
        refuse_shard_output(root, config)

    index_path = root / INDEX_NAME
    weight_map: dict[str, str] | None = None
    if index_path.is_file():
        try:
            index = json.loads(index_path.read_text())
            weight_map = index["weight_map"]
            if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                raise TypeError
        except (KeyError, TypeError, *JSON_ERRORS):
            raise MoetoolError(f"{index_path}: invalid index (needs a JSON object with a weight_map)") from None
        shard_names = sorted(set(weight_map.values()))
        for shard in shard_names:
            _check_relative(shard, str(index_path))
            if not (root / shard).is_file():
                raise MoetoolError(f"{root / shard}: shard named in {INDEX_NAME} is missing")
        for extra in sorted(set(st_files) - set(shard_names)):
            raise MoetoolError(f"{root / extra}: shard is not listed in {INDEX_NAME}")
    elif len(st_files) > 1 and SINGLE_NAME in st_files:
        raise MoetoolError(f"{root}: has {SINGLE_NAME} and other .safetensors files but no {INDEX_NAME}")
    else:
        shard_names = st_files

    tensors: dict[str, TensorInfo] = {}
    for shard in shard_names:
        opened_as[shard] = file_identity(root / shard)
        _, infos, _ = read_safetensors_header(root / shard)
        for name, info in infos.items():
            if name in tensors:
                raise MoetoolError(f"{root / shard}: tensor {name} also stored in {tensors[name].file}")
            if weight_map is not None and weight_map.get(name) != shard:
                where = weight_map.get(name)
                raise MoetoolError(
                    f"{root / shard}: tensor {name} is not in {INDEX_NAME}" if where is None
                    else f"{root / shard}: tensor {name} is indexed under {where}"
                )
            tensors[name] = info
    if weight_map is not None:
        for name, shard in weight_map.items():
            if name not in tensors:
                raise MoetoolError(f"{root / shard}: tensor {name} is listed in {INDEX_NAME} but absent from its shard")
    return Checkpoint(root, config, dict(sorted(tensors.items())), list(shard_names), opened_as)


def expert_tensor_names(ckpt: Checkpoint, layer: MoELayerSpec) -> set[str]:
    """Every input tensor holding a routed expert of ``layer`` (whatever is not one is copied,
    or dequantized, as a non-expert tensor)."""
    st = layer.storage
    names: set[str] = set()
    if st.kind == "per-expert":
        for e in range(layer.n_stored):
            for base in st.per_expert_bases(e):
                names |= {f"{base}.{s}" for s in ckpt.suffixes(base)}
    elif st.kind == "stacked":
        names |= {n for n in ckpt.tensors if n.startswith(st.gate_up + "_") or n.startswith(st.down + "_")}
    elif st.fused_suffixes:
        names |= {f"{base}_{s}" for base in (st.gate_up, st.down) for s in st.fused_suffixes}
        names |= {b for b in (st.gate_up_bias, st.down_bias) if b}
    else:
        names |= {st.gate_up, st.down}
        names |= {b for b in (st.gate_up_bias, st.down_bias) if b}
    return names
