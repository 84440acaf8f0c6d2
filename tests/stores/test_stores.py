"""The object-store seam (gdsckpt.stores) and its S3 client against a real S3 server (SeaweedFS,
tests/s3_server.py): the Store protocol's operations, the scheme registry, prefix and endpoint
validation, the AWS credential chain (environment, AWS_PROFILE, shared credentials and config
files), errors typed by what went wrong with no secret in their text, and every request bounded
in time against a server that accepts connections and never answers."""

from __future__ import annotations

import socket
import time

import pytest

import gdsckpt
from gdsckpt.errors import (
    BucketNotFoundError, RemoteAccessError, RemoteNotFoundError, RemoteStoreError, RemoteTimeoutError,
    RemoteUnavailableError,
)
from gdsckpt.stores import is_remote, open_store, register, scheme_of
from gdsckpt.stores.s3 import S3Store, parse_url
from s3_server import ACCESS_KEY, REGION, SECRET_KEY


def _blob(n: int, seed: int = 1) -> bytes:
    return bytes((i * 7 + seed) % 251 for i in range(n))


# ---------------------------------------------------------------- the registry


def test_registry_dispatches_by_scheme():
    opened = []

    class MemoryStore:  # any object with the Store operations
        bucket, concurrency = "mem", 1

        def __init__(self, url, **options):
            opened.append((url, options))

    assert not is_remote("test-mem://bucket/p")
    register("test-mem", MemoryStore)
    store = open_store("test-mem://bucket/p", timeout=3)
    assert isinstance(store, MemoryStore) and opened == [("test-mem://bucket/p", {"timeout": 3})]
    assert is_remote("test-mem://bucket/p") and is_remote("s3://bucket/p")
    assert not is_remote("/local/s3://x") and not is_remote("gs://b/x") and not is_remote(b"s3://b/x")
    assert scheme_of("s3://b") == "s3" and scheme_of("relative/path") is None
    with pytest.raises(ValueError, match=r"'gs://b/x' is not an object-store URL \(known schemes: .*s3://"):
        open_store("gs://b/x")
    with pytest.raises(ValueError, match="URL scheme"):
        register("S3 store", MemoryStore)


def test_s3_is_the_built_in_store(s3_env):
    store = open_store(f"s3://{s3_env.new_bucket()}/run")
    assert isinstance(store, S3Store)
    assert store.timeout == 30.0 and store.url() == f"s3://{store.bucket}/run"
    for op in ("url", "put_file", "put_bytes", "get_bytes", "read", "size", "list", "delete", "download"):
        assert callable(getattr(store, op)), op


# ---------------------------------------------------------------- the operations


def test_store_operations_round_trip(tmp_path, s3_env):
    store = open_store(f"s3://{s3_env.new_bucket()}/a/b/", part_bytes=5 << 20, concurrency=3)
    big, small = _blob(12 << 20), _blob(1000, seed=5)
    (tmp_path / "big").write_bytes(big)
    up = store.put_file(tmp_path / "big", "x/big.bin")  # multipart: three parts
    assert up.parts == 3 and up.bytes == len(big) and up.key == "a/b/x/big.bin"
    store.put_bytes("small", small)
    assert store.list() == {"x/big.bin": len(big), "small": len(small)}
    assert store.list("x") == {"x/big.bin": len(big)}
    assert store.size("x/big.bin") == len(big) and store.get_bytes("small") == small
    assert store.read("x/big.bin", 6 << 20, 100) == big[6 << 20:(6 << 20) + 100]
    assert store.read("small", 990, 100) == small[990:]  # fewer only past the end
    assert store.read("small", 0, 0) == b""
    assert store.download("x/big.bin", tmp_path / "back") == len(big)
    assert (tmp_path / "back").read_bytes() == big
    store.delete("small")
    store.delete("small")  # already gone: no error
    assert list(store.list()) == ["x/big.bin"]
    with pytest.raises(RemoteNotFoundError, match=r"no such object .*key 'a/b/small'"):
        store.get_bytes("small")
    with pytest.raises(RemoteNotFoundError):
        store.download("small", tmp_path / "gone")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["back", "big"]  # no temporary left


