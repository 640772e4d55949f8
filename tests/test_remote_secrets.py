"""The remote tier's secret: guessing it costs a full scrypt run per guess, a weak one is
refused at start naming the file and line, comment lines are not secrets, ``kvstrata
remote secret`` makes one that passes, and none of it ever reaches a log line or an
error. Values sealed under another key, planted with a copied front, or written in the
format before values were versioned are misses. Real Valkey server (tests/valkey_server.py),
real files, the real CLI in a subprocess."""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from kvstrata.config.remote import RemoteConfig
from kvstrata.config.schema import KVStrataConfig
from kvstrata.config.credentials import read_secret_file, secrets_from_env
from kvstrata.errors import ConfigError
from kvstrata.tiers.remote import RemoteTier, key_prefix
from kvstrata.tiers.remote.value import Auth, encode
from kvstrata.tiers.ssd.record import Codec

sys.path.insert(0, str(Path(__file__).parent))
from test_remote_tier import blocks  # noqa: E402
from valkey_server import ValkeyServer  # noqa: E402

NB = 16 * 1024
PREFIX = key_prefix("fingerprint-secrets")
STRONG = b"Zp4-Rw8_Kq2mXv7Ld3Nb9Tc6Hy1Gf5Js0Ua"
PHRASE = b"kvstrata shared cache key"  # 25 bytes: what a dictionary of phrases finds


def remote(server: ValkeyServer) -> RemoteConfig:
    """``remote.*`` for a tier on ``server``, with a 2 s deadline."""
    return RemoteConfig(url=server.url, timeout=2.0)


@pytest.fixture(scope="module")
def server():
    with ValkeyServer() as s:
        yield s


def private(tmp: Path, data: bytes, name: str = "secret") -> str:
    path = tmp / name
    path.write_bytes(data)
    path.chmod(0o600)
    return str(path)


def old_key_id(secret: bytes) -> bytes:
    """The key id every value carried before: an unsalted keyed-BLAKE2b of the bare secret."""
    return hashlib.blake2b(secret, digest_size=4, person=b"kvstrata-key-id").digest()


def old_value(nskey: bytes, row: np.ndarray, secret: bytes) -> bytes:
    """A value in the format before values were versioned and sealed: key id, MAC, header, payload."""
    mac_key = hashlib.blake2b(secret, digest_size=64, person=b"kvstrata-mac-key").digest()
    body = encode(nskey, row.tobytes(), Codec("none"))
    mac = hmac.new(mac_key, len(nskey).to_bytes(2, "big") + nskey + body, "sha256").digest()[:16]
    return old_key_id(secret) + mac + body


def dictionary(n: int = 45_000) -> list[bytes]:
    words = [b"kvstrata", b"shared", b"cache", b"key", b"secret", b"remote", b"fleet", b"prod", b"valkey", b"redis",
             b"team", b"gpu", b"kv", b"llm", b"store"]
    return [b" ".join((a, b, c, d)) for a in words for b in words for c in words for d in words][:n]


# ------------------------------------------------------------------------- guessing a secret

def test_a_value_offers_no_cheap_test_of_a_guessed_secret(server) -> None:
    """A dictionary run over a value's bytes with the cheap hash that named the key before
    found a 25-byte phrase in milliseconds; now nothing in the value is a function of the
    secret computable without scrypt."""
    keys, rows = blocks(1, nbytes=NB)
    t = RemoteTier(remote(server), PREFIX, NB, auth=Auth([PHRASE]))
    assert t.put(keys[0], rows[0]) and t.flush(10)
    value = server.client().get(PREFIX + keys[0])
    t.close()
    start = time.perf_counter()
    guessed = [g for g in dictionary() if old_key_id(g) in (value[:4], value[1:5])]
    assert time.perf_counter() - start < 5  # what a guess cost: 45,000 of them in well under a second
    assert guessed == [], "the value carries a cheap test of a guessed secret"


def test_the_key_id_depends_on_the_secret_only_through_scrypt(monkeypatch) -> None:
    """Testing a guess needs the KDF's output: with scrypt answering one constant, every
    secret has the same key id and keys; the real run costs real time and memory."""
    import kvstrata.tiers.remote.auth as auth_mod

    calls = []

    def fake_scrypt(secret: bytes, **kw):
        calls.append(kw)
        return b"\x11" * 32

    monkeypatch.setattr(auth_mod, "_derived", {})
    monkeypatch.setattr(auth_mod.hashlib, "scrypt", fake_scrypt)
    a, b = auth_mod.derive(b"one guess of the secret 1"), auth_mod.derive(b"another guess of the secret 2")
    assert len(calls) == 2 and a == b
    assert calls[0]["n"] >= 2**15 and calls[0]["r"] >= 8
    monkeypatch.undo()
    monkeypatch.setattr(auth_mod, "_derived", {})
    start = time.perf_counter()
    real = auth_mod.derive(PHRASE)
    assert time.perf_counter() - start > 0.01  # one guess: a full scrypt run (about 0.1 s here)
    assert real.key_id != a.key_id and real.key_id != old_key_id(PHRASE)


