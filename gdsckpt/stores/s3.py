"""The S3 store: any S3-compatible service through obstore's S3Store.

    store = S3Store("s3://bucket/run7", timeout=30)   # or gdsckpt.stores.open_store(url)

The endpoint comes from AWS_ENDPOINT_URL_S3, AWS_ENDPOINT_URL or AWS_ENDPOINT (none: AWS itself),
the region from AWS_REGION / AWS_DEFAULT_REGION or the profile, the credentials from the standard
AWS chain (gdsckpt/stores/aws_credentials.py). Nothing here logs or formats a credential: an
endpoint URL with a user or password in it is refused, and errors name the bucket, the key and
the store's error code.
"""

from __future__ import annotations

import os
import re
from urllib.parse import urlsplit

from ..errors import RemoteAccessError, RemoteStoreError
from .aws_credentials import resolve_aws_credentials
from .obstore_store import (
    DEFAULT_CONCURRENCY, DEFAULT_MAX_RETRIES, DEFAULT_PART_BYTES, DEFAULT_TIMEOUT, ObstoreStore, bounded_client,
    obstore_module,
)

SCHEME = "s3://"
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]$")
_ENDPOINT_VARIABLES = ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL", "AWS_ENDPOINT")


def parse_url(url: str) -> tuple[str, str]:
    """"s3://bucket/some/prefix" -> ("bucket", "some/prefix"). One trailing slash is allowed; an
    empty, "." or ".." segment is refused (S3 keys are not paths: such a key is its own object,
    or a request the store refuses)."""
    if not isinstance(url, str) or not url.startswith(SCHEME):
        raise ValueError(f"not an s3:// URL: {url!r}")
    bucket, _, prefix = url[len(SCHEME):].partition("/")
    if not _BUCKET.match(bucket):
        raise ValueError(f"{url!r}: {bucket!r} is not a valid bucket name (3-63 characters: lower-case "
                         "letters, digits, dots and hyphens)")
    if prefix.endswith("/"):
        prefix = prefix[:-1]
    if prefix and any(s in ("", ".", "..") for s in prefix.split("/")):
        raise ValueError(f"{url!r}: the prefix {prefix!r} has an empty ('//'), '.' or '..' segment; name the "
                         "prefix without them")
    return bucket, prefix


def endpoint_from_environment() -> tuple[str, str] | None:
    """(variable, URL) of the endpoint the AWS variables name, checked: an http(s) URL with no
    user or password in it (a ValueError that shows neither)."""
    for var in _ENDPOINT_VARIABLES:
        value = os.environ.get(var)
        if not value:
            continue
        try:
            parts = urlsplit(value)
            has_user = parts.username is not None or parts.password is not None
        except ValueError:
            raise ValueError(f"{var} is not a valid endpoint URL") from None
        if parts.scheme not in ("http", "https"):
            raise ValueError(f"{var} must be an http:// or https:// URL, not {parts.scheme or 'a bare'!r} one")
        if has_user or "@" in parts.netloc:
            raise ValueError(f"{var} has credentials in it ({parts.scheme}://USER:PASSWORD@{parts.hostname}...): "
                             "an endpoint URL is logged and shown in errors, so it must not carry them; put the "
                             "key in AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY or a profile (AWS_PROFILE)")
        return var, value
    return None


class S3Store(ObstoreStore):
    """A bucket and key prefix on an S3-compatible store.

    part_bytes / concurrency: multipart part size and parts in flight (also the ranged reads a
    download or a verify keeps in flight). timeout: every request, its retries included, ends
    within this many seconds (a multipart upload: each part). max_retries: retries of a failed
    request (5xx answers, dropped connections, timeouts of reads), within the same bound.
    """

    BUCKET_MISSING_CODES = frozenset({"NoSuchBucket"})
    ACCESS_CODES = frozenset({"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "InvalidToken",
                              "ExpiredToken", "TokenRefreshRequired", "AllAccessDisabled", "InvalidSecurity"})
    CREDENTIALS_HINT = (" (credentials from AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / AWS_SESSION_TOKEN or "
                        "the profile AWS_PROFILE; values not shown)")

    def __init__(self, url: str, *, part_bytes: int = DEFAULT_PART_BYTES, concurrency: int = DEFAULT_CONCURRENCY,
                 timeout: float = DEFAULT_TIMEOUT, max_retries: int = DEFAULT_MAX_RETRIES):
        bucket, prefix = parse_url(url)
        named = endpoint_from_environment()
        endpoint = named[1] if named else None
        client_options, retry_config = bounded_client(timeout, max_retries,
                                                      allow_http=bool(endpoint and endpoint.startswith("http://")))
        try:
            credentials = resolve_aws_credentials()
        except PermissionError as e:
            raise RemoteAccessError(f"cannot configure the S3 client: {e}", bucket=bucket,
                                    code="NoCredentials") from None
        config = {}
        if endpoint:
            config["endpoint"] = endpoint
        if credentials.region:
            config["region"] = credentials.region
        obstore = obstore_module()
        try:
            client = obstore.store.S3Store(bucket, config=config, client_options=client_options,
                                           retry_config=retry_config, credential_provider=credentials.provider)
        except Exception as e:  # a malformed variable, say: obstore's message names the setting
            text = (str(e).splitlines() or [""])[0][:300]
            for secret in credentials.secrets():
                text = text.replace(secret, "<secret>") if secret else text
            raise RemoteStoreError(f"cannot configure the S3 client: {text}", bucket=bucket) from None
        super().__init__(client, scheme="s3", bucket=bucket, prefix=prefix,
                         endpoint=endpoint or "the AWS default endpoint", part_bytes=part_bytes,
                         concurrency=concurrency, timeout=timeout, secrets=credentials.secrets,
                         missing_credentials=credentials.missing)