# ---------------------------------------------------------------- validation


@pytest.mark.parametrize("url, prefix", [("s3://bkt/a/../b", "a/../b"), ("s3://bkt/./x", "./x"),
                                         ("s3://bkt/a//b", "a//b"), ("s3://bkt//a", "/a"), ("s3://bkt/..", ".."),
                                         ("s3://bkt/a/.", "a/.")])
def test_prefix_with_dot_or_empty_segments_refused(url, prefix, tmp_path, s3_env):
    with pytest.raises(ValueError, match=f"the prefix {prefix!r} has an empty"):
        open_store(url)
    with pytest.raises(ValueError, match=f"the prefix {prefix!r}"):
        gdsckpt.Checkpointer(tmp_path, remote=url)


def test_good_prefixes_accepted():
    assert parse_url("s3://bkt") == ("bkt", "")
    assert parse_url("s3://bkt/") == ("bkt", "")
    assert parse_url("s3://bkt/run/7/") == ("bkt", "run/7")
    assert parse_url("s3://bkt/run.7/a..b/.x") == ("bkt", "run.7/a..b/.x")  # dots inside a name are fine


@pytest.mark.parametrize("var", ["AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"])
def test_endpoint_with_a_secret_refused_without_showing_it(var, tmp_path, s3_env, monkeypatch):
    host = s3_env.endpoint[len("http://"):]
    monkeypatch.setenv(var, f"http://AKIAEXAMPLEKEY:Sup3rSecretValue@{host}")
    for attempt in (lambda: open_store("s3://bkt/run"), lambda: gdsckpt.Checkpointer(tmp_path, remote="s3://bkt/run")):
        with pytest.raises(ValueError, match=f"{var} has credentials in it") as e:
            attempt()
        assert "Sup3rSecretValue" not in str(e.value) and "AKIAEXAMPLEKEY" not in str(e.value)


def test_options_validated(s3_env):
    url = f"s3://{s3_env.new_bucket()}/p"
    for bad in (0, -1, float("nan"), float("inf"), "30", True):
        with pytest.raises(ValueError, match="timeout must be a positive number"):
            open_store(url, timeout=bad)
    with pytest.raises(ValueError, match="max_retries"):
        open_store(url, max_retries=-1)
    with pytest.raises(ValueError, match="part_bytes"):
        open_store(url, part_bytes=1 << 20)
    with pytest.raises(ValueError, match="concurrency"):
        open_store(url, concurrency=0)


# ---------------------------------------------------------------- errors, typed


def _no_secret(err: BaseException, *secrets: str) -> None:
    for s in (SECRET_KEY, *secrets):
        assert s not in str(err), str(err)


def test_refused_credentials_are_an_access_error_for_every_operation(tmp_path, s3_env, monkeypatch):
    bucket = s3_env.new_bucket()
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong-secret-value-xyz")
    store = open_store(f"s3://{bucket}/p", timeout=10)
    (tmp_path / "f").write_bytes(b"x")
    for op in (lambda: store.put_file(tmp_path / "f", "f"), lambda: store.put_bytes("f", b"x"),
               lambda: store.get_bytes("f"), lambda: store.size("f"), lambda: store.list(),
               lambda: store.read("f", 0, 1)):
        with pytest.raises(RemoteAccessError, match="refused the request") as e:
            op()
        assert f"bucket {bucket!r}" in str(e.value) and "did not answer" not in str(e.value)
        _no_secret(e.value, "wrong-secret-value-xyz")


