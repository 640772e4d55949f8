"""Only the deployment can write what the remote tier serves: values are signed with its
secret (HMAC-SHA256 over the whole key, the header and the payload), against a real
Valkey server (tests/valkey_server.py; never skipped).

Each attack is what another tenant of the server can do without the secret: plant a
well-formed value under a key it can compute (the format and the xxh3 checksum are
public), squat a key before the honest writer, copy a valid value to another key, or
store a huge value or another type under a block key. Before signing, every one of
these was served as KV or stalled reads."""

from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from kvstrata.config.remote import RemoteConfig
from kvstrata.config.schema import KVStrataConfig
from kvstrata.errors import ConfigError
from kvstrata.tiers.remote import RemoteTier, key_prefix
from kvstrata.tiers.remote.value import Auth, encode
from kvstrata.tiers.ssd.record import Codec

sys.path.insert(0, str(Path(__file__).parent))
from test_remote_tier import blocks  # noqa: E402
from valkey_server import ValkeyServer, secret_file  # noqa: E402

NB = 64 * 1024
PREFIX = key_prefix("fingerprint-auth")
SECRET_A, SECRET_B = b"Qm3v-7XkLp9_aZt2RwYe8NcBj4UsHd6FgT1", b"hV8s_Lq2-Wn5RzK0cXj7PmYb3TfGd9Ua4Ne"


@pytest.fixture
def server():
    with ValkeyServer() as s:
        yield s


def tier(server: ValkeyServer, *secrets: bytes, **kw) -> RemoteTier:
    return RemoteTier(RemoteConfig(url=server.url, timeout=1.0, connect_timeout=1.0), PREFIX, NB,
                      auth=Auth(list(secrets)) if secrets else None, **kw)


def fill(t: RemoteTier, keys, rows) -> None:
    for k, r in zip(keys, rows):
        assert t.put(k, r)
    assert t.flush(10)


def forged(key: bytes, row: np.ndarray) -> bytes:
    """What a tenant without the secret can build: the public format, a valid checksum, and
    a signature of its own making."""
    body = encode(PREFIX + key, row, Codec("none"))
    return b"\0" * 20 + body


def test_a_planted_value_is_never_served_and_is_deleted(server) -> None:
    keys, rows = blocks(4)
    _, evil = blocks(4, seed=9)
    r = server.client()
    for k, e in zip(keys, evil):
        r.set(PREFIX + k, forged(k, e))
    reader = tier(server, SECRET_A)
    out = np.zeros_like(rows)
    assert reader.probe(keys) == 4  # EXISTS cannot tell ...
    assert reader.get_into(keys, out) == 0  # ... the read can: not one forged byte is served
    assert reader.stats()["corrupt"] == 1 and reader.stats()["hits"] == 0
    assert reader.flush(5) and r.exists(PREFIX + keys[0]) == 0  # deleted
    unsigned_format = encode(PREFIX + keys[1], evil[1], Codec("none"))  # the old format, valid checksum
    r.set(PREFIX + keys[1], unsigned_format)
    assert reader.get_into(keys[1:2], out[:1]) == 0
    reader.close()


def test_a_squatted_key_is_taken_back_by_the_honest_writer(server) -> None:
    keys, rows = blocks(6)
    _, evil = blocks(6, seed=7)
    r = server.client()
    for k, e in zip(keys[:3], evil[:3]):
        r.set(PREFIX + k, forged(k, e))  # planted before any replica wrote: SET NX alone would keep it
    writer = tier(server, SECRET_A)
    fill(writer, keys, rows)
    st = writer.stats()
    assert st["replaced"] == 3 and st["written"] == 3
    fill(writer, keys, rows)  # its own values are present now: nothing is sent again
    assert writer.stats()["replaced"] == 3 and writer.stats()["present"] == 6
    reader = tier(server, SECRET_A)
    out = np.zeros_like(rows)
    assert reader.get_into(keys, out) == 6 and np.array_equal(out, rows)
    writer.close(), reader.close()


def test_a_valid_value_copied_to_another_key_does_not_verify(server) -> None:
    keys, rows = blocks(2)
    writer = tier(server, SECRET_A)
    fill(writer, keys[:1], rows[:1])
    r = server.client()
    r.set(PREFIX + keys[1], r.get(PREFIX + keys[0]))  # the MAC binds the key
    out = np.zeros_like(rows)
    assert writer.get_into(keys[1:], out[1:]) == 0 and writer.stats()["corrupt"] == 1
    writer.close()