# ------------------------------------------------------------------------- values that are misses

def test_values_under_another_key_a_copied_front_or_the_old_format_are_misses(server) -> None:
    keys, rows = blocks(3, nbytes=NB)
    _, evil = blocks(3, seed=5, nbytes=NB)
    r = server.client()
    other = RemoteTier(remote(server), PREFIX, NB, auth=Auth([b"another-fleet-" + STRONG]))
    assert other.put(keys[0], evil[0]) and other.flush(10)
    other.close()
    honest = RemoteTier(remote(server), PREFIX, NB, auth=Auth([STRONG]))
    assert honest.put(keys[2], rows[2]) and honest.flush(10)
    sealed = r.get(PREFIX + keys[2])
    tampered = bytearray(sealed)
    tampered[-40] ^= 1  # one bit of the ciphertext
    r.set(PREFIX + keys[1], bytes(tampered))  # a copied front on another key: the key is authenticated too
    r.set(PREFIX + keys[2], old_value(PREFIX + keys[2], evil[2], STRONG))  # signed, old format, same secret
    out = np.zeros_like(rows)
    for i in range(3):
        assert honest.get_into(keys[i:i + 1], out[i:i + 1]) == 0, f"value {i} was served"
    assert honest.stats()["corrupt"] == 3 and honest.stats()["hits"] == 0
    assert honest.flush(5) and sum(r.exists(PREFIX + k) for k in keys) == 0  # deleted
    assert honest.put(keys[1], rows[1]) and honest.flush(10)
    assert honest.get_into(keys[1:2], out[1:2]) == 1 and np.array_equal(out[1], rows[1])
    honest.close()


def test_a_rotated_fleet_reads_values_of_the_old_secret_and_of_either_mode(server) -> None:
    keys, rows = blocks(2, nbytes=NB)
    old = RemoteTier(remote(server), PREFIX + b"rot:", NB, auth=Auth([STRONG], encrypt=False))
    assert old.put(keys[0], rows[0]) and old.flush(10)
    old.close()
    new = RemoteTier(remote(server), PREFIX + b"rot:", NB, auth=Auth([b"new-" + STRONG, STRONG]))
    assert new.put(keys[1], rows[1]) and new.flush(10)
    out = np.zeros_like(rows)
    assert new.get_into(keys, out) == 2 and np.array_equal(out, rows)
    new.close()


# ------------------------------------------------------------------------- the secret file

@pytest.mark.parametrize("weak", [b"a" * 16, b"correct horse battery staple", b"signing-secret-0123456789",
                                  b"abcdefgh12345678" * 3, PHRASE])
def test_a_weak_secret_is_refused_naming_the_file_and_line_never_the_secret(tmp_path, weak) -> None:
    path = private(tmp_path, b"# the fleet's secret\n\n" + weak + b"\n" + STRONG + b"\n")
    with pytest.raises(ConfigError) as exc:
        read_secret_file(path, "remote.secret_file")
    msg = str(exc.value)
    assert msg.startswith(f"remote.secret_file ({path}): the secret on line 3 is too easy to guess")
    assert "kvstrata remote secret" in msg and weak.decode() not in msg and "\n" not in msg


def test_comment_and_blank_lines_are_not_secrets(tmp_path, monkeypatch) -> None:
    second = b"Hb7_Qx3-Mv9Lk2Pz8Wr4Ny6Tc1Js5Gd0Fa"
    path = private(tmp_path, b"# made by kvstrata remote secret on 2026-12-07\n" + STRONG + b"\n\n"
                   b"  # the previous one, until every replica restarted\n" + second + b"\n")
    assert read_secret_file(path, "remote.secret_file") == [STRONG, second]
    with pytest.raises(ConfigError, match=r"holds no secret"):
        read_secret_file(private(tmp_path, b"# nothing yet\n\n", "empty"), "remote.secret_file")
    monkeypatch.setenv("KVSTRATA_REMOTE_SECRET", "# a comment\n" + "x" * 20)
    with pytest.raises(ConfigError, match=r"^the environment variable KVSTRATA_REMOTE_SECRET: the secret on line 2 "):
        secrets_from_env("KVSTRATA_REMOTE_SECRET")