def test_missing_bucket_and_missing_object(s3_env):
    store = open_store("s3://no-such-bucket-gdsckpt/p", timeout=10)
    for op in (lambda: store.put_bytes("f", b"x"), lambda: store.list()):
        with pytest.raises(BucketNotFoundError, match="the bucket does not exist"):
            op()
    store = open_store(f"s3://{s3_env.new_bucket()}/p", timeout=10)
    for op in (lambda: store.get_bytes("nope"), lambda: store.size("nope"), lambda: store.read("nope", 0, 4)):
        with pytest.raises(RemoteNotFoundError, match="no such object") as e:
            op()
        assert not isinstance(e.value, BucketNotFoundError)


def test_unreachable_store_is_unavailable_not_a_timeout(s3_env, monkeypatch):
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now: connections are refused
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
    store = open_store("s3://bkt/p", timeout=2)
    t = time.monotonic()
    with pytest.raises(RemoteUnavailableError, match=f"cannot reach the store at http://127.0.0.1:{port}") as e:
        store.size("x")
    assert time.monotonic() - t < 3.5
    assert not isinstance(e.value, RemoteTimeoutError) and "did not answer" not in str(e.value)


# ---------------------------------------------------------------- credentials


def _profile_env(monkeypatch, tmp_path, *, credentials: str = "", config: str = "", profile: str | None = None):
    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE",
              "AWS_DEFAULT_PROFILE"):
        monkeypatch.delenv(k, raising=False)
    (tmp_path / "credentials").write_text(credentials)
    (tmp_path / "config").write_text(config)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "credentials"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "config"))
    if profile is not None:
        monkeypatch.setenv("AWS_PROFILE", profile)


def _round_trip(store) -> None:
    store.put_bytes("probe", b"hello")
    assert store.get_bytes("probe") == b"hello"


def test_aws_profile_from_the_shared_credentials_file(tmp_path, s3_env, monkeypatch):
    bucket = s3_env.new_bucket()
    _profile_env(monkeypatch, tmp_path, profile="training",
                 credentials=f"[default]\naws_access_key_id = wrong\naws_secret_access_key = wrong-default\n"
                             f"[training]\naws_access_key_id = {ACCESS_KEY}\naws_secret_access_key = {SECRET_KEY}\n")
    _round_trip(open_store(f"s3://{bucket}/p"))


def test_default_profile_and_config_file_region(tmp_path, s3_env, monkeypatch):
    bucket = s3_env.new_bucket()
    monkeypatch.delenv("AWS_REGION")
    monkeypatch.delenv("AWS_DEFAULT_REGION")
    _profile_env(monkeypatch, tmp_path, config=f"[default]\nregion = {REGION}\naws_access_key_id = {ACCESS_KEY}\n"
                                               f"aws_secret_access_key = {SECRET_KEY}\n")
    store = open_store(f"s3://{bucket}/p")
    assert store.client.config.get("region") == REGION
    _round_trip(store)


def test_aws_profile_in_the_config_file_through_the_manager(tmp_path, s3_env, monkeypatch):
    from test_manager import OPTS, state_for
    bucket = s3_env.new_bucket()
    _profile_env(monkeypatch, tmp_path, profile="ci",
                 config=f"[profile ci]\naws_access_key_id = {ACCESS_KEY}\naws_secret_access_key = {SECRET_KEY}\n")
    with gdsckpt.Checkpointer(tmp_path / "run", remote=f"s3://{bucket}/p", save_options=OPTS) as ck:
        ck.save(1, state_for(1, n=1000))
        ck.wait(uploads=True, timeout=60)
        assert ck.status()["uploaded"] == [1], ck.status()


def test_environment_keys_win_over_the_profile(tmp_path, s3_env, monkeypatch):
    bucket = s3_env.new_bucket()
    (tmp_path / "credentials").write_text("[p]\naws_access_key_id = wrong\naws_secret_access_key = wrong-profile\n")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "credentials"))
    monkeypatch.setenv("AWS_PROFILE", "p")
    _round_trip(open_store(f"s3://{bucket}/p"))  # AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY are set: used