def test_secrets_rotate_readers_accept_old_and_new_writers_sign_with_the_new(server) -> None:
    keys, rows = blocks(4)
    old = tier(server, SECRET_A)
    fill(old, keys[:2], rows[:2])
    rotated = tier(server, SECRET_B, SECRET_A)  # the new secret first, the old still accepted
    out = np.zeros_like(rows)
    assert rotated.get_into(keys[:2], out[:2]) == 2 and np.array_equal(out[:2], rows[:2])
    fill(rotated, keys[2:], rows[2:])
    only_new = tier(server, SECRET_B)
    assert only_new.get_into(keys[2:], out[2:]) == 2 and np.array_equal(out[2:], rows[2:])
    assert only_new.get_into(keys[:1], out[:1]) == 0  # signed by a secret it does not hold
    assert "b" * 16 not in repr(rotated.auth) and "a" * 16 not in repr(rotated.auth)
    for t in (old, rotated, only_new):
        t.close()


def test_a_huge_value_or_another_type_is_not_read_and_is_deleted(server) -> None:
    keys, rows = blocks(3)
    writer = tier(server, SECRET_A)
    fill(writer, keys[2:], rows[2:])
    r = server.client()
    r.set(PREFIX + keys[0], b"x" * (32 * 1024 * 1024))  # 512x the block
    r.rpush(PREFIX + keys[1], b"a", b"b")
    out = np.zeros_like(rows)
    t0 = time.perf_counter()
    assert writer.get_into(keys[:1], out[:1]) == 0
    assert writer.get_into(keys[1:2], out[1:2]) == 0
    assert writer.get_into(keys[2:], out[2:]) == 1  # other reads go on
    assert time.perf_counter() - t0 < 1.0
    st = writer.stats()
    assert st["corrupt"] == 2 and st["bytes_read"] < 2 * NB  # the 32 MiB were never transferred
    assert writer.flush(5)
    assert r.exists(PREFIX + keys[0]) == 0 and r.exists(PREFIX + keys[1]) == 0
    writer.close()


def test_signed_and_trusted_deployments_never_read_each_other(server) -> None:
    keys, rows = blocks(2)
    assert key_prefix("fp", signed=False) != key_prefix("fp")
    signed = tier(server, SECRET_A)
    trusted = RemoteTier(RemoteConfig(url=server.url), key_prefix("fingerprint-auth", signed=False), NB)
    fill(trusted, keys, rows)
    assert signed.probe(keys) == 0
    signed.close(), trusted.close()


# ---------------------------------------------------------------------------- configuration

def remote_config(tmp: Path, url: str = "redis://127.0.0.1:1/0", **remote) -> KVStrataConfig:
    return KVStrataConfig.from_dict({"remote": {"url": url, **remote}})