def test_a_server_password_file_keeps_its_own_rules(tmp_path) -> None:
    """A server's password is the server operator's choice: any non-blank line, as given."""
    assert read_secret_file(private(tmp_path, b"#pw-with-a-hash\n"), "remote.password_file", min_bytes=1,
                            password=True) == [b"#pw-with-a-hash"]


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvstrata.cli", "remote", "secret", *args],
                          capture_output=True, text=True, timeout=60)


def test_a_generated_secret_is_accepted_and_written_owner_only(tmp_path, server, caplog) -> None:
    printed = run_cli()
    assert printed.returncode == 0 and len(printed.stdout.strip()) >= 43
    path = tmp_path / "remote.secret"
    made = run_cli("--output", str(path))
    assert made.returncode == 0 and (path.stat().st_mode & 0o777) == 0o600
    secret = path.read_bytes().strip()
    assert secret != printed.stdout.strip().encode() and secret.decode() not in made.stderr + made.stdout
    again = run_cli("--output", str(path))
    assert again.returncode == 2 and "exists; not overwritten" in again.stderr and "Traceback" not in again.stderr
    assert path.read_bytes().strip() == secret  # nothing lost
    cfg = KVStrataConfig.from_dict({"remote": {"url": server.url, "secret_file": str(path)}})
    assert cfg.remote.secrets() == [secret]
    with caplog.at_level(logging.DEBUG):
        t = RemoteTier(remote(server), PREFIX + b"gen:", NB, auth=Auth(cfg.remote.secrets()))
        keys, rows = blocks(1, nbytes=NB)
        assert t.put(keys[0], rows[0]) and t.flush(10)
        server.client().set(PREFIX + b"gen:" + keys[0], b"\x02" + t.auth.write_id + b"\0" * 64)  # logged as corrupt
        assert t.get_into(keys, np.zeros_like(rows)) == 0
        t.close()
    shown = " ".join(r.getMessage() for r in caplog.records) + repr(t.auth) + repr(cfg.remote)
    assert "does not verify" in shown
    assert secret.decode() not in shown and secret.hex() not in shown


def test_a_weak_secret_stops_the_tier_at_start_and_the_error_and_logs_hold_no_secret(tmp_path, caplog) -> None:
    weak = "fleet secret phrase two"
    path = private(tmp_path, weak.encode() + b"\n")
    cfg = KVStrataConfig.from_dict({"remote": {"url": "redis://127.0.0.1:1/0", "secret_file": path}})
    with caplog.at_level(logging.DEBUG), pytest.raises(ConfigError, match=r"^remote\.secret_file \(.*\): the secret on "
                                                                          r"line 1 is too easy to guess") as exc:
        RemoteTier.from_config(cfg.remote, ["fp"], NB, writer=False)
    assert weak not in str(exc.value) and not any(weak in r.getMessage() for r in caplog.records)
    bad = run_cli("--output", str(tmp_path / "no" / "such" / "dir"))
    assert bad.returncode == 2 and bad.stderr.startswith("kvstrata: error: --output: cannot create")


def test_remote_encrypt_is_a_boolean_and_false_only_signs(tmp_path, monkeypatch) -> None:
    with pytest.raises(ConfigError, match=r"^remote\.encrypt: expected true or false"):
        KVStrataConfig.from_dict({"remote": {"url": "redis://127.0.0.1:1/0", "encrypt": "no"}})
    monkeypatch.setenv("KVSTRATA_REMOTE_SECRET", STRONG.decode())
    cfg = KVStrataConfig.from_dict({"remote": {"url": "redis://127.0.0.1:1/0", "encrypt": False}})
    t = RemoteTier.from_config(cfg.remote, ["fp"], NB, writer=False)
    assert t.auth is not None and not t.auth.encrypt
    t.close()
    t = RemoteTier.from_config(KVStrataConfig.from_dict({"remote": {"url": "redis://127.0.0.1:1/0"}}).remote,
                               ["fp"], NB, writer=False)
    assert t.auth is not None and t.auth.encrypt
    t.close()


def test_a_cryptography_without_encrypt_into_stops_the_tier_at_start(monkeypatch) -> None:
    """An older cryptography (before 47) is a one-line error at start, not a miss (and a
    delete) per value. Stand-in: the real AESGCM class without the two methods."""
    import kvstrata.tiers.remote.auth as auth_mod

    class Old:
        def __init__(self, key: bytes) -> None:
            self.key = key

    monkeypatch.setattr(auth_mod, "_aesgcm", Old)
    with pytest.raises(ConfigError, match=r"^remote\.url: the remote tier encrypts .*\(47 or later\).*found "):
        Auth([STRONG])