def test_profile_with_a_wrong_secret_never_shows_it(tmp_path, s3_env, monkeypatch):
    bucket = s3_env.new_bucket()
    _profile_env(monkeypatch, tmp_path, profile="bad",
                 credentials=f"[bad]\naws_access_key_id = {ACCESS_KEY}\naws_secret_access_key = profile-secret-999\n")
    with pytest.raises(RemoteAccessError) as e:
        open_store(f"s3://{bucket}/p", timeout=10).put_bytes("x", b"x")
    _no_secret(e.value, "profile-secret-999")


def test_unknown_profile_named(tmp_path, s3_env, monkeypatch):
    _profile_env(monkeypatch, tmp_path, profile="nonexistent-profile")
    with pytest.raises(RemoteAccessError, match="AWS_PROFILE='nonexistent-profile' is not a profile"):
        open_store("s3://bkt/p")


def test_no_credentials_anywhere_says_so(tmp_path, s3_env, monkeypatch):
    _profile_env(monkeypatch, tmp_path)  # empty files, no variables, no instance metadata (disabled)
    store = open_store("s3://bkt/p", timeout=10)
    t = time.monotonic()
    with pytest.raises(RemoteAccessError, match="no AWS credentials found") as e:
        store.size("x")
    assert time.monotonic() - t < 1 and "did not answer" not in str(e.value)


# ---------------------------------------------------------------- bounded waits


def test_every_operation_bounded_against_a_store_that_never_answers(tmp_path, silent_endpoint):
    store = open_store("s3://bkt/p", timeout=2, part_bytes=5 << 20)
    (tmp_path / "f").write_bytes(_blob(6 << 20))  # two parts
    ops = {"size": lambda: store.size("x"), "get": lambda: store.get_bytes("x"),
           "read": lambda: store.read("x", 0, 10), "list": lambda: store.list(),
           "put": lambda: store.put_bytes("x", b"x"), "delete": lambda: store.delete("x"),
           "upload": lambda: store.put_file(tmp_path / "f", "f"),
           "download": lambda: store.download("x", tmp_path / "d")}
    for what, op in ops.items():
        t = time.monotonic()
        with pytest.raises(RemoteTimeoutError, match=r"did not answer within 2 s") as e:
            op()
        took = time.monotonic() - t
        assert took < 3.0, (what, took)
        assert isinstance(e.value, TimeoutError) and isinstance(e.value, RemoteStoreError)
    assert silent_endpoint.accepted  # the requests did reach it
    assert not (tmp_path / "d").exists()


def test_a_listing_of_many_slow_pages_is_bounded_as_a_whole(tmp_path, monkeypatch, caplog):
    """Each page within the bound, 8 pages of 0.8 s beyond it: the listing ends at the bound."""
    from gdsckpt.manager.checkpointer import Checkpointer
    from s3_server import SlowPagesServer, point_at
    with SlowPagesServer(pages=8, delay=0.8) as slow:
        point_at(monkeypatch, slow.endpoint)
        store = open_store("s3://bkt/p", timeout=2)
        t = time.monotonic()
        with pytest.raises(RemoteTimeoutError, match=r"did not answer within 2 s \(the listing of s3://bkt/p/, all its "
                                                     r"pages") as e:
            store.list()
        assert time.monotonic() - t < 2.5 and slow.endpoint in str(e.value) and "'bkt'" in str(e.value)
        with Checkpointer(tmp_path, remote="s3://bkt/p", remote_options={"timeout": 2}, upload=False) as ck:
            t = time.monotonic()
            assert ck.latest_step() is None  # the store ignored, with a warning
            assert time.monotonic() - t < 2.5
        assert "cannot list s3://bkt/p" in caplog.text


def test_default_bound_is_thirty_seconds(silent_endpoint):
    store = open_store("s3://bkt/p")
    client = store.client.client_options
    retry = store.client.retry_config
    assert store.timeout == 30.0
    assert client["timeout"] == "15s" and client["connect_timeout"] == "5s"  # an attempt: half the bound
    # a retry starts only while attempt + backoff still end within the bound
    assert retry["retry_timeout"].total_seconds() + retry["backoff"]["max_backoff"].total_seconds() <= 15.0
