"""Checkpoint identity (``model_identity`` / ``content_identity``) and ``Fingerprint``.

Every test works on real checkpoint directories: the tiny random-weight Llama
of ``tests/vllm_util.py`` (written offline with torch/transformers), copied,
linked, edited or laid out the way the Hugging Face cache stores it. ``HOME``
points at a per-test directory, so the per-file digest cache
(``~/.cache/kvstrata-ids/model-ids.json``) starts empty in every test.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import kvstrata.identity.fingerprint as identity
from kvstrata.errors import ConfigError
from kvstrata.identity.fingerprint import Fingerprint, content_identity, model_identity
from vllm_util import build_tiny_llama

WEIGHTS = "model.safetensors"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


# --------------------------------------------------------------------------- fixtures and helpers

@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The pristine checkpoint; tests work on copies of it."""
    path = build_tiny_llama(tmp_path_factory.mktemp("pristine") / "tiny-llama")
    assert {WEIGHTS, "config.json", *TOKENIZER_FILES} <= {p.name for p in path.iterdir()}
    return path


@pytest.fixture(autouse=True)
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private HOME: the digest cache lives under it."""
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    return home


def digest_cache(home: Path) -> Path:
    return home / ".cache" / "kvstrata-ids" / "model-ids.json"


def copy_of(tiny: Path, dest: Path) -> Path:
    shutil.copytree(tiny, dest)
    return dest


def bump_one_tensor(weights: Path, delta: float = 1e-3, *, element: bool = False) -> str:
    """Add ``delta`` to one tensor (or to one element of it) and save the file back in
    place with the same tensor names, order and metadata. Returns the tensor's name."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(weights), framework="pt") as fh:
        metadata = fh.metadata()
        tensors = {name: fh.get_tensor(name) for name in fh.keys()}
    name = "model.layers.0.self_attn.k_proj.weight"
    if element:
        tensors[name].view(-1)[0] += delta
    else:
        tensors[name] = tensors[name] + delta
    size = weights.stat().st_size
    save_file(tensors, str(weights), metadata=metadata)
    assert weights.stat().st_size == size, "the edit must not change the file's size"
    return name


