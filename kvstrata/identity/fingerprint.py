"""What makes stored KV bytes compatible: format versions, fingerprints, namespaces.

* :data:`FORMAT_VERSION`: the hash chain and the byte layout of a block.
* :data:`RECORD_VERSION`: the SSD tier's on-disk record format.
* :class:`Fingerprint`: everything that makes KV bytes incompatible (model
  identity, dtype, KV dtype, block size and bytes, layers, KV heads, head
  size, tensor/pipeline-parallel size, hash algorithm, format). Its
  :meth:`~Fingerprint.namespace` roots every hash chain (shared by all TP
  ranks, the keys the scheduler side computes); :meth:`~Fingerprint.tier_id`
  adds the TP rank and names the SSD tier's namespace (each rank stores its
  own shard of every block).
* :func:`model_identity`: a portable, safe identity for a checkpoint. The
  same weights loaded from two paths get the same identity (replicas can
  share a tier); different weights never do, fine-tunes of one architecture
  included. A directory path is not an identity, and neither is
  ``config.json``: the identity is derived from the weight files' contents
  (the Hugging Face cache's content-addressed blob names when the files come
  from there, else an xxh3-128 digest of each file, computed once per file
  version and remembered in ``~/.cache/kvstrata-ids/model-ids.json``, keyed by path,
  size, mtime, ctime and inode). An explicit ``model.id`` overrides it, for
  deployments that know better. (A Hugging Face snapshot and a plain copy of
  it are identified differently, blob names against content digests: they do
  not share blocks unless ``model.id`` says they are the same.)
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterator

from kvstrata.errors import ConfigError

__all__ = ["FORMAT_VERSION", "RECORD_VERSION", "PREVIOUS_NAME", "Fingerprint", "model_identity", "content_identity"]

log = logging.getLogger(__name__)

# Bumped whenever the hash chain, the namespace derivation or a block's byte layout changes:
# blocks written under another version are never visible.
FORMAT_VERSION = 3
# Bumped whenever the SSD tier's record format changes: an environment of another
# version is emptied at open (logged), never misread. Format 3: the project's name in
# the SSD tier's files (meta record, lock and clean-close files), the remote tier's
# keys and the trace header is ``kvstrata``.
RECORD_VERSION = 3
#: The project's name before format 3, as its releases wrote it into their on-disk formats
#: (the SSD tier's meta record, lock and clean-close files; the trace header). Read only to
#: recognise what they left: an SSD directory is refused with the way out, a trace is read.
PREVIOUS_NAME = "tier" "kv"

# Files whose bytes determine the KV a checkpoint computes for given token ids.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".msgpack", ".h5", ".npz")
_CONFIG_FILES = ("config.json", "params.json")
_HEX64 = re.compile(r"[0-9a-f]{40}([0-9a-f]{24})?")
_CHUNK = 16 * 1024**2


@dataclass(frozen=True)
class Fingerprint:
    """Everything that makes KV bytes incompatible. Equal fingerprints share blocks."""

    model: str
    dtype: str
    kv_dtype: str
    block_size: int
    block_nbytes: int
    layers: int
    kv_heads: int
    head_size: int
    hash: str = "sha256"
    tp_size: int = 1
    pp_size: int = 1
    variant: str = ""  # what the engine changes beyond the files (quantization, config overrides)
    kv_layout: str = ""  # the engine's physical KV layout (vLLM's KVCacheLayout name): a block's bytes depend on it
    groups: str = ""  # the KV-cache groups when not one full-attention group (kvstrata.identity.groups)
    format: int = FORMAT_VERSION

    def namespace(self) -> bytes:
        """The hash-chain namespace: a canonical serialisation of every field (``groups`` only
        when there are groups, so one-group deployments keep their keys)."""
        fields = asdict(self)
        if not self.groups:
            del fields["groups"]
        return json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()

    def tier_id(self, tp_rank: int = 0, pp_rank: int = 0) -> str:
        """The SSD tier's fingerprint for one worker's shard: its tensor-parallel rank and,
        with several pipeline stages, its stage (each holds other layers)."""
        if not 0 <= tp_rank < self.tp_size:
            raise ValueError(f"tp_rank: expected 0..{self.tp_size - 1}, got {tp_rank}")
        if not 0 <= pp_rank < self.pp_size:
            raise ValueError(f"pp_rank: expected 0..{self.pp_size - 1}, got {pp_rank}")
        stage = b"|pp_rank=%d" % pp_rank if self.pp_size > 1 else b""
        return hashlib.sha256(self.namespace() + b"|tp_rank=%d" % tp_rank + stage).hexdigest()

    def describe(self) -> str:
        return (f"{self.model} {self.dtype}/{self.kv_dtype} block {self.block_size} tokens "
                f"({self.block_nbytes} B) {self.layers}x{self.kv_heads}x{self.head_size} tp {self.tp_size}"
                + (f" layout {self.kv_layout}" if self.kv_layout else "")
                + (f" groups {self.groups}" if self.groups else ""))


def model_identity(model: str, revision: str | None = None, override: str | None = None) -> str:
    """The identity of the checkpoint ``model`` (a local directory or a Hugging Face id).

    ``override`` (``model.id``) wins. A local directory is identified by its
    contents; a hub id by the contents of its snapshot in the local Hugging Face
    cache. Raises :class:`ConfigError` when neither can be read, rather than
    guess: a wrong identity would serve another model's KV.
    """
    if override:
        return f"id:{override}"
    path = Path(os.path.expanduser(model))
    if path.is_dir():
        return content_identity(path)
    snapshot = _hub_snapshot(model, revision)
    if snapshot is not None:
        return content_identity(snapshot)
    raise ConfigError(f"model.id: cannot identify the checkpoint {model!r} (revision {revision!r}): it is neither "
                      "a local directory nor in the local Hugging Face cache; set model.id to a name that "
                      "identifies these exact weights")


def content_identity(directory: str | os.PathLike[str]) -> str:
    """``sha:<digest>`` over the weight and config files of ``directory`` (not its path)."""
    root = Path(directory)
    files = sorted(p for p in root.rglob("*") if p.is_file() and _counts(p))
    if not any(p.suffix in _WEIGHT_SUFFIXES for p in files):
        raise ConfigError(f"model.id: {root} holds no weight files ({', '.join(_WEIGHT_SUFFIXES)}); "
                          "set model.id to identify the checkpoint")
    with _DigestCache.locked() as cache:  # the engine's processes hash a checkpoint once
        parts = [f"{p.relative_to(root).as_posix()}={cache.digest(p)}" for p in files]
        cache.save()
    return "sha:" + hashlib.sha256("\n".join(parts).encode()).hexdigest()


def _counts(path: Path) -> bool:
    return path.suffix in _WEIGHT_SUFFIXES or path.name in _CONFIG_FILES


def _hub_snapshot(repo_id: str, revision: str | None) -> Path | None:
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        return None
    try:
        return Path(snapshot_download(repo_id, revision=revision, local_files_only=True))
    except Exception:  # not cached, not a repo id, hub library errors: unidentifiable here
        return None


#: where checkpoint files' digests are remembered: a directory of its own, never the default
#: ``ssd.path`` (``~/.cache/kvstrata``), whose SSD tier takes only a directory it owns
DIGEST_CACHE = "~/.cache/kvstrata-ids/model-ids.json"
_OLD_DIGEST_CACHE = "~/.cache/kvstrata/model-ids.json"  # before: read once, then moved


class _DigestCache:
    """Per-file digests, remembered by (real path, size, mtime, inode) across processes.

    Used under :meth:`locked`: the scheduler and every worker of an engine identify the
    checkpoint at start-up, and without the lock each would read all of its weights (and
    the last to save would drop the others' entries)."""

    def __init__(self) -> None:
        self.path = Path(os.path.expanduser(DIGEST_CACHE))
        self.entries: dict[str, str] = {}
        self.dirty = False
        for path in (self.path, Path(os.path.expanduser(_OLD_DIGEST_CACHE))):
            try:
                loaded = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
            if isinstance(loaded, dict):
                self.entries = {str(k): str(v) for k, v in loaded.items()}
                self.dirty = path != self.path  # an earlier version's cache: moved on save
            break

    @classmethod
    @contextlib.contextmanager
    def locked(cls) -> Iterator["_DigestCache"]:
        """The cache, read and used under an exclusive lock on ``model-ids.lock`` (best
        effort: where the lock cannot be taken, each process works on its own)."""
        import fcntl

        lock = Path(os.path.expanduser(DIGEST_CACHE)).with_suffix(".lock")
        fd = -1
        try:
            lock.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError as exc:
            log.debug("kvstrata: cannot lock %s: %s", lock, exc)
        try:
            yield cls()  # read after the lock: it sees what the previous holder saved
        finally:
            if fd >= 0:
                os.close(fd)

    def digest(self, path: Path) -> str:
        blob = _hf_blob_digest(path)
        if blob is not None:
            return blob
        real = os.path.realpath(path)
        st = os.stat(real)
        # ctime too: a rewrite in place that restores the mtime still moves the ctime
        key = f"{real}|{st.st_size}|{st.st_mtime_ns}|{st.st_ctime_ns}|{st.st_ino}"
        got = self.entries.get(key)
        if got is None:
            if st.st_size > 1024**3:
                log.info("kvstrata: identifying %s (%.1f GiB) by content, once per file version", real,
                         st.st_size / 1024**3)
            got = self.entries[key] = _file_digest(real)
            self.dirty = True
        return got

    def save(self) -> None:
        if not self.dirty:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as fh:
                json.dump(self.entries, fh)
            os.replace(tmp, self.path)
        except OSError as exc:  # only a cache: the digests are recomputed next time
            log.debug("kvstrata: cannot save model digests to %s: %s", self.path, exc)
            return
        _drop_old_cache()


def _drop_old_cache() -> None:
    """Remove an earlier version's digest cache from ``~/.cache/kvstrata``, the default
    ``ssd.path``: an SSD tier refuses a directory holding files that are not its own."""
    old = Path(os.path.expanduser(_OLD_DIGEST_CACHE))
    for path in (old, old.with_suffix(".lock")):
        try:
            path.unlink()
        except OSError:
            pass


def _hf_blob_digest(path: Path) -> str | None:
    """The content hash the Hugging Face cache names a file's blob by (sha256 for LFS files,
    git sha1 otherwise), when ``path`` is a symlink into a ``blobs`` directory."""
    if not path.is_symlink():
        return None
    target = Path(os.path.realpath(path))
    if target.parent.name == "blobs" and _HEX64.fullmatch(target.name):
        return f"blob:{target.name}"
    return None


def _file_digest(path: str) -> str:
    import xxhash

    h = xxhash.xxh3_128()
    size = 0
    with open(path, "rb", buffering=0) as fh:
        buf = bytearray(_CHUNK)
        view = memoryview(buf)
        while True:
            n = fh.readinto(buf)
            if not n:
                break
            h.update(view[:n])
            size += n
    return f"xxh3:{size}:{h.hexdigest()}"