def test_without_a_secret_the_tier_does_not_start(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("KVSTRATA_REMOTE_SECRET", raising=False)
    cfg = remote_config(tmp_path)
    with pytest.raises(ConfigError, match=r"^remote\.secret_file: .*KVSTRATA_REMOTE_SECRET.*trust_server"):
        RemoteTier.from_config(cfg.remote, ["fp"], NB)


def test_trusting_the_server_is_a_warning_at_every_start(tmp_path, monkeypatch, caplog) -> None:
    monkeypatch.delenv("KVSTRATA_REMOTE_SECRET", raising=False)
    cfg = remote_config(tmp_path, trust_server=True)
    with caplog.at_level(logging.WARNING, logger="kvstrata.tiers.remote.tier"):
        t = RemoteTier.from_config(cfg.remote, ["fp"], NB, writer=False)
    assert t.auth is None and t.base == key_prefix("fp", signed=False)
    assert any("trust_server" in r.getMessage() for r in caplog.records)
    t.close()


def test_the_secret_comes_from_a_private_file_or_the_environment(tmp_path, monkeypatch) -> None:
    path = secret_file(tmp_path, SECRET_A)
    t = RemoteTier.from_config(remote_config(tmp_path, secret_file=path).remote, ["fp"], NB, writer=False)
    assert t.auth is not None and t.auth.write_id == Auth([SECRET_A]).write_id
    t.close()
    monkeypatch.setenv("KVSTRATA_REMOTE_SECRET", SECRET_B.decode())
    t = RemoteTier.from_config(remote_config(tmp_path).remote, ["fp"], NB, writer=False)
    assert t.auth is not None and t.auth.write_id == Auth([SECRET_B]).write_id
    t.close()


@pytest.mark.parametrize("case", ["group-readable", "symlink", "fifo", "short", "empty", "missing"])
def test_a_secret_file_that_is_not_private_is_refused_naming_the_key(tmp_path, case) -> None:
    path = tmp_path / "secret"
    if case == "group-readable":
        path.write_bytes(SECRET_A)
        path.chmod(0o640)
    elif case == "symlink":
        target = Path(secret_file(tmp_path, SECRET_A, name="real"))
        path.symlink_to(target)
    elif case == "fifo":
        os.mkfifo(path, 0o600)
    elif case in ("short", "empty"):
        path.write_bytes(b"tooshort\n" if case == "short" else b"\n\n")
        path.chmod(0o600)
    cfg = remote_config(tmp_path, secret_file=str(path))
    with pytest.raises(ConfigError, match=r"^remote\.secret_file") as err:
        RemoteTier.from_config(cfg.remote, ["fp"], NB, writer=False)  # never blocks on the FIFO
    assert SECRET_A.decode() not in str(err.value) and "tooshort" not in str(err.value)


def test_the_password_of_the_url_never_reaches_a_log_line_an_error_or_a_repr(caplog) -> None:
    url = "redis://:hunter2-the-password@127.0.0.1:1/0"
    cfg = KVStrataConfig.from_dict({"remote": {"url": url, "trust_server": True}})
    assert "hunter2" not in repr(cfg) and "***" in repr(cfg.remote)
    with pytest.raises(ConfigError) as err:
        KVStrataConfig.from_dict({"remote": {"url": url.replace("/0", "/x")}})
    assert "hunter2" not in str(err.value)
    with caplog.at_level(logging.INFO, logger="kvstrata.tiers.remote.tier"):
        t = RemoteTier.from_config(cfg.remote, ["fp"], NB)  # nobody listens on port 1
        keys, rows = blocks(2)
        for _ in range(4):  # failures, then the breaker's line
            t.get_into(keys, np.zeros_like(rows))
        t.put(keys[0], rows[0])
        t.close(1.0)
    lines = [r.getMessage() for r in caplog.records]
    assert lines and not any("hunter2" in line for line in lines), lines
    assert any("***" in line for line in lines)


def test_the_server_password_comes_from_a_file_and_an_inline_one_is_warned_about(server, tmp_path, monkeypatch,
                                                                                caplog) -> None:
    monkeypatch.delenv("REDISCLI_AUTH", raising=False)
    server.client().config_set("requirepass", "a-server-password")
    pw = tmp_path / "pw"
    pw.write_text("a-server-password\n")
    pw.chmod(0o600)
    keys, rows = blocks(2)
    good = RemoteTier.from_config(remote_config(tmp_path, url=server.url, secret_file=secret_file(tmp_path),
                                                password_file=str(pw)).remote, ["fp"], NB)
    fill(good, keys, rows)
    out = np.zeros_like(rows)
    assert good.get_into(keys, out) == 2 and np.array_equal(out, rows)
    good.close()
    without = RemoteTier.from_config(remote_config(tmp_path, url=server.url, secret_file=secret_file(tmp_path)).remote,
                                     ["fp"], NB, writer=False)
    assert without.get_into(keys, out) == 0 and without.stats()["errors"] == 2  # refused: the join at start, then again
    without.close()
    inline = server.url.replace("redis://", "redis://:a-server-password@")
    with caplog.at_level(logging.WARNING, logger="kvstrata.tiers.remote.tier"):
        t = RemoteTier.from_config(remote_config(tmp_path, url=inline, secret_file=secret_file(tmp_path)).remote,
                                   ["fp"], NB, writer=False)
    assert t.probe(keys) == 2
    assert any("remote.password_file" in r.getMessage() for r in caplog.records)
    assert not any("a-server-password" in r.getMessage() for r in caplog.records)
    t.close()


def test_the_recording_secret_comes_from_a_file(tmp_path) -> None:
    path = secret_file(tmp_path, b"Rc9-Tq4_Wm7Xk2Lp8Zv3Nd6Bh1Gs5Jy0Fa", name="trace.secret")
    cfg = KVStrataConfig.from_dict({"trace": {"path": str(tmp_path / "rec"), "secret_file": path}})
    assert cfg.trace.key() == b"Rc9-Tq4_Wm7Xk2Lp8Zv3Nd6Bh1Gs5Jy0Fa"
    assert "Rc9-Tq4" not in repr(cfg)
    inline = KVStrataConfig.from_dict({"trace": {"path": str(tmp_path), "secret": "an-inline-secret-here"}})
    assert "an-inline" not in repr(inline) and inline.trace.key() == b"an-inline-secret-here"
    with pytest.raises(ConfigError, match=r"^trace\.secret_file: give the secret once"):
        KVStrataConfig.from_dict({"trace": {"path": str(tmp_path), "secret": "an-inline-secret-here",
                                            "secret_file": path}})


def test_what_a_non_redis_server_sends_reaches_the_log_printable_and_bounded(caplog) -> None:
    """Regression: warnings printed whatever garbage a non-Redis server sent."""
    from fake_server import answering

    keys, rows = blocks(2)
    with answering(b"-ERR \x1b[31m\x00\x07" + b"A" * 5000 + b"\r\n") as port, \
            caplog.at_level(logging.WARNING, logger="kvstrata.tiers.remote.tier"):  # an error reply with control bytes
        t = RemoteTier(RemoteConfig(url=f"redis://127.0.0.1:{port}/0", timeout=0.3), PREFIX, NB)
        for _ in range(4):
            t.get_into(keys, np.zeros_like(rows))
        t.close(timeout=1)
    lines = [r.getMessage() for r in caplog.records]
    assert lines
    assert all(line.isprintable() and len(line) < 600 for line in lines), lines