def count_digests(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Record every file the identity code reads to digest."""
    read: list[str] = []
    real = identity._file_digest

    def counting(path: str) -> str:
        read.append(os.path.basename(path))
        return real(path)

    monkeypatch.setattr(identity, "_file_digest", counting)
    return read


def forbid_digests(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(path: str) -> str:
        raise AssertionError(f"{path} was read to compute its digest")

    monkeypatch.setattr(identity, "_file_digest", refuse)


def git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def hf_snapshot(hf_home: Path, repo_id: str, commit: str, files: dict[str, tuple[str, bytes]]) -> Path:
    """Lay out ``repo_id`` in the Hugging Face cache under ``hf_home``: each snapshot file is
    a relative symlink to ``blobs/<blob name>`` holding the given bytes; ``refs/main``
    names ``commit``."""
    repo = hf_home / "hub" / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    (repo / "refs").mkdir(exist_ok=True)
    snapshot.mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    for name, (blob, data) in files.items():
        (repo / "blobs" / blob).write_bytes(data)
        (snapshot / name).symlink_to(Path("..", "..", "blobs", blob))
    return snapshot


def hf_files(tiny: Path, weights: bytes | None = None) -> dict[str, tuple[str, bytes]]:
    """The tiny checkpoint's files with the blob names the hub gives them (sha256 for the
    LFS weights, git's blob sha1 for the rest); ``weights`` replaces the weight blob's
    bytes without renaming it."""
    out = {}
    for p in sorted(tiny.iterdir()):
        data = p.read_bytes()
        blob = hashlib.sha256(data).hexdigest() if p.suffix == ".safetensors" else git_blob_sha1(data)
        out[p.name] = (blob, weights if (weights is not None and p.name == WEIGHTS) else data)
    return out


COMMIT_A = "a" * 40
COMMIT_B = "b" * 40


# --------------------------------------------------------------------------- same weights, same identity

def test_copies_in_two_directories_share_identity(tiny: Path, tmp_path: Path) -> None:
    a = copy_of(tiny, tmp_path / "replica-a" / "llama")
    b = copy_of(tiny, tmp_path / "elsewhere" / "deeper" / "other-name")
    ident = content_identity(a)
    assert ident.startswith("sha:")
    assert content_identity(b) == ident
    assert model_identity(str(a)) == model_identity(str(b)) == ident


def test_symlinked_directory_shares_identity(tiny: Path, tmp_path: Path, home: Path) -> None:
    real = copy_of(tiny, tmp_path / "real")
    link = tmp_path / "link"
    link.symlink_to(real, target_is_directory=True)
    assert model_identity(str(link)) == model_identity(str(real))
    # a path under ~ (expanded against HOME) and a relative path reach the same files
    (home / "models").mkdir()
    (home / "models" / "tiny").symlink_to(real, target_is_directory=True)
    assert model_identity("~/models/tiny") == model_identity(str(real))
    old = os.getcwd()
    try:
        os.chdir(tmp_path)
        assert model_identity("link") == model_identity(str(real))
    finally:
        os.chdir(old)


def test_weight_files_linked_from_elsewhere_share_identity(tiny: Path, tmp_path: Path) -> None:
    """A directory of symlinks to the weight files (not Hugging Face blobs) is digested
    through the links."""
    real = copy_of(tiny, tmp_path / "real")
    linked = tmp_path / "linked"
    linked.mkdir()
    for p in real.iterdir():
        (linked / p.name).symlink_to(p)
    assert content_identity(linked) == content_identity(real)


# --------------------------------------------------------------------------- different weights or config

def test_fine_tune_gets_another_identity(tiny: Path, tmp_path: Path) -> None:
    base = copy_of(tiny, tmp_path / "base")
    tuned = copy_of(tiny, tmp_path / "tuned")
    bump_one_tensor(tuned / WEIGHTS)
    assert (tuned / "config.json").read_bytes() == (base / "config.json").read_bytes()
    assert (tuned / WEIGHTS).stat().st_size == (base / WEIGHTS).stat().st_size
    assert content_identity(tuned) != content_identity(base)
    assert model_identity(str(tuned)) != model_identity(str(base))


def test_one_element_changed_in_place_changes_identity(tiny: Path, tmp_path: Path) -> None:
    """The same directory, weights rewritten (a new file version): the cached digest of the
    old version must not be served."""
    ckpt = copy_of(tiny, tmp_path / "ckpt")
    before = content_identity(ckpt)
    assert content_identity(ckpt) == before
    bump_one_tensor(ckpt / WEIGHTS, element=True)
    after = content_identity(ckpt)
    assert after != before
    assert content_identity(copy_of(ckpt, tmp_path / "copy")) == after


def _edit_rope_theta(config: Path, theta: float) -> None:
    cfg = json.loads(config.read_text())
    if isinstance(cfg.get("rope_parameters"), dict):
        cfg["rope_parameters"]["rope_theta"] = theta
    else:
        cfg["rope_theta"] = theta
    config.write_text(json.dumps(cfg, indent=2))


def test_config_counts(tiny: Path, tmp_path: Path) -> None:
    base = copy_of(tiny, tmp_path / "base")
    other = copy_of(tiny, tmp_path / "rope")
    _edit_rope_theta(other / "config.json", 500000.0)
    assert (other / WEIGHTS).read_bytes() == (base / WEIGHTS).read_bytes()
    assert content_identity(other) != content_identity(base)


@pytest.mark.parametrize("files", [("config.json",), ("config.json", *TOKENIZER_FILES), ()],
                         ids=["config-only", "config-and-tokenizer", "empty"])
def test_directory_without_weights_is_not_an_identity(tiny: Path, tmp_path: Path, files: tuple[str, ...]) -> None:
    d = tmp_path / "no-weights"
    d.mkdir()
    for name in files:
        shutil.copy(tiny / name, d / name)
    with pytest.raises(ConfigError, match=r"model\.id"):
        content_identity(d)
    with pytest.raises(ConfigError, match=r"model\.id"):
        model_identity(str(d))


def test_tokenizer_files_do_not_count(tiny: Path, tmp_path: Path) -> None:
    base = copy_of(tiny, tmp_path / "base")
    other = copy_of(tiny, tmp_path / "other-tokenizer")
    tok = json.loads((other / "tokenizer.json").read_text())
    tok["added_tokens"].append({"id": 999, "content": "<extra>", "single_word": False, "lstrip": False,
                                "rstrip": False, "normalized": False, "special": True})
    (other / "tokenizer.json").write_text(json.dumps(tok))
    tcfg = json.loads((other / "tokenizer_config.json").read_text())
    tcfg["model_max_length"] = 123
    (other / "tokenizer_config.json").write_text(json.dumps(tcfg))
    (other / "special_tokens_map.json").write_text(json.dumps({"pad_token": "<extra>"}))
    (other / "tokenizer.model").write_bytes(b"sentencepiece stand-in")
    (other / "generation_config.json").write_text(json.dumps({"temperature": 0.1}))
    assert content_identity(other) == content_identity(base)
    # and the comparison is not vacuous: the weights of ``other`` do count
    bump_one_tensor(other / WEIGHTS)
    assert content_identity(other) != content_identity(base)


# --------------------------------------------------------------------------- explicit override

def test_override_wins_and_ignores_the_files(tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    base = copy_of(tiny, tmp_path / "base")
    tuned = copy_of(tiny, tmp_path / "tuned")
    bump_one_tensor(tuned / WEIGHTS)
    content = content_identity(base)
    forbid_digests(monkeypatch)
    ident = model_identity(str(base), override="my-model@v3")
    assert ident != content
    # operators own an override: different weights under one override share it (documented)
    assert model_identity(str(tuned), override="my-model@v3") == ident
    assert model_identity(str(tmp_path / "no-such-dir"), override="my-model@v3") == ident
    assert model_identity("org/not-cached", override="my-model@v3") == ident
    assert model_identity(str(base), override="my-model@v4") != ident
    # an override cannot collide with a content identity, even when spelt like one
    assert model_identity(str(tuned), override=content) != content


# --------------------------------------------------------------------------- Hugging Face cache layout

def test_hf_snapshot_is_identified_by_blob_names(tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                 home: Path) -> None:
    real = hf_snapshot(tmp_path / "hf-a", "org/name", COMMIT_A, hf_files(tiny))
    # Same blob names, other bytes under the weight blob's name (and another size): only the
    # names are used, never the contents.
    lying = hf_snapshot(tmp_path / "hf-b", "org/name", COMMIT_B,
                        hf_files(tiny, weights=b"not the weights the name says"))
    forbid_digests(monkeypatch)
    ident = content_identity(real)
    assert content_identity(lying) == ident
    assert not digest_cache(home).exists()  # nothing digested, nothing to remember
    # another weight blob name is another identity
    files = hf_files(tiny)
    files[WEIGHTS] = ("c" * 64, files[WEIGHTS][1])
    renamed = hf_snapshot(tmp_path / "hf-c", "org/name", COMMIT_A, files)
    assert content_identity(renamed) != ident


def test_hf_config_blob_counts_and_tokenizer_blob_does_not(tiny: Path, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    base = hf_snapshot(tmp_path / "hf-a", "org/name", COMMIT_A, hf_files(tiny))
    files = hf_files(tiny)
    files["tokenizer.json"] = (git_blob_sha1(b"{}"), b"{}")
    tok = hf_snapshot(tmp_path / "hf-b", "org/name", COMMIT_A, files)
    files = hf_files(tiny)
    files["config.json"] = (git_blob_sha1(b"{}"), b"{}")
    cfg = hf_snapshot(tmp_path / "hf-c", "org/name", COMMIT_A, files)
    forbid_digests(monkeypatch)
    assert content_identity(tok) == content_identity(base)
    assert content_identity(cfg) != content_identity(base)


_RESOLVE = r"""
import json, sys
from kvstrata.errors import ConfigError
from kvstrata.identity.fingerprint import model_identity
out = {}
for repo in sys.argv[1:]:
    try:
        out[repo] = model_identity(repo)
    except ConfigError as exc:
        out[repo] = "ConfigError: " + str(exc)
print(json.dumps(out))
"""


def _resolve_in_fresh_process(hf_home: Path, home: Path, *repos: str) -> dict[str, str]:
    """model_identity of hub ids in a process whose huggingface_hub reads ``HF_HOME``
    (the hub library fixes its cache directory when it is imported)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_"))}
    env.update(HOME=str(home), HF_HOME=str(hf_home), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    proc = subprocess.run([sys.executable, "-c", _RESOLVE, *repos], capture_output=True, text=True,
                          env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_hub_id_resolves_through_the_local_cache(tiny: Path, tmp_path: Path, home: Path) -> None:
    hf_home = tmp_path / "hf"
    snapshot = hf_snapshot(hf_home, "org/name", COMMIT_A, hf_files(tiny))
    got = _resolve_in_fresh_process(hf_home, home, "org/name", "org/missing")
    assert got["org/name"] == content_identity(snapshot)
    assert got["org/missing"].startswith("ConfigError: ")
    assert "model.id" in got["org/missing"] and "org/missing" in got["org/missing"]


def test_hub_id_missing_from_an_empty_cache_is_an_error(tmp_path: Path, home: Path) -> None:
    hf_home = tmp_path / "empty-hf"
    hf_home.mkdir()
    got = _resolve_in_fresh_process(hf_home, home, "meta-llama/Llama-3.1-8B-Instruct")
    msg = got["meta-llama/Llama-3.1-8B-Instruct"]
    assert msg.startswith("ConfigError: ") and "model.id" in msg


# --------------------------------------------------------------------------- the per-file digest cache

def test_digest_cache_is_reused(tiny: Path, tmp_path: Path, home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ckpt = copy_of(tiny, tmp_path / "ckpt")
    read = count_digests(monkeypatch)
    ident = content_identity(ckpt)
    assert sorted(read) == ["config.json", WEIGHTS]
    entries = json.loads(digest_cache(home).read_text())
    for name in ("config.json", WEIGHTS):
        real = os.path.realpath(ckpt / name)
        st = os.stat(real)
        key = f"{real}|{st.st_size}|{st.st_mtime_ns}|{st.st_ctime_ns}|{st.st_ino}"
        assert entries[key].startswith(f"xxh3:{st.st_size}:"), (key, entries)
    assert len(entries) == 2  # tokenizer files are neither read nor remembered
    forbid_digests(monkeypatch)
    assert content_identity(ckpt) == ident
    assert model_identity(str(ckpt)) == ident


def test_an_earlier_digest_cache_moves_out_of_the_default_ssd_path(tiny: Path, tmp_path: Path, home: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The digests used to live in ``~/.cache/kvstrata``, the default ``ssd.path``, where
    an SSD tier refuses a directory holding files not its own: they are read from there once,
    moved to their own directory, and the default SSD tier then opens."""
    ckpt = copy_of(tiny, tmp_path / "ckpt")
    ident = content_identity(ckpt)
    moved = digest_cache(home)
    old = home / ".cache" / "kvstrata" / "model-ids.json"
    old.parent.mkdir(parents=True)
    moved.rename(old)
    (old.parent / "model-ids.lock").touch()
    forbid_digests(monkeypatch)  # the earlier cache's entries are used: nothing is read again
    assert content_identity(ckpt) == ident
    assert json.loads(moved.read_text()) and not any(old.parent.iterdir())

    from kvstrata import KVStrataConfig, TieredKVCache

    cache = TieredKVCache(KVStrataConfig.from_dict({"model": {"layers": 1, "kv_heads": 1, "head_size": 8},
                                                    "gpu": {"num_blocks": 4, "device": "cpu"},
                                                    "cpu": {"capacity": 0}}))
    assert cache.ssd is not None and Path(cache.ssd.path) == old.parent
    cache.close()


def test_digest_cache_spares_reading_the_weights(tiny: Path, tmp_path: Path) -> None:
    if os.geteuid() == 0:
        pytest.skip("running as root: chmod 000 does not stop root reading the file "
                    "(test_digest_cache_is_reused proves the reuse another way)")
    ckpt = copy_of(tiny, tmp_path / "ckpt")
    ident = content_identity(ckpt)
    weights = ckpt / WEIGHTS
    mode = weights.stat().st_mode
    weights.chmod(0)
    try:
        with pytest.raises(PermissionError):
            weights.open("rb")
        assert content_identity(ckpt) == ident
    finally:
        weights.chmod(mode)


def test_digest_cache_entry_follows_the_file_version(tiny: Path, tmp_path: Path, home: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    ckpt = copy_of(tiny, tmp_path / "ckpt")
    weights = ckpt / WEIGHTS
    ident = content_identity(ckpt)
    read = count_digests(monkeypatch)
    st = weights.stat()
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    assert content_identity(ckpt) == ident  # same bytes, digested again
    assert read == [WEIGHTS]
    assert len(json.loads(digest_cache(home).read_text())) == 3
    # replaced by another file (another inode), same size and mtime: digested again
    st = weights.stat()
    replacement = ckpt / "replacement.tmp"
    shutil.copyfile(weights, replacement)
    os.utime(replacement, ns=(st.st_atime_ns, st.st_mtime_ns))
    bump_one_tensor(replacement)
    os.utime(replacement, ns=(st.st_atime_ns, st.st_mtime_ns))
    os.replace(replacement, weights)  # created while the old file existed: another inode
    del read[:]
    assert content_identity(ckpt) != ident
    assert read == [WEIGHTS]


def test_in_place_overwrite_with_preserved_mtime_changes_identity(tiny: Path, tmp_path: Path) -> None:
    """A weight file overwritten in place with another checkpoint's bytes of the same size, its
    mtime preserved (cp -p, rsync --inplace -t), is digested again: the ctime moved."""
    ckpt = copy_of(tiny, tmp_path / "ckpt")
    tuned = copy_of(tiny, tmp_path / "tuned")
    bump_one_tensor(tuned / WEIGHTS)
    weights = ckpt / WEIGHTS
    before = content_identity(ckpt)
    st = weights.stat()
    weights.write_bytes((tuned / WEIGHTS).read_bytes())  # same inode, same size
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert content_identity(ckpt) == content_identity(tuned)
    assert content_identity(ckpt) != before


def test_unusable_digest_cache_is_only_a_cache(tiny: Path, tmp_path: Path, home: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    ckpt = copy_of(tiny, tmp_path / "ckpt")
    ident = content_identity(copy_of(tiny, tmp_path / "reference"))
    # corrupt: ignored and rewritten
    digest_cache(home).write_text("{not json")
    assert content_identity(ckpt) == ident
    assert len(json.loads(digest_cache(home).read_text())) >= 2
    # cannot be written (its directory is a file): the identity is still computed
    other = tmp_path / "home2"
    other.mkdir()
    (other / ".cache").write_text("a file, not a directory")
    monkeypatch.setenv("HOME", str(other))
    read = count_digests(monkeypatch)
    assert content_identity(ckpt) == ident
    assert sorted(read) == ["config.json", WEIGHTS]


# --------------------------------------------------------------------------- Fingerprint

BASE = Fingerprint(model="sha:abc", dtype="torch.bfloat16", kv_dtype="auto", block_size=16, block_nbytes=131072,
                   layers=32, kv_heads=8, head_size=128, hash="sha256", tp_size=2, pp_size=1)


def _other_value(value: Any) -> Any:
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + 1
    if isinstance(value, str):
        return value + "x"
    raise AssertionError(f"no other value for {value!r}")


@pytest.mark.parametrize("name", [f.name for f in dataclasses.fields(Fingerprint)])
def test_namespace_differs_when_any_field_differs(name: str) -> None:
    changed = dataclasses.replace(BASE, **{name: _other_value(getattr(BASE, name))})
    assert changed.namespace() != BASE.namespace()
    assert changed.tier_id(0) != BASE.tier_id(0)


def test_equal_fingerprints_share_namespace_and_tier_ids() -> None:
    same = Fingerprint(**dataclasses.asdict(BASE))
    assert same.namespace() == BASE.namespace()
    assert [same.tier_id(r) for r in range(2)] == [BASE.tier_id(r) for r in range(2)]


def test_namespace_does_not_mix_fields() -> None:
    """Field boundaries are kept: moving text from one field to the next is another namespace."""
    a = dataclasses.replace(BASE, dtype="ab", kv_dtype="c")
    b = dataclasses.replace(BASE, dtype="a", kv_dtype="bc")
    assert a.namespace() != b.namespace()


def test_tier_id_per_rank() -> None:
    fp = dataclasses.replace(BASE, tp_size=4)
    ids = [fp.tier_id(r) for r in range(4)]
    assert len(set(ids)) == 4
    assert all(len(i) == 64 and int(i, 16) >= 0 for i in ids)
    assert fp.tier_id() == ids[0]
    for bad in (4, 5, -1):
        with pytest.raises(ValueError, match="tp_rank"):
            fp.tier_id(bad)
    with pytest.raises(ValueError, match="tp_rank"):
        dataclasses.replace(BASE, tp_size=1).tier_id(1)


def test_fingerprint_is_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        BASE.model = "other"  # type: ignore[misc]



_IDENTIFY = """
import sys, time
import kvstrata.identity.fingerprint as identity
real = identity._file_digest
def counted(path):
    with open(sys.argv[2], "a") as log:
        log.write(path + "\\n")
    time.sleep(0.5)  # a large checkpoint: the others arrive while this one reads it
    return real(path)
identity._file_digest = counted
print(identity.content_identity(sys.argv[1]))
"""


def test_processes_identifying_one_checkpoint_read_it_once(tiny: Path, tmp_path: Path, home: Path) -> None:
    """The scheduler and every worker of an engine identify the checkpoint at start-up:
    each used to read all of its weights, and the last to save dropped the others' cache
    entries. One reads; the others wait and take its digests."""
    ckpt = copy_of(tiny, tmp_path / "ckpt")
    log = tmp_path / "digests.log"
    env = {**os.environ, "HOME": str(home), "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    procs = [subprocess.Popen([sys.executable, "-c", _IDENTIFY, str(ckpt), str(log)], stdout=subprocess.PIPE,
                              text=True, env=env) for _ in range(3)]
    idents = {p.communicate(timeout=120)[0].strip() for p in procs}
    assert all(p.returncode == 0 for p in procs)
    assert len(idents) == 1 and idents.pop().startswith("sha:")
    assert sorted(Path(line).name for line in log.read_text().splitlines()) == ["config.json", WEIGHTS]
    assert len(json.loads(digest_cache(home).read_text())) == 2


def test_the_group_structure_is_part_of_the_fingerprint_only_when_there_are_groups() -> None:
    """A hybrid model's keys never meet those of another group structure; a model with one
    full-attention group keeps the namespace (and so the SSD records) it had before groups."""
    base = Fingerprint(model="m", dtype="float16", kv_dtype="auto", block_size=16, block_nbytes=4096, layers=2,
                       kv_heads=2, head_size=64)
    assert b'"groups"' not in base.namespace()
    fields = dataclasses.asdict(base)
    del fields["groups"]
    assert base.namespace() == json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()
    hybrid = dataclasses.replace(base, groups="sliding:64,full")
    other = dataclasses.replace(base, groups="sliding:128,full")
    assert len({base.namespace(), hybrid.namespace(), other.namespace()}) == 3
    assert "groups sliding:64,full" in hybrid.describe()
